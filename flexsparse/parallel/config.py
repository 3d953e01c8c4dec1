"""``ParallelConfig``: which process groups shard an attention call's sequence."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

ULYSSES, RING = "ulysses", "ring"   # mesh dim names, as in diffusers' ContextParallelConfig


@dataclass(frozen=True)
class ParallelConfig:
    """Sequence parallelism of attention calls over the ``"ulysses"`` and ``"ring"`` dims of a ``DeviceMesh``.

    The sequence is split into contiguous shards over the ranks of the two dims, ring index major: the rank at
    ring index r and ulysses index u holds shard ``r * ulysses_degree + u`` (rank order, any lengths) for every
    head. Ulysses: an all-to-all gives each rank its ring shard's tokens for ``H / ulysses_degree`` heads
    (``flexsparse.parallel.ulysses``). Ring, where heads run out: the ranks of the ring group hold the same heads
    and exchange keys and values (``flexsparse.parallel.ring``; methods with a ``ring`` strategy). Other mesh dims
    (e.g. data parallel) are left alone; a missing dim counts as size 1.

    mesh: a ``DeviceMesh`` with a dim named ``"ulysses"`` or ``"ring"`` (or both);
    ``ParallelConfig.setup(ulysses_degree=P, ring_degree=R)`` builds one over the default process group.
    """

    mesh: DeviceMesh

    def __post_init__(self):
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"ParallelConfig(mesh=...) needs a torch.distributed DeviceMesh, got "
                            f"{type(self.mesh).__name__}")
        names = self.mesh.mesh_dim_names or ()
        if ULYSSES not in names and RING not in names:
            raise ValueError(f"ParallelConfig: the mesh needs a dim named {ULYSSES!r} or {RING!r} (the "
                             f"sequence-parallel groups), got dims {names}")

    @classmethod
    def setup(cls, ulysses_degree: int = 1, device_type: str | None = None, *,
              ring_degree: int = 1) -> "ParallelConfig":
        """A config over the default process group: mesh ``(world / (R P), R, P)`` with dims ``("data", "ring",
        "ulysses")`` for ``ring_degree=R``, ``ulysses_degree=P``; ``device_type`` defaults to ``"cuda"`` when CUDA is
        available, else ``"cpu"``."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelConfig.setup needs torch.distributed initialised (init_process_group)")
        world = dist.get_world_size()
        for name, degree in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ValueError(f"{name} must be a positive int, got {degree!r}")
        if world % (ulysses_degree * ring_degree):
            raise ValueError(f"ring_degree * ulysses_degree = {ring_degree} * {ulysses_degree} must divide the "
                             f"world size {world}")
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(init_device_mesh(device_type, (world // (ulysses_degree * ring_degree), ring_degree,
                                                  ulysses_degree), mesh_dim_names=("data", RING, ULYSSES)))

    @staticmethod
    def check(value) -> "ParallelConfig | None":
        """``value`` after checking that it is a ``ParallelConfig`` or None (the ``parallel=`` argument)."""
        if value is not None and not isinstance(value, ParallelConfig):
            raise TypeError(f"parallel must be a flexsparse.ParallelConfig or None, got {type(value).__name__}")
        return value

    @property
    def communicates(self) -> bool:
        """Whether a call exchanges anything: a sequence-parallel dim of size > 1."""
        return self.ulysses_degree > 1 or self.ring_degree > 1

    # read once: slicing a mesh on every call would cost host time
    @cached_property
    def ulysses_degree(self) -> int:
        return self._size(ULYSSES)

    @cached_property
    def ulysses_rank(self) -> int:
        """This process's index in its ``"ulysses"`` group."""
        return self._rank(ULYSSES)

    @cached_property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(ULYSSES)

    @cached_property
    def ring_degree(self) -> int:
        return self._size(RING)

    @cached_property
    def ring_rank(self) -> int:
        """This process's index in its ``"ring"`` group."""
        return self._rank(RING)

    @cached_property
    def ring_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(RING)

    @cached_property
    def shard_index(self) -> int:
        """Which of the ``ring_degree * ulysses_degree`` contiguous shards of the sequence this process holds."""
        return self.ring_rank * self.ulysses_degree + self.ulysses_rank

    def _size(self, dim: str) -> int:
        return self.mesh[dim].size() if dim in (self.mesh.mesh_dim_names or ()) else 1

    def _rank(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim) if dim in (self.mesh.mesh_dim_names or ()) else 0
