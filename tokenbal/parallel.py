"""The parallel layout of a job: the data-parallel and sequence-parallel sizes, ranks and groups.

:class:`ParallelLayout` is the dp x sp split, checked once: built from a world size
(``ParallelLayout.from_world``, for planning), a ``DeviceMesh`` (``from_mesh``) or the default
process group (``ParallelLayout.init``, which makes the ``("dp", "sp")`` mesh), and handed to what
needs a part of it: the sampler (``num_replicas=layout.dp_size, rank=layout.dp_rank`` or
``device_mesh=layout.mesh``), ``PackedCollator.from_config(..., layout=)``,
``collate.sp.shard_batch(batch, layout=)`` and the loss (``dp_group=layout.dp_group``).

Under tensor, sequence or context parallelism several ranks share one batch: the sampler, the
streaming stage and the loss's token count must use the *data-parallel* rank and size, not the
global ones, or two peers of one SP/TP group get different samples (and their tokens are counted
twice). Pass either a ``dp_group`` (a ``torch.distributed.ProcessGroup`` spanning the DP ranks that
hold *different* data, with this process in it) or a ``device_mesh`` (a ``DeviceMesh``).

How the dimension of a ``device_mesh`` is chosen:

- a 1-D mesh: its only dimension (so ``mesh["dp"]`` always works), unless it is named as a
  dimension whose ranks share one batch (``"sp"``, ``"cp"``, ``"tp"``, ``"pp"``): that is an
  error, never the peers of one group handed different samples (for sequence parallelism alone make
  the ``("dp", "sp")`` mesh with ``dp`` of size 1);
- otherwise the dimension named ``"dp"``;
- otherwise the dimensions named ``"dp_replicate"`` and ``"dp_shard"`` (accelerate's and
  torchtitan's HSDP names; either or both), flattened row-major in mesh order;
- anything else is an error listing the mesh's dimension names (slice the mesh yourself, e.g.
  ``device_mesh=mesh["data"]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ParallelLayout", "collective_device", "dp_group_of", "resolve_dp"]

_HSDP_DIMS = ("dp_replicate", "dp_shard")
# Dimensions whose ranks hold the *same* data (sequence / context / tensor / pipeline parallel
# peers): never the data-parallel one, even as the only dimension of a mesh. Not "ep": expert
# parallelism is usually carved out of the data-parallel ranks, which hold different data.
_SHARED_BATCH_DIMS = ("sp", "cp", "tp", "pp")


def _check_1d_mesh(mesh: Any) -> None:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if names and names[0] in _SHARED_BATCH_DIMS:
        raise ValueError(f"device_mesh is the 1-D mesh {names[0]!r}, whose ranks share one batch: it is not "
                         "the data-parallel dimension (its ranks would get different samples). Pass the DP "
                         "mesh or dp_group=, or for sequence parallelism alone a ('dp', 'sp') mesh with dp "
                         f"of size 1: init_device_mesh(device, (1, {int(mesh.size())}), "
                         "mesh_dim_names=('dp', 'sp'))")


def _mesh_dp(mesh: Any) -> tuple[int, int]:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh.ndim == 1:
        _check_1d_mesh(mesh)
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


@dataclass(frozen=True)
class ParallelLayout:
    """How a job's ranks split into data-parallel groups of ``sp_size`` sequence-parallel peers
    (the peers of one group share one packed row). Ranks ``[d*S, (d+1)*S)`` form data-parallel
    group ``d`` (row-major, as ``init_device_mesh(..., (world // S, S), ("dp", "sp"))`` lays
    them out). The groups and mesh are None when the layout was made from numbers alone."""

    dp_size: int
    dp_rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0
    dp_group: Any = None
    sp_group: Any = None
    mesh: Any = None

    def __post_init__(self) -> None:
        for name in ("dp_size", "sp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not 0 <= self.dp_rank < self.dp_size or not 0 <= self.sp_rank < self.sp_size:
            raise ValueError(f"ranks out of range: dp_rank={self.dp_rank} of {self.dp_size}, "
                             f"sp_rank={self.sp_rank} of {self.sp_size}")

    @property
    def world_size(self) -> int:
        return self.dp_size * self.sp_size

    @classmethod
    def from_world(cls, world_size: int, sp_size: int = 1, rank: int = 0) -> ParallelLayout:
        """The layout of ``world_size`` ranks in SP groups of ``sp_size``, seen from global ``rank``;
        ``ValueError`` unless ``sp_size`` divides ``world_size``."""
        world_size, sp_size, rank = int(world_size), int(sp_size), int(rank)
        if sp_size < 1 or world_size < 1 or world_size % sp_size:
            raise ValueError(f"sp_size={sp_size} must divide the world size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world size {world_size})")
        return cls(world_size // sp_size, rank // sp_size, sp_size, rank % sp_size)

    @classmethod
    def from_mesh(cls, mesh: Any) -> ParallelLayout:
        """The layout of a ``DeviceMesh``: its ``"sp"`` dimension (size 1 without one) and its
        data-parallel dimension, chosen as the module docstring says."""
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        sp_size, sp_rank, sp_group = 1, 0, None
        if "sp" in names and mesh.ndim > 1:
            sp_size, sp_rank = int(mesh.size(names.index("sp"))), int(mesh.get_local_rank("sp"))
            sp_group = mesh.get_group("sp")
        dp_size, dp_rank = _mesh_dp(mesh)
        dp_group = dp_group_of(device_mesh=mesh) if mesh.ndim == 1 or "dp" in names else None
        return cls(dp_size, dp_rank, sp_size, sp_rank, dp_group, sp_group, mesh)

    @classmethod
    def init(cls, sp_size: int = 1, device_type: str = "cpu") -> ParallelLayout:
        """The layout of the default process group: a ``("dp", "sp")`` ``DeviceMesh`` with SP groups
        of ``sp_size`` (checked before the mesh is made)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        cls.from_world(world, sp_size, dist.get_rank())
        return cls.from_mesh(init_device_mesh(device_type, (world // sp_size, sp_size),
                                              mesh_dim_names=("dp", "sp")))


def resolve_dp(num_replicas: int | None = None, rank: int | None = None, dp_group: Any = None,
               device_mesh: Any = None,
               layout: ParallelLayout | None = None) -> tuple[int | None, int | None]:
    """``(num_replicas, rank)`` of the data-parallel dimension given by ``dp_group``,
    ``device_mesh`` or ``layout``; ``num_replicas`` / ``rank`` unchanged when none is given. Raises
    ``ValueError`` when more than one is given, or when an explicit ``num_replicas`` / ``rank``
    disagrees."""
    if dp_group is None and device_mesh is None and layout is None:
        return num_replicas, rank
    if dp_group is not None and device_mesh is not None:
        raise ValueError("pass dp_group or device_mesh, not both")
    if layout is not None and (dp_group is not None or device_mesh is not None):
        raise ValueError("pass layout or dp_group / device_mesh, not both")
    if layout is not None:
        size, me = layout.dp_size, layout.dp_rank
        source = "layout"
    elif device_mesh is not None:
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
        _check_1d_mesh(device_mesh)
        return device_mesh.get_group()
    if "dp" in names:
        return device_mesh.get_group("dp")
    raise ValueError(f"device_mesh has dimensions {list(names) or '(unnamed)'}: for a process group, name "
                     "the data-parallel one 'dp' or pass dp_group= (or the DP sub-mesh) directly")


def collective_device(group: Any = None) -> Any:
    """The ``torch.device`` whose tensors ``group``'s collectives take: the CPU where the group has a
    CPU backend (gloo, MPI, UCC, or a mixed ``"cpu:gloo,cuda:nccl"``), else this process's current
    accelerator device of the group's kind (NCCL: the current CUDA device; HCCL: the current NPU).

    An NCCL- or HCCL-only group has no CPU backend at all, so a CPU tensor handed to its
    ``all_reduce`` fails ("No backend type associated with device type cpu"); a small collective on
    the accelerator is the price of not asking users for a second, gloo group."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if ":" in backend:       # "cpu:gloo,cuda:nccl": a backend per device type
        kinds = [pair.split(":", 1)[0].strip().lower() for pair in backend.split(",")]
    else:                    # one backend: the device types it was registered for
        kinds = list(dist.Backend.backend_capability.get(backend.lower(), ["cpu"]))
    if "cpu" in kinds or not kinds:
        return torch.device("cpu")
    kind = kinds[0]
    current = torch.accelerator.current_accelerator()
    if current is not None and current.type == kind:
        return torch.device(kind, torch.accelerator.current_device_index())
    return torch.device(kind)
