"""The all-to-alls of Ulysses sequence parallelism, differentiable, with shards of any lengths.

Each exchange is ``torch.distributed``'s functional ``all_to_all_single`` waited on at once, forward and backward
(``_AllToAll``): the autograd variant leaves the backward's result unwaited (torch warns at exit of collectives
never waited on), which on an asynchronous backend lets the next kernel read it before it has arrived.

A rank's shard is ``(B, Hx, n_r, D)``: tokens ``[sum(n_<r), sum(n_<=r))`` of the sequence, every head.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol


def shard_lengths(q: torch.Tensor, k: torch.Tensor, group: dist.ProcessGroup) -> tuple[list[int], list[int]]:
    """Every rank's query and key shard lengths, in rank order: one all-gather of two integers (a host sync)."""
    mine = torch.tensor([q.shape[2], k.shape[2]], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).tolist()
    return [n_q for n_q, _ in table], [n_k for _, n_k in table]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of a flat tensor; the backward sends the gradient back the same way."""

    @staticmethod
    def forward(ctx, x, output_sizes: list[int], input_sizes: list[int], group):
        ctx.sizes, ctx.group = (output_sizes, input_sizes), group
        return _exchange(x, output_sizes, input_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        output_sizes, input_sizes = ctx.sizes
        return _exchange(grad.contiguous(), input_sizes, output_sizes, ctx.group), None, None, None


def _exchange(x: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single(x, output_sizes, input_sizes, group))


def all_to_all(x: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of a flat tensor: ``input_sizes[r]`` elements to rank r,
    ``output_sizes[r]`` from it."""
    return _AllToAll.apply(x, output_sizes, input_sizes, group)


def sequence_to_heads(x: torch.Tensor, lengths: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, Hx, n_rank, D)`` sequence shard -> ``(B, Hx / P, N, D)``: the whole sequence for this rank's group of
    ``Hx / P`` heads (group r to rank r). ``Hx`` must be divisible by P."""
    p = len(lengths)
    bsz, heads, n_local, d = x.shape
    local_heads = heads // p
    send = x.unflatten(1, (p, local_heads)).movedim(1, 0).contiguous().flatten()
    received = all_to_all(send, [bsz * local_heads * n * d for n in lengths], [bsz * local_heads * n_local * d] * p,
                          group)
    pieces = received.split([bsz * local_heads * n * d for n in lengths])
    return torch.cat([piece.view(bsz, local_heads, n, d) for piece, n in zip(pieces, lengths)], dim=2)


def heads_to_sequence(x: torch.Tensor, lengths: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of ``sequence_to_heads``: ``(B, Hx / P, N, D)`` for this rank's heads -> ``(B, Hx, n_rank, D)``,
    this rank's sequence shard for every head."""
    p = len(lengths)
    bsz, local_heads, _, d = x.shape
    n_local = lengths[rank]
    # sequence-major on the wire, (N, B, Hx / P, D): each rank's tokens are one contiguous run, so one copy sends
    send = x.permute(2, 0, 1, 3).contiguous().flatten()
    received = all_to_all(send, [bsz * local_heads * n_local * d] * p, [bsz * local_heads * n * d for n in lengths],
                          group)
    return received.view(p, n_local, bsz, local_heads, d).permute(2, 0, 3, 1, 4).flatten(1, 2)
