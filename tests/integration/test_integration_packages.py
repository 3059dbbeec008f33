def test_every_package_imports_together():
    import ndweave.checkpoint
    import ndweave.ddp
    import ndweave.dmodule
    import ndweave.mesh
    import ndweave.optim
    import ndweave.pipeline

    versions = {m.__name__: m.__version__ for m in (ndweave.checkpoint, ndweave.ddp, ndweave.dmodule, ndweave.mesh, ndweave.optim, ndweave.pipeline)}
    assert all(v.count(".") == 2 for v in versions.values()), versions
