"""ndweave.mesh: a DeviceMesh, but better.

A named nD mesh over torch's ``DeviceMesh`` with rank mapping for any rank, role getters, the one
documented default mesh (:data:`DEVICE_MESH`), and the contracts other ndweave packages share.
"""

from ndweave.mesh.parallel_mesh import (
    CONTEXT_DIM,
    DEFAULT_DIM_NAMES,
    DEVICE_MESH,
    EXPERT_DIM,
    ROLE_DIMS,
    ParallelMesh,
    init_device_mesh,
)
from ndweave.mesh.fake import fake_world
from ndweave.mesh.lifecycle import ShutdownError, shutdown
from ndweave.mesh.resolve import resolve_mesh
from ndweave.mesh.spec import init_mesh_from_spec, parse_spec, resolve_spec

__version__ = "0.10.15"

__all__ = ["CONTEXT_DIM", "DEFAULT_DIM_NAMES", "DEVICE_MESH", "EXPERT_DIM", "ROLE_DIMS", "ParallelMesh", "ShutdownError", "fake_world",
           "init_device_mesh", "init_mesh_from_spec", "parse_spec", "resolve_mesh", "resolve_spec", "shutdown",
           "__version__"]
