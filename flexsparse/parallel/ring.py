"""Ring sequence parallelism: the ranks of the ``"ring"`` group hold contiguous chunks of one sequence for the same
heads (in rank order, any lengths) and attend their queries over every chunk's keys.

A method names its strategy (``Method.ring``):

* ``"rotate"`` (``full``): the K/V chunks rotate around the ring, ``P - 1`` exchanges with the neighbours; each step
  attends the local queries to the chunk at hand and the partial outputs merge by their LSE (fp32; fp64 for fp64).
* ``"fetch_blocks"`` (``topk``): the selection is global: the ranks all-gather the pooled keys (``N / block_k``
  rows), each selects the top-K blocks for its query blocks among all of them, then fetches from their owners only
  the key blocks it selected (an all-to-all of block ids, then one of the blocks) and attends them on a compact
  K/V as in one process: the same blocks in the same order, so the same numbers. It moves at most what a rotation
  moves (every K/V chunk to every rank) and attends each selected block once. Every chunk but the last must hold
  whole blocks (``block_q``, ``block_k``), so that a chunk's blocks are the sequence's.
* ``"fetch_levels"`` (``llsa``): the ranks all-gather the level-1 block sums of q, k and v (``N / b`` rows; the
  sequence's, chunks being whole blocks) and pool the sequence's pyramids from them as one process does
  (``pyramid_from_sums``); each runs the hierarchical selection on them, fetches the fine blocks its query blocks
  selected (as ``"fetch_blocks"``) and attends one softmax per query over those blocks and the whole pyramid, an
  extended KV whose level 0 is the fetched blocks (``flexsparse.masks.ring_llsa_layout``,
  ``Backend.llsa_extended_softmax``).

Autograd flows through every exchange (``collectives.all_to_all``): a fetched block's gradient returns to its owner
and sums over the ranks that fetched it. Per call and rank, the rotation moves ``(P - 1) / P`` of K and V (and
their gradients back), ``2 (P - 1) / P · B Hk N D`` elements each way; the fetch moves the selected blocks only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._checks import clamp_topk
from ..backends.base import merge_by_lse
from ..masks import BlockSelection, accumulation_dtype, llsa_block_ids, num_blocks, ring_llsa_layout
from .collectives import all_to_all, shard_lengths
from .config import ParallelConfig


def ring_methods(methods) -> list[str]:
    """The names of the methods of the registry ``methods`` that run over a ring."""
    return [name for name, method in methods.items() if method.ring is not None]


def ring_attention(q, k, v, method, cfg, backend, *, scale: float, params: dict, need_lse: bool,
                   parallel: ParallelConfig):
    """Attention of this rank's chunk q ``(B, H, n_r, D)`` over the keys and values of every chunk of the ring
    group (k, v ``(B, Hk, m_r, D)`` here) with ``method`` on ``backend``: ``(o (B, H, n_r, D), lse (B, H, n_r) or
    None)``, this rank's rows of the one-process call."""
    strategy = {"rotate": _rotate, "fetch_blocks": _fetch_blocks, "fetch_levels": _fetch_levels}[method.ring]
    return strategy(q, k, v, method, cfg, backend, scale=scale, params=params, need_lse=need_lse,
                    parallel=parallel)


def _rotate(q, k, v, method, cfg, backend, *, scale, params, need_lse, parallel):
    p, rank, group = parallel.ring_degree, parallel.ring_rank, parallel.ring_group
    _, lengths_k = shard_lengths(q, k, group)
    acc = accumulation_dtype(q.dtype)
    out = lse = None
    for step in range(p):
        if step:
            k, v = _pass_on(k, v, lengths_k[(rank - step) % p], rank, p, group)
        o_s, lse_s = backend.attend(method, q, k, v, None, cfg, scale=scale, params=params, need_lse=True)
        out, lse = (o_s.to(acc), lse_s.to(acc)) if out is None else merge_by_lse(out, lse, o_s, lse_s)
    return out.to(q.dtype), lse if need_lse else None


