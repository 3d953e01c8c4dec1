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
    """Sequence parallelism of attention calls over the ``"ulysses"`` dim of a ``DeviceMesh``.

    Each rank of the ``"ulysses"`` group holds a contiguous shard of the sequence (rank order, any lengths) for
    every head; an all-to-all gives each rank the whole sequence for ``H / ulysses_degree`` heads, the method runs
    on them as in one process, and an all-to-all returns the output shard (``flexsparse.parallel.ulysses``). Other
    mesh dims (e.g. data parallel) are left alone. A ``"ring"`` dim of size > 1 is rejected (not implemented).

    mesh: a ``DeviceMesh`` with a dim named ``"ulysses"``; ``ParallelConfig.setup(ulysses_degree=P)`` builds one
    over the default process group (``(world / P, P)`` with dims ``("data", "ulysses")``).
    """

    mesh: DeviceMesh

    def __post_init__(self):
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"ParallelConfig(mesh=...) needs a torch.distributed DeviceMesh, got "
                            f"{type(self.mesh).__name__}")
        names = self.mesh.mesh_dim_names or ()
        if ULYSSES not in names:
            raise ValueError(f"ParallelConfig: the mesh needs a dim named {ULYSSES!r} (the sequence-parallel "
                             f"group), got dims {names}")
        if RING in names and self.mesh.size(names.index(RING)) > 1:
            raise NotImplementedError("ParallelConfig: ring attention (a 'ring' mesh dim of size > 1) is not "
                                      "implemented; put every sequence-parallel rank on the 'ulysses' dim")

    @classmethod
    def setup(cls, ulysses_degree: int, device_type: str | None = None) -> "ParallelConfig":
        """A config over the default process group: mesh ``(world / ulysses_degree, ulysses_degree)`` with dims
        ``("data", "ulysses")``; ``device_type`` defaults to ``"cuda"`` when CUDA is available, else ``"cpu"``."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelConfig.setup needs torch.distributed initialised (init_process_group)")
        world = dist.get_world_size()
        if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1 \
                or world % ulysses_degree:
            raise ValueError(f"ulysses_degree must be a positive int dividing the world size {world}, "
                             f"got {ulysses_degree!r}")
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(init_device_mesh(device_type, (world // ulysses_degree, ulysses_degree),
                                    mesh_dim_names=("data", ULYSSES)))

    @staticmethod
    def check(value) -> "ParallelConfig | None":
        """``value`` after checking that it is a ``ParallelConfig`` or None (the ``parallel=`` argument)."""
        if value is not None and not isinstance(value, ParallelConfig):
            raise TypeError(f"parallel must be a flexsparse.ParallelConfig or None, got {type(value).__name__}")
        return value

    # read once: slicing a mesh on every call would cost host time
    @cached_property
    def ulysses_degree(self) -> int:
        return self.mesh[ULYSSES].size()

    @cached_property
    def ulysses_rank(self) -> int:
        """This process's index in its ``"ulysses"`` group: the shard of the sequence it holds."""
        return self.mesh.get_local_rank(ULYSSES)

    @cached_property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(ULYSSES)
