"""The data-parallel dimension of a job: its world size and this process's rank in it.

Under tensor, sequence or context parallelism several ranks share one batch: the sampler, the
streaming stage and the loss's token count must use the *data-parallel* rank and size, not the
global ones, or two peers of one SP/TP group get different samples (and their tokens are counted
twice). Pass either a ``dp_group`` (a ``torch.distributed.ProcessGroup`` spanning the DP ranks that
hold *different* data, with this process in it) or a ``device_mesh`` (a ``DeviceMesh``).

How the dimension of a ``device_mesh`` is chosen:

- a 1-D mesh: its only dimension (so ``mesh["dp"]`` always works);
- otherwise the dimension named ``"dp"``;
- otherwise the dimensions named ``"dp_replicate"`` and ``"dp_shard"`` (accelerate's and
  torchtitan's HSDP names; either or both), flattened row-major in mesh order;
- anything else is an error listing the mesh's dimension names (slice the mesh yourself, e.g.
  ``device_mesh=mesh["data"]``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["dp_group_of", "resolve_dp"]

_HSDP_DIMS = ("dp_replicate", "dp_shard")


def _mesh_dp(mesh: Any) -> tuple[int, int]:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh.ndim == 1:
        return int(mesh.size()), int(mesh.get_local_rank())
    if "dp" in names:
        return int(mesh.size(names.index("dp"))), int(mesh.get_local_rank("dp"))
    dims = [n for n in names if n in _HSDP_DIMS]
    if dims:
        size, rank = 1, 0
        for n in dims:   # mesh order: row-major flattening, as DeviceMesh._flatten does
            k = int(mesh.size(names.index(n)))
            size, rank = size * k, rank * k + int(mesh.get_local_rank(n))
        return size, rank
    raise ValueError(f"device_mesh has dimensions {list(names) or '(unnamed)'}: none is the data-parallel "
                     "one; name it 'dp' (or 'dp_replicate' / 'dp_shard'), or pass the DP sub-mesh, e.g. "
                     "device_mesh=mesh['data']")


def resolve_dp(num_replicas: int | None = None, rank: int | None = None, dp_group: Any = None,
               device_mesh: Any = None) -> tuple[int | None, int | None]:
    """``(num_replicas, rank)`` of the data-parallel dimension given by ``dp_group`` or
    ``device_mesh``; ``num_replicas`` / ``rank`` unchanged when neither is given. Raises
    ``ValueError`` when both are given, or when an explicit ``num_replicas`` / ``rank`` disagrees."""
    if dp_group is None and device_mesh is None:
        return num_replicas, rank
    if dp_group is not None and device_mesh is not None:
        raise ValueError("pass dp_group or device_mesh, not both")
    if device_mesh is not None:
        size, me = _mesh_dp(device_mesh)
        source = "device_mesh"
    else:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("dp_group needs an initialised torch.distributed process group")
        size, me = int(dist.get_world_size(dp_group)), int(dist.get_rank(dp_group))
        if me < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of dp_group")
        source = "dp_group"
    if num_replicas is not None and int(num_replicas) != size:
        raise ValueError(f"num_replicas={num_replicas} disagrees with {source}, whose data-parallel size "
                         f"is {size}")
    if rank is not None and int(rank) != me:
        raise ValueError(f"rank={rank} disagrees with {source}, where this process has data-parallel "
                         f"rank {me}")
    return size, me


def dp_group_of(dp_group: Any = None, device_mesh: Any = None) -> Any:
    """The ``ProcessGroup`` of the data-parallel dimension (for collectives such as the loss's token
    count): ``dp_group`` itself, or the DP dimension of ``device_mesh`` chosen as above (the HSDP pair
    must be flattened first: ``mesh["dp_replicate", "dp_shard"]._flatten("dp")``, or pass its group).
    ``None`` (the default group) when neither is given."""
    if dp_group is not None and device_mesh is not None:
        raise ValueError("pass dp_group or device_mesh, not both")
    if device_mesh is None:
        return dp_group
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if device_mesh.ndim == 1:
        return device_mesh.get_group()
    if "dp" in names:
        return device_mesh.get_group("dp")
    raise ValueError(f"device_mesh has dimensions {list(names) or '(unnamed)'}: for a process group, name "
                     "the data-parallel one 'dp' or pass dp_group= (or the DP sub-mesh) directly")