def _pass_on(k: torch.Tensor, v: torch.Tensor, incoming_length: int, rank: int, p: int, group):
    """Send k, v ``(B, Hx, n, D)`` to the next rank of the ring in one exchange and return the previous rank's
    ``(B, Hx, incoming_length, D)`` pair (differentiable: the gradients go back the other way)."""
    bsz, heads, _, d = k.shape
    sent, received = [0] * p, [0] * p
    sent[(rank + 1) % p] = 2 * k.numel()
    received[(rank - 1) % p] = 2 * bsz * heads * incoming_length * d
    both = all_to_all(torch.cat([k.flatten(), v.flatten()]), received, sent, group)
    return tuple(half.view(bsz, heads, incoming_length, d) for half in both.chunk(2))


def _fetch_blocks(q, k, v, method, cfg, backend, *, scale, params, need_lse, parallel):
    group = parallel.ring_group
    lengths_q, lengths_k = shard_lengths(q, k, group)
    _check_whole_blocks(lengths_q, cfg.block_q, "block_q", method.name)
    _check_whole_blocks(lengths_k, cfg.block_k, "block_k", method.name)
    blocks_k = [num_blocks(n, cfg.block_k) for n in lengths_k]
    topk = clamp_topk("topk", cfg.topk, sum(blocks_k), "key blocks of the whole sequence")
    with torch.no_grad():                  # the single-device selection's pooling: the same bits per block
        pooled_q, pooled_k, _ = backend.block_pooling(q, k, cfg.block_q, cfg.block_k)
        top, _ = backend.block_topk(pooled_q, _all_gather_rows(pooled_k, blocks_k, group), topk)
    k_c, v_c, position = _fetch_selected(k, v, top, blocks_k, lengths_k, cfg.block_k, group)
    selection = BlockSelection(position[top.long()].to(torch.int32), cfg.block_q, cfg.block_k, q.shape[2],
                               k_c.shape[2])
    return backend.attend(method, q, k_c, v_c, selection, cfg, scale=scale, params=params, need_lse=need_lse)


def _fetch_levels(q, k, v, method, cfg, backend, *, scale, params, need_lse, parallel):
    if cfg.quant is not None:
        raise ValueError(f"ring attention with method {method.name!r} runs without config key 'quant'")
    rank, group, b = parallel.ring_rank, parallel.ring_group, cfg.block_size
    _, lengths_k = shard_lengths(q, k, group)      # a self-attention method: q's chunks are k's
    _check_whole_blocks(lengths_k, b, "block_size", method.name)
    n, blocks = sum(lengths_k), [num_blocks(m, b) for m in lengths_k]
    levels, topk = method.plan(cfg, n)
    heads, kv_heads = q.shape[1], k.shape[1]
    # every rank's level-1 sums of q (the selection's only), k and v (differentiable: a level's gradient returns
    # to the ranks whose tokens it pools), then the sequence's pyramids as one process pools them
    local = torch.cat([backend.block_sums(x, b) for x in (q.detach(), k, v)], dim=1)
    sums = _all_gather_rows(local, blocks, group)
    q_levels, k_levels, v_levels = (backend.pyramid_from_sums(part, n, b, levels)
                                    for part in sums.split([heads, kv_heads, kv_heads], dim=1))
    with torch.no_grad():
        selection = backend.llsa_select_levels(q_levels, [x.detach() for x in k_levels], topk, b, n)
    first = sum(blocks[:rank])
    rows = torch.arange(first, first + blocks[rank], device=q.device)
    k_c, v_c, position = _fetch_selected(k, v, selection.indices[0][:, :, rows], blocks, lengths_k, b, group)
    layout = ring_llsa_layout(n, b, levels, k_c.shape[2])
    ids = llsa_block_ids(selection, layout, rows, position)
    out, lse = backend.llsa_extended_softmax(q, [k_c, *k_levels], [v_c, *v_levels], ids, layout, scale)
    return out, lse if need_lse else None


def _check_whole_blocks(lengths: list[int], block: int, key: str, method: str) -> None:
    ragged = [r for r, n in enumerate(lengths[:-1]) if n % block]
    if ragged:
        raise ValueError(f"ring attention with method {method!r} selects whole blocks of the sequence: every ring "
                         f"chunk but the last must be a multiple of {key}={block} tokens, got chunk lengths "
                         f"{lengths}")


