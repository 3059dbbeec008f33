"""``ndweave.mesh.torch_compat``: each private torch API we use still exists and behaves as we rely
on, in the installed torch (that no package or job reaches for one anywhere else, and that
``PRIVATE_TORCH`` names each one used here: ``test_mesh_private_torch.py``)."""

from __future__ import annotations

import re
import tomllib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ndweave.mesh import init_device_mesh
from ndweave.mesh import torch_compat as tc
from ndweave.mesh import fake_world
from ndweave.mesh.testing import distributed

ROOT = Path(__file__).resolve().parents[2]


def test_installed_torch_is_in_the_supported_range():
    floor = tomllib.loads((ROOT / "packages/mesh/pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in floor if d.startswith("torch"))
    minimum = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))
    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert installed >= minimum[:2], f"torch {torch.__version__} is older than the floor {spec}"


def test_chunking_matches_dtensor_sharding():
    t = torch.arange(10)
    assert [len(c) for c in tc.custom_chunk(t, 4, dim=0)] == [3, 3, 3, 1]
    assert [c.tolist() for c in tc.split_tensor(Shard(0), t, 3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    strided = tc.StridedShard(0, split_factor=2)  # pieces [0..4], [5..9]; rank r: its share of each
    assert [c.tolist() for c in tc.split_tensor(strided, t, 2)] == [[0, 1, 2, 5, 6, 7], [3, 4, 8, 9]]
    assert tc.chunk_sizes(strided, 10, 2) == [6, 4] and tc.chunk_sizes(Shard(3), 7, 4) == [2, 2, 2, 1]
    assert [c.tolist() for c in tc.split_indices(tc.StridedShard(3, split_factor=2), t + 10, 2)] == [
        [10, 11, 12, 15, 16, 17], [13, 14, 18, 19]]
    assert tc.is_shard_like(strided) and tc.is_shard_like(Shard(1)) and not tc.is_shard_like(Replicate())


def test_local_shape_at_a_coordinate_without_a_mesh():
    # uneven (torch chunks by ceil: 10 over 4 is 3, 3, 3, 1), two mesh dims on one tensor dim, strided
    assert [tc.local_shape_at((10, 6), (4,), [r], [Shard(0)]) for r in range(4)] == [(3, 6)] * 3 + [(1, 6)]
    assert tc.local_shape_at((8, 6), (2, 2), [1, 0], [Shard(0), Shard(0)]) == (2, 6)
    assert tc.local_shape_at((8, 6), (2, 2), [1, 1], [Replicate(), Shard(1)]) == (8, 3)
    assert tc.local_shape_at((4, 12), (2,), [1], [tc.StridedShard(1, split_factor=3)]) == (4, 6)
    assert tc.local_shape_at((4, 12), (), [], []) == (4, 12)


def test_storage_id_tells_storages_apart_on_meta_and_joins_views():
    with torch.device("meta"):
        a, b = torch.empty(4, 4), torch.empty(4, 4)
    assert a.data_ptr() == b.data_ptr() == 0 and tc.storage_id(a) != tc.storage_id(b)
    assert tc.storage_id(a.t()) == tc.storage_id(a[1:]) == tc.storage_id(a)
    c = torch.ones(3)
    assert tc.storage_id(c.view(3, 1)) == tc.storage_id(c) != tc.storage_id(c.clone())


def test_dense_flatten_round_trip_and_fake_tensors_and_pytrees():
    a, b = torch.arange(3.0), torch.ones(2, 2)
    flat = tc.flatten_dense_tensors([a, b])
    assert flat.tolist() == [0, 1, 2, 1, 1, 1, 1]
    back = tc.unflatten_dense_tensors(flat, [a, b])
    assert torch.equal(back[0], a) and torch.equal(back[1], b)
    with tc.FakeTensorMode():
        fake = torch.empty(4, 4)
    assert isinstance(fake, tc.FakeTensor) and fake.shape == (4, 4)
    leaves, spec = tc.tree_flatten({"x": (1, [2, 3])})
    assert leaves == [1, 2, 3] and tc.tree_unflatten(leaves, spec) == {"x": (1, [2, 3])}
    assert issubclass(tc.DataDependentOutputException, Exception) and issubclass(tc.TorchDispatchMode, object)


def test_backward_callback_runs_after_every_grad():
    w = torch.nn.Parameter(torch.ones(3))
    seen = []
    w.register_hook(lambda g: tc.queue_backward_callback(lambda: seen.append(w.grad.clone())))
    (w * 2).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((3,), 2.0))


def test_is_view_tells_views_from_their_base():
    base = torch.ones(4, 2)
    assert tc.is_view(base[1:]) and tc.is_view(base.view(8)) and not tc.is_view(base) and not tc.is_view(base.clone())


def test_torch_function_disabled_hides_calls_from_torch_function_modes():
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Mode():
        torch.ones(2).add(1)
        with tc.torch_function_disabled():
            torch.ones(2).mul(2)
    assert seen == ["ones", "add"]


def test_current_backward_id_tells_backward_passes_apart():
    w = torch.ones(2, requires_grad=True)
    seen = []
    w.register_hook(lambda grad: seen.append(tc.current_backward_id()))
    (w * 2).sum().backward()
    (w * 3).sum().backward()
    assert tc.current_backward_id() == -1 and len(set(seen)) == 2 and -1 not in seen


def test_fake_store_backs_the_fake_process_group():
    with fake_world(8, rank=3):
        assert dist.get_rank() == 3 and dist.get_world_size() == 8
        assert isinstance(tc.fake_store(), dist.Store)


@distributed(world_size=2)
def test_group_timeout_and_default_store():
    group = dist.new_group([0, 1])
    tc.set_group_timeout(group, timedelta(seconds=7))
    dist.all_reduce(torch.ones(1), group=group)
    assert tc.group_timeout(group, "cpu") == tc.group_timeout(group) == timedelta(seconds=7)
    assert "cpu" in tc.group_device_types(group)
    named = dist.new_group([0, 1], backend="gloo", use_local_synchronization=True, group_desc="torch-compat-probe")
    assert tc.find_group("torch-compat-probe") is named and tc.find_group("no-such-group") is None
    groups = tc.live_groups()  # in creation order, the default group first
    assert groups[0] is dist.group.WORLD and groups.index(group) < groups.index(named)
    store = tc.default_store()
    store.set(f"torch-compat/{dist.get_rank()}", "x")
    store.wait([f"torch-compat/{1 - dist.get_rank()}"], timedelta(seconds=30))


@distributed(world_size=4)
def test_dtensor_internals():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    full = torch.arange(30.0).view(5, 6)
    dt = distribute_tensor(full, mesh.device_mesh, [Shard(0), Shard(1)])
    local = tc.local_tensor(dt)
    assert local.data_ptr() == dt.to_local().data_ptr() and local.grad_fn is None
    assert tc.local_tensor(full) is full
    shape, offset = tc.local_shape_and_offset(full.shape, mesh.device_mesh, dt.placements)
    dp, tp = mesh.get_strategy_coordinate()
    assert shape == tuple(local.shape) and offset == ((0, 3)[dp], 3 * tp)
    assert torch.equal(full[offset[0]: offset[0] + shape[0], offset[1]: offset[1] + shape[1]], local)
    # the same shape from sizes and a coordinate alone, no mesh (what an estimate before launch has)
    assert tc.local_shape_at(full.shape, mesh.device_mesh.shape, [dp, tp], dt.placements) == shape
    flat = tc.flatten_mesh(mesh.device_mesh, "DPTP_compat")
    assert flat.ndim == 1 and flat.size() == 4 and flat.get_local_rank() == dist.get_rank()
    assert tc.root_mesh(mesh["TP"]) == mesh.device_mesh and tc.root_mesh(flat) == mesh.device_mesh
    assert tc.root_mesh(mesh.device_mesh) is mesh.device_mesh
    strided = distribute_tensor(full, mesh["TP"], [tc.StridedShard(1, split_factor=3)])
    pieces = tc.split_tensor(tc.StridedShard(1, split_factor=3), full, 2)
    assert torch.equal(tc.local_tensor(strided), pieces[mesh.lookup_rank("TP")])
    assert isinstance(strided, DTensor)


def test_dtensor_lacks_backward_rule_names_the_ops_whose_backward_dtensor_raises_on():
    # (torch 2.13: pooling's and hardswish's backward have no DTensor rule; gelu's has one; linear and
    # embedding decompose, so autograd never runs linear_backward or embedding_backward)
    assert tc.dtensor_lacks_backward_rule("avg_pool2d") and tc.dtensor_lacks_backward_rule("hardswish")
    assert not any(map(tc.dtensor_lacks_backward_rule, ("gelu", "linear", "embedding", "mm", "no_such_op")))


def test_state_dicts_flatten_as_dcp_saves_them():
    t = torch.ones(2)
    flat, paths = tc.flatten_state_dict({"model": {"fc.weight": t}, "opt": {"param_groups": [{"lr": 0.1, "params": ["a"]}]},
                                         "step": 3})
    assert flat == {"model.fc.weight": t, "opt.param_groups.0.lr": 0.1, "opt.param_groups.0.params": ["a"], "step": 3}
    assert paths["model.fc.weight"] == ("model", "fc.weight") and paths["opt.param_groups.0.lr"] == ("opt", "param_groups", 0, "lr")


@distributed(world_size=2)
def test_mesh_state_adoption_groupless_meshes_and_deep_copyable_dtensor_views():
    import copy

    torch_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    twin = object.__new__(type("Twin", (torch.distributed.device_mesh.DeviceMesh,), {}))
    names = tc.adopt_mesh_state(twin, torch_mesh)
    assert twin == torch_mesh and hash(twin) == hash(torch_mesh) and twin.get_coordinate() == torch_mesh.get_coordinate()
    tc.drop_mesh_state(twin, names)
    assert not vars(twin)
    other = tc.mesh_without_groups("cpu", [[0], [1]], ("A", "B"))
    assert other.mesh.tolist() == [[0], [1]] and other.mesh_dim_names == ("A", "B")
    buffer = torch.arange(10.0)
    view = buffer[2:8].view(2, 3)
    # from_local over a view at an offset cannot be deep-copied (torch); dtensor_over can, sharing storage
    d = tc.dtensor_over(view, torch_mesh, [Replicate()], (2, 3), (3, 1))
    assert tc.local_tensor(d).data_ptr() == view.data_ptr()
    copied = copy.deepcopy(d)
    buffer.zero_()
    assert torch.equal(copied.to_local(), torch.arange(2.0, 8.0).view(2, 3)) and d.to_local().sum() == 0


@distributed(world_size=2)
def test_dtensor_params_and_grads_in_flat_buffers_compile_and_deep_copy():
    """ZeRO's parameters and DDP's grads are DTensors over the memory of flat buffers, at offsets:
    dynamo fakes both when a compiled module runs (it failed: "set the storage of a tensor on device
    cpu to a storage on different device meta"), users deep-copy both (EMA, eval copies)."""
    import copy

    from ndweave.mesh.contracts import move_param_into

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    linear = torch.nn.Linear(4, 6, bias=False, dtype=torch.float64)
    linear.weight = torch.nn.Parameter(DTensor.from_local(torch.ones(3, 4, dtype=torch.float64), mesh, [Shard(0)]))
    params, grads = torch.zeros(30, dtype=torch.float64), torch.zeros(30, dtype=torch.float64)
    move_param_into(linear.weight, params, 10, compilable=True)
    linear.weight.grad = tc.dtensor_over(grads[5:17].view(3, 4), mesh, [Shard(0)], (6, 4), (4, 1), compilable=True)
    assert tc.own_storage_view(params[10:]).storage_offset() == 0
    assert not tc.holds_compiled_code(linear)
    compiled = torch.compile(linear, backend="aot_eager")
    assert tc.holds_compiled_code(compiled)
    x = DTensor.from_local(torch.ones(2, 4, dtype=torch.float64), mesh, [Replicate()])
    for _ in range(2):
        compiled(x).to_local().sum().backward()
        with torch.no_grad():
            params[10:22] += 1.0  # an optimizer stepping the flat buffer: the parameter follows
    assert torch.equal(linear.weight.to_local(), torch.full((3, 4), 3.0, dtype=torch.float64))
    assert torch.equal(grads[5:17], torch.full((12,), 4.0, dtype=torch.float64))  # two backwards of 2 rows each
    weight, grad = copy.deepcopy(linear.weight), copy.deepcopy(linear.weight.grad)
    params.zero_()
    assert weight.to_local().sum() == 36 and grad.to_local().sum() == 48 and linear.weight.to_local().sum() == 0


def test_a_modules_own_parameter_buffer_and_child_dicts_are_torchs():
    m = torch.nn.Linear(2, 2)
    m.register_buffer("table", torch.ones(1), persistent=False)
    m.register_buffer("kept", torch.ones(1))
    assert set(tc.own_parameters(m)) == {"weight", "bias"} and set(tc.own_buffers(m)) == {"table", "kept"}
    assert tc.non_persistent_buffer_names(m) == {"table"} and set(m.state_dict()) == {"weight", "bias", "kept"}
    tc.own_parameters(m)["weight"] = torch.zeros(2, 2)  # a plain tensor in the slot: what the forward uses
    assert torch.equal(m(torch.ones(1, 2)), m.bias.detach().view(1, 2))
    seq = torch.nn.Sequential(m, torch.nn.ReLU())
    tc.own_submodules(seq)["1"] = torch.nn.Identity()
    assert isinstance(seq[1], torch.nn.Identity) and len(list(seq.children())) == 2


def test_op_schemas_and_an_optimizers_state_dict_hooks():
    assert [a.name for a in tc.op_schema(torch.ops.aten.add.Tensor).arguments][:2] == ["self", "other"]
    assert tc.op_schema(torch.add) is None
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: seen.append("post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append("load pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load post"))
    (pre, post), (load_pre, load_post) = tc.optimizer_state_dict_hooks(opt), tc.optimizer_load_state_dict_hooks(opt)
    for hooks, args in ((pre, (opt,)), (post, (opt, {})), (load_pre, (opt, {})), (load_post, (opt,))):
        for hook in hooks.values():
            hook(*args)
    assert seen == ["pre", "post", "load pre", "load post"]


def test_cpus_flash_attention_and_its_cuda_twins():
    q, k, v = torch.randn(3, 1, 2, 8, 16).unbind(0)
    out, logsumexp = tc.flash_attention_cpu(q, k, v, 0.0, True)
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    assert logsumexp.shape == (1, 2, 8)
    assert tc.takes_flash_attention(q, k, v, is_causal=True)  # CPU's pick for float32 without a mask
    pairs = {cpu.__name__: like.__name__ for cpu, like in tc.flash_attention_cpu_ops().items()}
    flash = "_scaled_dot_product_flash_attention"
    assert pairs == {f"{flash}_for_cpu": flash, f"{flash}_for_cpu_backward": f"{flash}_backward"}
    assert tc.tree_leaves({"a": (q, [1])}) == [q, 1]


# ---------------------------------------------------------------------------------------------------
# For ndweave.pipeline: torch's PipelineStage methods it overrides, and aborting a group
# ---------------------------------------------------------------------------------------------------
def test_pipeline_stage_methods_ndweave_overrides_take_the_parameters_it_passes():
    import inspect

    from torch.distributed.pipelining import PipelineStage

    for name, params in tc.PIPELINE_STAGE_OVERRIDES.items():
        taken = tuple(inspect.signature(getattr(PipelineStage, name)).parameters)[1:]  # (after self)
        assert taken == params, f"PipelineStage.{name}{taken}: ndweave.pipeline's override passes {params}"
    takes_get_mesh = "get_mesh" in inspect.signature(PipelineStage.__init__).parameters
    lookup = object()
    assert tc.pipeline_stage_kwargs(lookup) == ({"get_mesh": lookup} if takes_get_mesh else {})


def test_pipeline_stage_base_hands_shape_inference_buffers_to_a_public_method():
    from torch.distributed.pipelining import PipelineStage

    seen = []

    class Stage(tc.PipelineStageBase):
        def shape_inference_buffer(self, arg, tensor):
            seen.append((arg, tensor))
            return torch.zeros(1)

    assert issubclass(Stage, PipelineStage)
    stage = object.__new__(Stage)  # (making a buffer needs no process group)
    stage.device = torch.device("cpu")
    arg = torch.ones(3)
    buffer = stage._to_tensor(arg)  # what torch's shape inference calls
    (got, made), = seen
    assert got is arg and torch.equal(made, arg) and buffer.tolist() == [0.0]


@distributed(world_size=2, timeout=60)
def test_abort_group_releases_a_peer_waiting_on_it_and_a_new_group_gets_another_name():
    import gc
    import time

    group = dist.new_group([0, 1], use_local_synchronization=True)
    name = group.group_name
    dist.all_reduce(torch.ones(1), group=group)
    dist.barrier()
    start = time.monotonic()
    if dist.get_rank() == 1:
        tc.abort_group(group)
        del group
        gc.collect()  # gloo closes the group's connections once it is freed
    else:
        try:
            dist.recv(torch.empty(1), src=1, group=group)
        except RuntimeError as error:
            assert "by peer" in str(error), error
        else:
            raise AssertionError("the receive from the aborted rank returned")
        assert time.monotonic() - start < 10, f"released after {time.monotonic() - start:.1f} s"
        tc.abort_group(group)
        del group
        gc.collect()
    dist.barrier()
    # torch names such groups after their ranks and its count of live groups: not the aborted one's
    fresh = dist.new_group([0, 1], use_local_synchronization=True)
    assert fresh.group_name != name
    total = torch.ones(1)
    dist.all_reduce(total, group=fresh)
    assert total.item() == 2


def test_torch_memory_tracker_loads_only_when_used():
    """``torch.distributed._tools`` (torch's memory tracker, imported with it: FSDP, the SAC and
    runtime estimators) loaded with mesh on every rank was followed by rank heaps corrupted later in
    dmodule's suite; mesh, its test harness and every package import without it."""
    import subprocess
    import sys

    packages = ["ndweave.mesh", "ndweave.mesh.testing"]
    code = ("import importlib, sys\n"
            f"for name in {packages!r}: importlib.import_module(name)\n"
            "for name in ('ndweave.plan.calibrate', 'ndweave.plan.layouts', 'ndweave.dmodule', 'ndweave.ddp', 'ndweave.optim', 'ndweave.pipeline', 'ndweave.checkpoint'):\n"
            "    try:\n        importlib.import_module(name)\n    except ImportError:\n        pass  # not installed beside mesh\n"
            "loaded = 'torch.distributed._tools' in sys.modules\n"
            "from ndweave.mesh.testing.memory import TensorMemory\n"
            "print(loaded, 'torch.distributed._tools' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout


def test_compile_counts_count_graphs_breaks_and_recompiles():
    def f(x):
        y = x.sin()
        torch._dynamo.graph_break()  # noqa: SLF001 (a break on purpose)
        return y.cos()

    torch.compiler.reset()
    tc.reset_compile_counts()
    compiled = torch.compile(f, backend="eager")
    compiled(torch.ones(3))
    counts = tc.compile_counts()
    assert counts.graphs == 2 and sum(counts.graph_breaks.values()) == 1 and counts.frames >= 1
    tc.reset_compile_counts()
    compiled(torch.ones(3))  # same shapes: nothing compiled again
    assert tc.compile_counts() == tc.CompileCounts(frames=0, graphs=0, graph_breaks={})
    compiled(torch.ones(4))  # another size: compiled again, and why (the input named)
    assert "tensor 'x' size mismatch at index 0. expected 3, actual 4" in tc.compile_counts().recompiles


def test_a_break_reason_is_its_first_line_or_the_reason_given_to_disable():
    kept_out = torch.compiler.disable(lambda x: x + 1, reason="sizes from the data")

    def f(x):
        y = kept_out(x.sin())
        torch._dynamo.graph_break()  # noqa: SLF001 (a break on purpose)
        return y.cos()

    torch.compiler.reset()
    tc.reset_compile_counts()
    torch.compile(f, backend="eager")(torch.ones(3))
    reasons = tc.compile_counts().break_reasons()
    assert len(reasons) == 2 and "sizes from the data" in reasons and all("\n" not in r for r in reasons), reasons
