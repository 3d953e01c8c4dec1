"""Selections -> FlexAttention ``BlockMask``, built from index tables (never from an N x N mask).

Every selected block is declared *full* (the kernel skips ``mask_mod`` there); the partial lists
are empty. The tables follow FlexAttention's contract: ``full_kv_indices`` ``(B, H, Qb, KVb)``
holds the selected ids in its first ``K`` slots (the last dim must be the number of KV blocks),
and the key-major transpose ``full_q_indices`` ``(B, H, KVb, Qb)`` is built from the CSC form in
O(Qb*K log) instead of FlexAttention's dense argsort. The ``mask_mod`` answers "is this block
selected" from a bit-packed block table, so the uncompiled (eager) FlexAttention path, which
ignores the index lists, computes the same sparse attention instead of dense attention.

The tables are built inside one opaque custom op (``flexsparse::block_tables``): under
``torch.compile`` they are computed eagerly and enter the FlexAttention kernel as fixed buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from .csc import csr_to_csc
from .geometry import level_span, log_token_weights, num_blocks
from .selection import BlockSelection, LLSASelection

BITS = 32  # selected-block flags per int32 word of the mask_mod table


@torch.library.custom_op("flexsparse::block_tables", mutates_args=())
def block_tables(ids: torch.Tensor, num_kv_blocks: int, key_major: bool) -> list[torch.Tensor]:
    """Block tables of a selection ``ids (B, H, Qb, K)`` (int32, distinct per row) over
    ``num_kv_blocks`` KV blocks, every selected block full.

    Returns the full tables, int32 ``kv_num (B, H, Qb)``, ``kv_idx (B, H, Qb, KVb)`` and with
    ``key_major`` (needed by the backward only) ``q_num (B, H, KVb)``, ``q_idx (B, H, KVb, Qb)`` (query
    blocks of each KV block, ascending, zero padded); then ``bits (B, H, Qb, ceil(KVb/32))`` (bit
    ``j % 32`` of word ``j // 32`` set iff block j is selected) and the empty partial tables
    (``empty_partial_tables``).
    """
    bsz, heads, tq, k = ids.shape
    kv_num = torch.full((bsz, heads, tq), k, dtype=torch.int32, device=ids.device)
    kv_idx = ids.new_zeros(bsz, heads, tq, num_kv_blocks)
    kv_idx[..., :k] = ids
    full = [kv_num, kv_idx]
    if key_major:
        csc = csr_to_csc(ids, num_kv_blocks)
        q_num = csc.offsets.diff(dim=-1)
        slots = torch.arange(tq * k, device=ids.device).expand(bsz, heads, -1).contiguous()
        ends = csc.offsets[..., 1:].long().contiguous()
        cols = torch.searchsorted(ends, slots, right=True)                       # KV block of each CSC slot
        pos = slots - csc.offsets.long().gather(-1, cols)                        # rank within that KV block
        q_idx = torch.zeros(bsz, heads, num_kv_blocks * tq, dtype=torch.int32, device=ids.device)
        q_idx.scatter_(-1, cols * tq + pos, csc.rows)
        full += [q_num, q_idx.view(bsz, heads, num_kv_blocks, tq)]
    words = torch.zeros(bsz, heads, tq, num_blocks(num_kv_blocks, BITS), dtype=torch.int64, device=ids.device)
    flat = ids.long()
    words.scatter_add_(-1, flat // BITS, torch.ones_like(flat) << (flat % BITS))  # distinct bits: sum == or
    bits = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)    # same bit pattern in int32
    return [*full, bits, *empty_partial_tables(full, torch.zeros_like)]


def empty_partial_tables(full: list[torch.Tensor], like) -> list[torch.Tensor]:
    """The empty partial tables of ``full = [kv_num, kv_idx(, q_num, q_idx)]``, made by ``like`` (zeros).

    The FlexAttention kernels read a partial table with its full twin's strides. On CUDA only the
    zero counts are made and the full index tables serve as the partial ones too (never read with zero
    counts; same strides by construction; saves two ``(B, H, Qb, KVb)`` tables). On CPU all of them
    (its C++ kernel rejects one tensor in both roles). They are outputs of ``block_tables``, not made by
    the caller: inside a user's ``torch.compile`` graph inductor may pad the strides of tensors it
    creates itself (seen: an illegal memory access in the LLSA backward), but keeps an op's outputs.
    """
    if full[0].device.type == "cuda":
        return [like(x) for x in full[0::2]]
    return [like(x) for x in full]


@block_tables.register_fake
def _block_tables_fake(ids, num_kv_blocks, key_major):
    bsz, heads, tq, _ = ids.shape
    new = ids.new_empty
    full = [new(bsz, heads, tq), new(bsz, heads, tq, num_kv_blocks)]
    if key_major:
        full += [new(bsz, heads, num_kv_blocks), new(bsz, heads, num_kv_blocks, tq)]
    return [*full, new(bsz, heads, tq, num_blocks(num_kv_blocks, BITS)), *empty_partial_tables(full, torch.empty_like)]


def selection_mask_mod(bits: torch.Tensor, block_q: int, block_kv: int):
    """``mask_mod`` that is True where the KV block of ``kv_idx`` is selected for the query block
    of ``q_idx``, read from ``bits`` (see ``block_tables``). One factory, so one ``__code__``
    for every call (no recompiles when the selection changes)."""

    def selected_block(b, h, q_idx, kv_idx):
        j = kv_idx // block_kv
        word = bits[b, h, q_idx // block_q, j // BITS]
        return ((word >> (j % BITS)) & 1) == 1

    return selected_block


def block_mask_from_ids(ids: torch.Tensor, num_kv_blocks: int, block_q: int, block_kv: int,
                        seq_lengths: tuple[int, int], key_major: bool = True) -> BlockMask:
    """BlockMask with every block of ``ids (B, H, Qb, K)`` full and no partial blocks.

    seq_lengths: ``(Lq, Lkv)``, the true lengths (ragged tails are bounds-checked by the kernel).
    The partial lists are empty (zero counts, see ``empty_partial_tables``). ``key_major=False`` leaves out
    the key-major tables that only the backward reads (a mask for calls without gradients).
    """
    tables = block_tables(ids, num_kv_blocks, key_major)
    width = 4 if key_major else 2
    full, bits, partial = tables[:width], tables[width], tables[width + 1:]
    if len(partial) < width:  # CUDA: zero counts only, the full index tables stand in for the partial ones
        partial = [x for count, table in zip(partial, full[1::2]) for x in (count, table)]
    kv_num, kv_idx, q_num, q_idx = full + [None] * (4 - width)
    no_kv_num, no_kv_idx, no_q_num, no_q_idx = partial + [None] * (4 - width)
    return BlockMask(
        seq_lengths=seq_lengths,
        kv_num_blocks=no_kv_num,
        kv_indices=no_kv_idx,
        full_kv_num_blocks=kv_num,
        full_kv_indices=kv_idx,
        q_num_blocks=no_q_num,
        q_indices=no_q_idx,
        full_q_num_blocks=q_num,
        full_q_indices=q_idx,
        BLOCK_SIZE=(block_q, block_kv),
        mask_mod=selection_mask_mod(bits, block_q, block_kv),
    )


def block_selection_to_block_mask(selection: BlockSelection, key_major: bool = True) -> BlockMask:
    """BlockMask of a single-level selection: query block i attends its top-K key blocks.
    ``selection.excluded`` (blocks for no branch) is irrelevant here: only selected blocks enter.
    ``key_major=False``: no backward tables (``block_mask_from_ids``)."""
    return block_mask_from_ids(selection.indices, selection.num_k_blocks, selection.block_q, selection.block_k,
                               (selection.n_q, selection.n_k), key_major)


@dataclass(frozen=True)
class LLSALayout:
    """The extended KV of LLSA: ``[level 0 | level 1 | ... | level L]``.

    Level l is padded to ``segment_blocks[l] * block`` tokens, ``segment_blocks[l] = T_{l+1} =
    ceil(N / block^(l+1))``, so every segment is a whole number of KV blocks of ``block`` tokens. ``fine_n``: the
    real tokens of level 0 where it is not the sequence (a ring rank's fetched blocks, ``ring_llsa_layout``).
    """

    n: int
    block: int
    segment_blocks: tuple[int, ...]
    fine_n: int | None = None

    @property
    def levels(self) -> int:
        return len(self.segment_blocks) - 1

    @property
    def num_blocks(self) -> int:
        return sum(self.segment_blocks)

    @property
    def length(self) -> int:
        return self.num_blocks * self.block

    def start_block(self, level: int) -> int:
        """First KV block of ``level``'s segment."""
        return sum(self.segment_blocks[:level])

    def real_tokens(self, level: int) -> int:
        """The sequence tokens level ``level``'s tokens cover: ``fine_n`` (else N) at level 0, N above."""
        return self.fine_n if level == 0 and self.fine_n is not None else self.n

    def log_weights(self, device, dtype: torch.dtype) -> torch.Tensor:
        """``ln(count)`` of every extended-KV token, ``-inf`` on padding: ``(length,)``."""
        return torch.cat([log_token_weights(self.real_tokens(level), level_span(self.n, self.block, level),
                                            blocks * self.block, device, dtype)
                          for level, blocks in enumerate(self.segment_blocks)])


def llsa_layout(n: int, block: int, levels: int) -> LLSALayout:
    """Layout of the extended KV for length ``n``, block ``block`` and ``levels`` levels."""
    return LLSALayout(n, block, tuple(num_blocks(n, level_span(n, block, level + 1)) for level in range(levels + 1)))


def ring_llsa_layout(n: int, block: int, levels: int, fine_n: int) -> LLSALayout:
    """Layout of an extended KV whose level 0 holds ``fine_n`` tokens of whole blocks (a ring rank's fetched fine
    blocks, in sequence order; only the sequence's last block may be short, and last) and levels 1..L the whole
    sequence's pyramid."""
    whole = llsa_layout(n, block, levels)
    return LLSALayout(n, block, (num_blocks(fine_n, block), *whole.segment_blocks[1:]), fine_n)


def llsa_block_ids(selection: LLSASelection, layout: LLSALayout, rows: torch.Tensor | None = None,
                   fine_position: torch.Tensor | None = None) -> torch.Tensor:
    """KV blocks of the extended KV attended by each query block of ``block`` rows.

    Query block i (= level-1 token i) attends: level 0, the blocks ``S_1[i]``; level l (1 <= l < L),
    the blocks ``S_{l+1}[i // b^l]`` (a level-l block is the children of one level-(l+1) token);
    level L, every block. ``rows``: the query blocks to list (default all ``T_1``); ``fine_position``: the block of
    level 0's segment holding each sequence block (default itself). Returns ``(B, H, len(rows), K_1 + ... + K_L +
    T_{L+1})`` int32, ascending.
    """
    b, levels = selection.block, selection.levels
    fine = selection.indices[0]
    bsz, heads, t1, _ = fine.shape
    if rows is None:
        rows = torch.arange(t1, device=fine.device)
    else:
        fine = fine[:, :, rows]
    if fine_position is not None:
        fine = fine_position[fine.long()].to(torch.int32)
    parts = [fine]
    for level in range(1, levels):
        parts.append(selection.indices[level][:, :, rows // level_span(t1, b, level)] + layout.start_block(level))
    top = torch.arange(layout.segment_blocks[levels], dtype=torch.int32, device=fine.device)
    parts.append((top + layout.start_block(levels)).expand(bsz, heads, rows.numel(), -1))
    return torch.cat(parts, dim=-1)


def llsa_block_mask(selection: LLSASelection, key_major: bool = True) -> tuple[BlockMask, LLSALayout]:
    """BlockMask of LLSA over the extended KV (Q and KV blocks of ``selection.block`` tokens), and
    the layout from which the score_mod derives each token's ``ln(count)`` (``-inf`` keeps padding out).
    ``key_major=False``: no backward tables (``block_mask_from_ids``)."""
    layout = llsa_layout(selection.n, selection.block, selection.levels)
    ids = llsa_block_ids(selection, layout)
    mask = block_mask_from_ids(ids, layout.num_blocks, selection.block, selection.block,
                               (selection.n, layout.length), key_major)
    return mask, layout