def _fetch_selected(k, v, selected: torch.Tensor, blocks: list[int], lengths: list[int], block: int, group):
    """The blocks ``selected`` (global block ids, any shape) of the ring's K and V fetched from their owners:
    ``(k_c, v_c, position)``, k_c, v_c ``(B, Hx, m, D)`` the distinct blocks in sequence order (only the sequence's
    last block may be short, and last) and ``position`` ``(sum(blocks),)`` int64 a global block's place in them."""
    p, first = len(blocks), [sum(blocks[:r]) for r in range(len(blocks))]
    with torch.no_grad():
        wanted = torch.unique(selected).long()                       # ascending global block ids
        owner = torch.bucketize(wanted, torch.tensor(first[1:], device=wanted.device), right=True)
        asked = [wanted[owner == r] - first[r] for r in range(p)]    # block ids local to their owner
        to_send = _exchange_ids(asked, group)                        # the blocks each rank asks of this one
        position = torch.full((sum(blocks),), -1, dtype=torch.int64, device=wanted.device)
        position[wanted] = torch.arange(wanted.numel(), device=wanted.device)
    k_c, v_c = _fetch(k, v, to_send, [_tokens(ids, block, lengths[r]) for r, ids in enumerate(asked)], block, group)
    return k_c, v_c, position


def _all_gather_rows(x: torch.Tensor, rows: list[int], group) -> torch.Tensor:
    """Every rank's ``x (B, Hx, rows[r], D)`` concatenated along dim 2 in rank order, through one all-to-all that
    sends x to every rank: the backward returns each rank's gradient of x, summed over the ranks."""
    bsz, heads, _, d = x.shape
    sizes = [bsz * heads * r * d for r in rows]
    flat = x.movedim(2, 0).flatten()
    received = all_to_all(torch.cat([flat] * len(rows)), sizes, [flat.numel()] * len(rows), group)
    return torch.cat([part.view(r, bsz, heads, d) for part, r in zip(received.split(sizes), rows)]).movedim(0, 2)


def _exchange_ids(asked: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send ``asked[r]`` (int64 ids) to rank r; returns what every rank sent to this one, in rank order."""
    counts = torch.tensor([ids.numel() for ids in asked], dtype=torch.int64, device=asked[0].device)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    sizes = incoming.tolist()
    received = torch.empty(sum(sizes), dtype=torch.int64, device=counts.device)
    dist.all_to_all_single(received, torch.cat(asked), sizes, counts.tolist(), group=group)
    return list(received.split(sizes))


def _tokens(block_ids: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """The token ids of ``block_ids`` (ascending) in a chunk of ``length`` tokens (its last block may be short)."""
    tokens = (block_ids.unsqueeze(1) * block + torch.arange(block, device=block_ids.device)).flatten()
    return tokens[tokens < length]


def _fetch(k: torch.Tensor, v: torch.Tensor, to_send: list[torch.Tensor], incoming: list[torch.Tensor], block: int,
           group) -> tuple[torch.Tensor, torch.Tensor]:
    """Send every rank the tokens of the blocks of k, v ``(B, Hx, m, D)`` it asked for (``to_send[r]``, block ids)
    and receive this rank's (``incoming[r]``: the token ids asked of rank r), k and v in one exchange: each
    ``(B, Hx, sum_r len(incoming[r]), D)`` in rank order, i.e. ascending in the sequence. Differentiable."""
    bsz, heads, length, d = k.shape
    outgoing = [_tokens(ids, block, length) for ids in to_send]
    send = torch.cat([x.index_select(2, tokens).movedim(2, 0).flatten() for tokens in outgoing for x in (k, v)])
    received = all_to_all(send, [2 * t.numel() * bsz * heads * d for t in incoming],
                          [2 * t.numel() * bsz * heads * d for t in outgoing], group)
    pieces = [piece.view(2, t.numel(), bsz, heads, d) for piece, t in
              zip(received.split([2 * t.numel() * bsz * heads * d for t in incoming]), incoming)]
    k_c, v_c = torch.cat(pieces, dim=1).movedim(1, 3).unbind(0)
    return k_c.contiguous(), v_c.contiguous()
