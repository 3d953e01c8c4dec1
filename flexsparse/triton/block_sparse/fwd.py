"""Block-sparse attention forward: each query block attends the key blocks of its row of the index table.

One program per query tile of ``TILE_Q`` rows (``Q_SPLIT`` tiles per query block when the block is larger
than the tile cap), for one (batch, query head); GQA reads KV head ``h // GROUP``. The key loop walks the
row's ``K`` selected blocks (``K_SPLIT`` chunks per block, or ``K_GROUP`` small blocks side by side per
step), software-pipelined (``tl.range`` with ``STAGES``), with an online softmax in log2 units
(``SCALE2 = scale * log2(e)``). Ragged tails (keys past ``Nk``, rows past ``Nq``, blocks that are not a
multiple of the tile, head dims that are not a power of two) are masked, never padded into the softmax;
the even case compiles without masks.

Outputs: O in q's dtype and the natural-log LSE fp32 ``(B, H, Nq)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from ..common.jit import LN2, LOG2E, load_tile, mm, softmax_step, store_row_values, store_tile
from .gluon import block_fwd_ws
from .._runtime.sizes import cdiv, pow2
from .._runtime.registry import launching_directly
from .._runtime.tiles import overrides, with_overrides

WS_HEAD_DIMS = (64, 128)  # head dims where the warp-specialized Gluon forward runs (sm_90): H200, 5 % of 64x64
# blocks, ms Gluon / Triton: B2 H8 N65536 D64 2.07 / 2.27, B2 H16 N32760 D128 1.83 / 2.23


@triton.jit
def chunk_rows(blk, chunk, BLOCK: tl.constexpr, TILE: tl.constexpr, n):
    """Token rows ``(TILE,)`` of chunk ``chunk`` of block ``blk`` (``BLOCK`` tokens per block) and which of
    them are real (inside the block and below ``n``)."""
    local = chunk * TILE + tl.arange(0, TILE)
    rows = blk * BLOCK + local
    return rows, (local < BLOCK) & (rows < n)


@triton.jit
def list_steps(start, end, SPLIT: tl.constexpr, GROUP: tl.constexpr):
    """Steps of ``list_rows`` over the block list ``[start, end)``."""
    if GROUP == 1:
        return (end - start) * SPLIT
    else:
        return tl.cdiv(end - start, GROUP)


@triton.jit
def list_rows(ids, start, end, e, n, BLOCK: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
              GROUP: tl.constexpr):
    """Token rows of step ``e`` along the block ids ``ids[start:end]`` and which of them are real: chunk
    ``e % SPLIT`` (``TILE`` rows) of one block, or with ``GROUP > 1`` (blocks of at most ``TILE`` tokens)
    the ``GROUP`` blocks ``e * GROUP ...`` side by side (``GROUP * TILE`` rows, masked past ``end``)."""
    if GROUP == 1:
        if SPLIT == 1:
            return chunk_rows(tl.load(ids + start + e), 0, BLOCK, TILE, n)
        else:
            slot = e // SPLIT
            return chunk_rows(tl.load(ids + start + slot), e - slot * SPLIT, BLOCK, TILE, n)
    else:
        c = tl.arange(0, GROUP * TILE)
        slot = start + e * GROUP + c // TILE
        local = c % TILE
        slot_ok = slot < end
        rows = tl.load(ids + slot, mask=slot_ok, other=0) * BLOCK + local
        return rows, slot_ok & (local < BLOCK) & (rows < n)


@triton.jit
def _block_fwd_kernel(Q, K, V, IDX, O, LSE, q_b, q_h, q_n, k_b, k_h, k_n, H, GROUP, NQ, NK, TQ, TOPK,
                      BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                      SCALE2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TILE_Q: tl.constexpr,
                      TILE_K: tl.constexpr, Q_SPLIT: tl.constexpr, K_SPLIT: tl.constexpr, Q_GROUP: tl.constexpr,
                      K_GROUP: tl.constexpr, MASK_Q: tl.constexpr, MASK_K: tl.constexpr, STAGES: tl.constexpr,
                      IEEE: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    q_head = b.to(tl.int64) * q_b + h.to(tl.int64) * q_h
    kv_head = b.to(tl.int64) * k_b + (h // GROUP).to(tl.int64) * k_h
    qblk = pid // Q_SPLIT
    rows, row_ok = chunk_rows(qblk, pid - qblk * Q_SPLIT, BLOCK_Q, TILE_Q, NQ)
    dim = tl.arange(0, BD)
    q = load_tile(Q + q_head, rows, q_n, dim, row_ok, D, BD, MASK_Q)
    table = IDX + (bh.to(tl.int64) * TQ + qblk) * TOPK
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for e in tl.range(0, list_steps(0, TOPK, K_SPLIT, K_GROUP), num_stages=STAGES):
        keys, key_ok = list_rows(table, 0, TOPK, e, NK, BLOCK_K, TILE_K, K_SPLIT, K_GROUP)
        k = load_tile(K + kv_head, keys, k_n, dim, key_ok, D, BD, MASK_K)
        v = load_tile(V + kv_head, keys, k_n, dim, key_ok, D, BD, MASK_K)
        s = mm(q, tl.trans(k), IEEE)
        if MASK_K:
            s = tl.where(key_ok[None, :], s, float("-inf"))
        m, l, acc = softmax_step(s, SCALE2, v, m, l, acc, IEEE)
    store_tile(O + q_head, acc / l[:, None], rows, q_n, dim, row_ok, D, BD, MASK_Q)
    store_row_values(LSE + bh.to(tl.int64) * NQ, (m + tl.log2(l)) * LN2, rows, row_ok, MASK_Q)


def tile_split(block: int, cap: int) -> tuple[int, int]:
    """Tile rows for blocks of ``block`` tokens (a power of two, 16 <= rows <= max(cap, 16)) and the
    number of tiles per block."""
    rows = max(16, min(pow2(block), pow2(cap)))
    return rows, cdiv(block, rows)


def geometry(block_q: int, block_k: int, nq: int, nk: int, bm: int, bn: int, topk: int, q_group: int = 1,
             k_group: int = 1) -> dict:
    """Kernel constants of a tile choice: tiles of at most ``bm`` queries / ``bn`` keys per block, and
    ``q_group`` / ``k_group`` whole blocks side by side per step of a block list (where blocks fit one
    tile; the dK/dV kernel walks query blocks, the others key blocks); their splits and masks."""
    for name, group in (("q_group", q_group), ("k_group", k_group)):
        if group < 1 or group & (group - 1):
            raise ValueError(f"tile setting {name} (blocks per step) must be a power of two, got {group}")
    tile_q, q_split = tile_split(block_q, bm)
    tile_k, k_split = tile_split(block_k, bn)
    q_group = q_group if q_split == 1 else 1
    k_group = k_group if k_split == 1 else 1
    return dict(BLOCK_Q=block_q, BLOCK_K=block_k, TILE_Q=tile_q, TILE_K=tile_k, BM=tile_q * q_group,
                BN=tile_k * k_group, Q_SPLIT=q_split, K_SPLIT=k_split, Q_GROUP=q_group, K_GROUP=k_group,
                MASK_Q=nq % block_q != 0 or block_q % tile_q != 0 or q_group > 1,
                MASK_K=nk % block_k != 0 or block_k % tile_k != 0 or topk % k_group != 0)


def forward_tiles(device: torch.device, d: int, dtype: torch.dtype) -> dict:
    """Tile caps ``BM``/``BN``, key blocks per step ``KB``, warps and pipeline stages of the forward, with
    ``tiles.overrides("block_fwd")``. fp32 (exact products, no tensor cores) gets narrow key tiles and
    8 warps so that nothing spills. Key tiles of 64 for bf16 / fp16: 128x128 blocks at D=64 ran 2.77 ms on
    128x128 tiles and 2.27 on 128x64 (H200, B2 H8 N65536, 5 %)."""
    if device.type == "cpu":
        base = dict(BM=16, BN=16, KB=1, warps=4, stages=1)
    elif dtype == torch.float32:
        base = dict(BM=64, BN=32, KB=1, warps=8, stages=2)
    else:
        base = dict(BM=128, BN=64, KB=1, warps=None, stages=3 if d <= 128 else 2)
    return with_overrides("block_fwd", base)


def gluon_runs(q, k, v, indices, block_q: int, block_k: int, tiles: dict | None = None) -> bool:
    """Whether ``block_forward`` runs the warp-specialized Gluon kernel for this call: sm_90, default tiles (no
    ``tiles``, no ``FLEXSPARSE_TRITON_TILES`` override of ``block_fwd``), head dims in ``WS_HEAD_DIMS`` and what
    ``fwd_ws.supported`` takes."""
    return (block_fwd_ws is not None and tiles is None and q.shape[3] in WS_HEAD_DIMS and not overrides("block_fwd")
            and block_fwd_ws.supported(q, k, v, indices, block_q, block_k))


def block_forward(q, k, v, indices, block_q: int, block_k: int, scale: float, tiles: dict | None = None):
    """O ``(B, H, Nq, D)`` in q's dtype and natural-log LSE ``(B, H, Nq)`` fp32.

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with the same strides, q's dtype; indices:
    ``(B, H, Tq, K)`` int32 key-block ids (contiguous). Last dims contiguous. Where ``gluon_runs`` the Gluon
    kernel runs instead.
    """
    bsz, heads, nq, d = q.shape
    if gluon_runs(q, k, v, indices, block_q, block_k, tiles):
        if launching_directly():
            return block_fwd_ws.ws_block_forward(q, k, v, indices, block_q, block_k, scale)
        return block_fwd_ws.block_attn_ws(q, k, v, indices, block_q, block_k, scale)
    nk = k.shape[2]
    tq, topk = indices.shape[2], indices.shape[3]
    tiles = tiles or forward_tiles(q.device, d, q.dtype)
    geo = geometry(block_q, block_k, nq, nk, tiles["BM"], tiles["BN"], topk, k_group=tiles["KB"])
    warps = tiles["warps"] or (4 if geo["BM"] <= 64 else 8)
    o = torch.empty_like(q)
    lse = q.new_empty(bsz, heads, nq, dtype=torch.float32)
    launcher(_block_fwd_kernel)[(tq * geo["Q_SPLIT"], bsz * heads)](
        q, k, v, indices, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        heads, heads // k.shape[1], nq, nk, tq, topk, D=d, BD=pow2(d, 16), SCALE2=float(scale * LOG2E.value),
        STAGES=tiles["stages"], IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=tiles["stages"], **geo)
    return o, lse
