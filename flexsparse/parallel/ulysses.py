"""Ulysses sequence parallelism: run any attention on the whole sequence for a group of heads per rank.

Communication per call and rank (P ranks, bf16 = 2 bytes): q, k, v in and o out, each ``(P - 1) / P`` of the
rank's shard, so ``2 (P - 1) / P · B N / P · (2 H + 2 Hk') D`` bytes over the all-to-alls (``Hk'``: K/V heads after
replication), plus 2 floats per rank for the shard lengths; the backward moves the same again. The LSE, when
returned, adds ``(P - 1) / P · B H N / P`` floats.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .collectives import heads_to_sequence, sequence_to_heads, shard_lengths
from .config import ParallelConfig

# attend(q, k, v, heads) -> (o, lse | None) on (B, H/P, N, D) q and (B, Hk'/P, N, D) k, v; ``heads`` is the slice of
# the H query heads the rank holds
LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, slice],
                          tuple[torch.Tensor, "torch.Tensor | None"]]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: LocalAttention,
                      parallel: ParallelConfig, *, return_lse: bool = False):
    """Sequence-parallel attention of shards q ``(B, H, n_r, D)`` and k, v ``(B, Hk, m_r, D)`` (this rank's
    tokens, every head) through ``attend`` on the whole sequence for ``H / P`` heads. Returns this rank's shard of
    the output ``(B, H, n_r, D)`` (and of the LSE ``(B, H, n_r)`` with ``return_lse``). H must be divisible by the
    degree P; K/V heads are replicated to the smallest count divisible by P (GQA, Hk < P). Autograd flows through
    both exchanges: q, k, v get this rank's shard of the gradients, parameters used in ``attend`` this rank's
    contribution (sum them over the group, as for every parameter a sequence-parallel model replicates)."""
    p, rank, group = parallel.ulysses_degree, parallel.ulysses_rank, parallel.ulysses_group
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % p:
        raise ValueError(f"sequence parallelism over {p} ranks (ulysses_degree) splits the heads among them: "
                         f"{heads} query heads are not divisible by {p}")
    kv_heads_needed = math.lcm(kv_heads, p)
    if kv_heads_needed != kv_heads:
        k, v = (x.repeat_interleave(kv_heads_needed // kv_heads, dim=1) for x in (k, v))
    lengths_q, lengths_k = shard_lengths(q, k, group)
    q_h, k_h, v_h = (sequence_to_heads(x, lengths, group) for x, lengths in ((q, lengths_q), (k, lengths_k),
                                                                           (v, lengths_k)))
    local = slice(rank * heads // p, (rank + 1) * heads // p)
    o_h, lse_h = attend(q_h, k_h, v_h, local)
    out = heads_to_sequence(o_h, lengths_q, rank, group)
    if not return_lse:
        return out
    return out, heads_to_sequence(lse_h.unsqueeze(-1), lengths_q, rank, group).squeeze(-1)
