"""FP8 (e4m3) block-sparse attention forward over an index table (docs/methods.md "FP8 QAT", "FP8 Triton
forward"): ``fwd``'s walk over each query block's selected key blocks, on the K and V of ``fp8_quant``'s pre-pass
(``quantize_kv``). Each program quantizes its query tile itself (``quantized_query``: the query block's amax, over
the block's other tiles too where a block takes several programs), the values and scale of ``quantize_blocks``
bit for bit: Q needs no pass and no launch of its own (the kernel takes about the time that pass took).

Per key tile: raw ``s = dot(q8, trans(k8))`` (fp32), the factor ``c = (scale log2(e) / s_q) (1 / s_k)`` (one Q
scale per program, the key block's reciprocal K scale: a scalar per step, so the running max is ``max(s) c``
exactly and ``s c - m`` one FMA; with two blocks side by side (``KB=2``) the running max from each block's raw max
times its factor, still one FMA per logit, and an odd list's last block in a step of its own; a factor per key
column with more blocks side by side), online softmax in fp32
with ``p = exp2(s c - m + log2 448)`` (448 times the softmax numerator: the e4m3 grid of ``P^``, no extra
multiply) and ``l`` summed from the unquantized ``p``, ``p8 = e4m3(p)`` in registers and
``acc = acc * alpha + dot(p8, trans(vt8 tile))``: the dot starts from a fresh accumulator each tile (with
``max_num_imprecise_acc`` nonzero, the default of fp8 dots on sm90, Triton does not fold the add into the
MMA), so the long sum stays out of the fp8 MMA's reduced-precision accumulator (tile setting
``fresh_acc=False`` accumulates inside the MMA instead). Epilogue ``o = acc / (l s_v)`` (``s_v`` per channel)
in q's dtype; LSE ``(m + log2 l - log2 448) ln 2 + scale (q8 . k_mean) / s_q`` (natural log of the unsmoothed
logits). The first operand of both dots is a loaded or register tile (the triton 3.6 Hopper miscompile of a
transposed shared-memory first operand). GQA reads KV head ``h // GROUP``. fp8 dots need a reduction of at
least 32: head dims are padded to ``pow2(D, 32)`` and key tiles of fewer than 32 keys take several blocks
side by side. V^T rows are a visible multiple of 16 bytes apart (``NP16``), so its loads are 16-byte
``cp.async`` copies, pipelined with K's. Query tiles of at least 64 rows use Hopper's fp8 ``wgmma``
(QGMMA); smaller ones (``block_q < 64``) take Triton's ``mma.sync`` path on fp16 (an exact upcast).

Where V^T's keys are stored permuted (``fp8_quant.permutes_keys``) P's columns are permuted alike
(``fp8_quant.permuted_columns``) before ``P V``.

In the interpreter the operands are ``fp8_quant``'s fp16 stand-in and P is rounded by ``e4m3_round``
(``EMULATE``); the products of e4m3 values are exact in fp16 dots, so only the accumulation differs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fwd import chunk_rows, geometry, list_rows, list_steps, tile_split
from .gluon import block_fwd_ws_fp8
from .._runtime.registry import launcher, launching_directly, register_cap
from ..common.jit import LN2, LOG2E, load_tile, store_row_values, store_tile
from .fp8_quant import E4M3, block_scale, permuted_columns, permutes_keys, quantize_blocks, quantize_kv, to_e4m3
from .._runtime.sizes import pow2
from .._runtime.tiles import overrides, with_overrides

LOG2_448 = tl.constexpr(8.807354922057604)


@triton.jit
def load_columns(base, keys, stride, dim, key_ok, D: tl.constexpr, BD: tl.constexpr, MASK_KEYS: tl.constexpr):
    """Columns ``keys`` of a transposed ``(D, tokens)`` slab at ``base``: ``(BD, len(keys))``, zeros where masked."""
    ptr = base + dim.to(tl.int64)[:, None] * stride + keys[None, :]
    if MASK_KEYS:
        return tl.load(ptr, mask=key_ok[None, :] & (dim[:, None] < D), other=0.0)
    else:
        if BD == D:
            return tl.load(ptr)
        else:
            return tl.load(ptr, mask=dim[:, None] < D, other=0.0)


@triton.jit
def quantized_query(Q, Q8, qblk, rows, row_ok, dim, NQ, BLOCK_Q: tl.constexpr, TILE_Q: tl.constexpr,
                    Q_SPLIT: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, MASK_Q: tl.constexpr,
                    EMULATE: tl.constexpr):
    """Rows ``rows`` of query block ``qblk`` of the ``(NQ, D)`` slab at ``Q`` in e4m3
    (``fp8_quant.to_e4m3``) and the block's scale: ``fp8_quant.quantize_blocks``' values and scale. The block's amax
    covers its ``Q_SPLIT`` tiles (the other programs' tiles loaded for it alone; its own loaded again: masked out,
    the uncapped SLA2 kernel took 1418 against 1232 µs, H200). The e4m3 tile goes through ``Q8`` (the same slab in
    e4m3: stored, then loaded after a barrier), so that the score dot takes it as loaded data, from shared memory:
    a tile computed in registers took triton 3.6's path of a register first operand for the fp8 ``wgmma``,
    reloaded at every key step, and its scores were wrong on the H200."""
    x = load_tile(Q, rows, D, dim, row_ok, D, BD, MASK_Q).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    if Q_SPLIT > 1:
        for other in tl.static_range(Q_SPLIT):
            rows_o, ok_o = chunk_rows(qblk, other, BLOCK_Q, TILE_Q, NQ)
            y = load_tile(Q, rows_o, D, dim, ok_o, D, BD, True).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    scale = block_scale(amax)
    store_tile(Q8, to_e4m3(x * scale, EMULATE), rows, D, dim, row_ok, D, BD, MASK_Q)
    tl.debug_barrier()
    return load_tile(Q8, rows, D, dim, row_ok, D, BD, MASK_Q), scale


@triton.jit
def key_step(q, K8, vt_head, k_descale, table, e, acc, m, l, q_factor, NK, TK, TOPK, dim, vt_stride,
             BLOCK_K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             TILE_K: tl.constexpr, K_SPLIT: tl.constexpr, K_GROUP: tl.constexpr, MASK_K: tl.constexpr,
             FRESH_ACC: tl.constexpr, EMULATE: tl.constexpr, PERMUTED: tl.constexpr):
    """Step e along the block list ``table[:TOPK]`` (``list_rows``): ``(acc, m, l)`` after its ``BN`` keys. ``K8``:
    this KV head's e4m3 keys; ``vt_head`` its V^T rows ``vt_stride`` apart."""
    keys, key_ok = list_rows(table, 0, TOPK, e, NK, BLOCK_K, TILE_K, K_SPLIT, K_GROUP)
    k = load_tile(K8, keys, D, dim, key_ok, D, BD, MASK_K)
    # stored in key_slot order, a column holds another key of its 16-group: read every stored column (zeros
    # past N; P is 0 at masked keys)
    vt = load_columns(vt_head, keys, vt_stride, dim, (keys < vt_stride) if PERMUTED else key_ok, D, BD, MASK_K)
    s = tl.dot(q, tl.trans(k))                                          # raw e4m3 products, fp32
    if MASK_K:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    if K_GROUP == 1:                        # one key block per step: a scalar factor c > 0, max(s c) = max(s) c
        c = q_factor * tl.load(k_descale + tl.load(table + e // K_SPLIT))
        m_new = tl.maximum(m, tl.max(s, axis=1) * c)
    elif K_GROUP == 2 and not MASK_K:       # two whole blocks: the max per block times its factor, one FMA a logit
        c0 = q_factor * tl.load(k_descale + tl.load(table + 2 * e))
        c1 = q_factor * tl.load(k_descale + tl.load(table + 2 * e + 1))
        halves = tl.max(tl.reshape(s, (BM, 2, BN // 2)), axis=2)                 # (BM, 2) raw maxima
        m_new = tl.maximum(m, tl.max(halves * tl.where(tl.arange(0, 2) == 0, c0, c1)[None, :], axis=1))
        c = tl.where(tl.arange(0, BN) < BN // 2, c0, c1)[None, :]
    else:                                   # several blocks side by side: a factor per key column
        blk = tl.minimum(keys // BLOCK_K, TK - 1)                       # masked keys: any block, s is -inf
        s = s * (q_factor * tl.load(k_descale + blk))[None, :]
        c = 1.0
        m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s * c - (m_use - LOG2_448)[:, None])                   # 448 exp2(s c - m): the fp8 grid of P
    l = l * alpha + tl.sum(p, axis=1)
    p8 = to_e4m3(p, EMULATE, False)
    if PERMUTED:                                                        # V^T's keys in fp8_quant.key_slot order
        p8 = permuted_columns(p8, BM, BN)
    if FRESH_ACC:
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt))
    else:
        acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
    return acc, m_new, l


@triton.jit
def attend_fp8(Q, Q8, QS, K8, VT8, KD, VS, KMEAN, IDX, H, GROUP, NQ, NK, NP16, TQ, TK, TOPK, BLOCK_Q: tl.constexpr,
               BLOCK_K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, SCALE: tl.constexpr, SCALE2: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, TILE_Q: tl.constexpr, TILE_K: tl.constexpr, Q_SPLIT: tl.constexpr,
               K_SPLIT: tl.constexpr, K_GROUP: tl.constexpr, PAIRS: tl.constexpr, MASK_Q: tl.constexpr,
               MASK_K: tl.constexpr, STAGES: tl.constexpr, FRESH_ACC: tl.constexpr, EMULATE: tl.constexpr,
               PERMUTED: tl.constexpr, Q_READY: tl.constexpr):
    """The query tile of this program (``program_id``: query tile, batch x head) over its selected key blocks:
    ``(o, lse, bh, qblk, rows, row_ok, dim)``, o ``(BM, BD)`` fp32 and the natural-log LSE ``(BM,)`` of its rows
    ``rows`` (real where ``row_ok``) of query block ``qblk`` of flat head ``bh``; ``dim = arange(BD)``. ``Q``: q
    ``(B, H, NQ, D)`` contiguous in its own dtype, ``Q8`` its e4m3 slab written here (``quantized_query``) or, with
    ``Q_READY``, given with its block scales ``QS (B * H, TQ)`` (``fp8_quant.pool_quantize``)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    hk = b * (H // GROUP) + (bh - b * H) // GROUP                    # flat (batch, KV head)
    q_head = bh.to(tl.int64) * NQ * D
    k_head = hk.to(tl.int64) * NK * D
    qblk = pid // Q_SPLIT
    rows, row_ok = chunk_rows(qblk, pid - qblk * Q_SPLIT, BLOCK_Q, TILE_Q, NQ)
    dim = tl.arange(0, BD)
    if Q_READY:
        q = load_tile(Q8 + q_head, rows, D, dim, row_ok, D, BD, MASK_Q)
        q_scale = tl.load(QS + bh.to(tl.int64) * TQ + qblk)
    else:
        q, q_scale = quantized_query(Q + q_head, Q8 + q_head, qblk, rows, row_ok, dim, NQ, BLOCK_Q, TILE_Q, Q_SPLIT,
                                     D, BD, MASK_Q, EMULATE)
    q_factor = SCALE2 / q_scale
    k_mean = tl.load(KMEAN + hk.to(tl.int64) * D + dim, mask=dim < D, other=0.0)
    shift = tl.sum(q.to(tl.float32) * k_mean[None, :], axis=1) * (SCALE / q_scale)   # the smoothing's LSE term
    k_descale = KD + hk.to(tl.int64) * TK
    vt_stride = NP16 * 16                                               # a visible multiple of 16: vector loads
    vt_head = VT8 + hk.to(tl.int64) * D * vt_stride
    table = IDX + (bh.to(tl.int64) * TQ + qblk) * TOPK
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    if PAIRS:                                   # two whole blocks per step, an odd list's last block alone
        for e in tl.range(0, TOPK // 2, num_stages=STAGES):
            acc, m, l = key_step(q, K8 + k_head, vt_head, k_descale, table, e, acc, m, l, q_factor, NK, TK, TOPK,
                                 dim, vt_stride, BLOCK_K, D, BD, BM, BN, TILE_K, 1, 2, MASK_K, FRESH_ACC, EMULATE,
                                 PERMUTED)
        if TOPK % 2 == 1:
            acc, m, l = key_step(q, K8 + k_head, vt_head, k_descale, table + TOPK - 1, 0, acc, m, l, q_factor, NK, TK,
                                 1, dim, vt_stride, BLOCK_K, D, BD, BM, BN // 2, TILE_K, 1, 1, MASK_K, FRESH_ACC,
                                 EMULATE, PERMUTED)
    else:
        for e in tl.range(0, list_steps(0, TOPK, K_SPLIT, K_GROUP), num_stages=STAGES):
            acc, m, l = key_step(q, K8 + k_head, vt_head, k_descale, table, e, acc, m, l, q_factor, NK, TK, TOPK,
                                 dim, vt_stride, BLOCK_K, D, BD, BM, BN, TILE_K, K_SPLIT, K_GROUP, MASK_K, FRESH_ACC,
                                 EMULATE, PERMUTED)
    v_scale = tl.load(VS + hk.to(tl.int64) * D + dim, mask=dim < D, other=1.0)
    o = acc * (1.0 / l)[:, None] * (1.0 / v_scale)[None, :]                 # l = 448 sum exp2(s c - m)
    return o, (m + tl.log2(l) - LOG2_448) * LN2 + shift, bh, qblk, rows, row_ok, dim


@triton.jit
def _block_fwd_fp8_kernel(Q, Q8, QS, K8, VT8, KD, VS, KMEAN, IDX, O, LSE, H, GROUP, NQ, NK, NP16, TQ, TK, TOPK,
                          BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                          SCALE: tl.constexpr, SCALE2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          TILE_Q: tl.constexpr, TILE_K: tl.constexpr, Q_SPLIT: tl.constexpr, K_SPLIT: tl.constexpr,
                          Q_GROUP: tl.constexpr, K_GROUP: tl.constexpr, PAIRS: tl.constexpr, MASK_Q: tl.constexpr,
                          MASK_K: tl.constexpr, STAGES: tl.constexpr, FRESH_ACC: tl.constexpr, EMULATE: tl.constexpr,
                          PERMUTED: tl.constexpr, Q_READY: tl.constexpr):
    o, lse, bh, qblk, rows, row_ok, dim = attend_fp8(
        Q, Q8, QS, K8, VT8, KD, VS, KMEAN, IDX, H, GROUP, NQ, NK, NP16, TQ, TK, TOPK, BLOCK_Q, BLOCK_K, D, BD, SCALE,
        SCALE2, BM, BN, TILE_Q, TILE_K, Q_SPLIT, K_SPLIT, K_GROUP, PAIRS, MASK_Q, MASK_K, STAGES, FRESH_ACC, EMULATE,
        PERMUTED, Q_READY)
    store_tile(O + bh.to(tl.int64) * NQ * D, o, rows, D, dim, row_ok, D, BD, MASK_Q)
    store_row_values(LSE + bh.to(tl.int64) * NQ, lse, rows, row_ok, MASK_Q)


def forward_tiles(device: torch.device, d: int) -> dict:
    """Tile caps ``BM``/``BN``, key blocks per step ``KB``, warps and pipeline stages of the FP8 forward (the keys
    of tile kind ``block_fwd``) and ``fresh_acc`` (``P V`` of each tile into a fresh fp32 accumulator, added to ``acc``;
    False: accumulated inside the fp8 MMA, faster, less precise) and ``maxnreg`` (registers per thread of a direct
    launch, ``launch_attention``; uncapped by default), with ``tiles.overrides("block_fwd_fp8")``.
    At D <= 64 query tiles of 64 rows (4 warps): 128-query blocks on two programs each took 1781 µs against 2024 on
    one 128-row tile of 8 warps (B2 H8 N65536, 5 % of 64-key blocks, H200)."""
    if device.type == "cpu":
        base = dict(BM=16, BN=16, KB=1, warps=4, stages=1, fresh_acc=True)
    elif d <= 64:
        base = dict(BM=64, BN=128, KB=1, warps=None, stages=3, fresh_acc=True)
    else:
        base = dict(BM=128, BN=64, KB=1, warps=None, stages=2, fresh_acc=True)
    return with_overrides("block_fwd_fp8", base, ("maxnreg",))


def gluon_runs(k8, indices, block_q: int, block_k: int, tiles: dict | None = None) -> bool:
    """Whether ``block_attend_fp8`` runs the Gluon kernel: default tiles (no ``tiles``, no ``FLEXSPARSE_TRITON_TILES``
    override of ``block_fwd_fp8``) and what ``fwd_ws_fp8.supported`` takes (``k8``: the pre-pass's K)."""
    return (block_fwd_ws_fp8 is not None and tiles is None and not overrides("block_fwd_fp8")
            and block_fwd_ws_fp8.supported(k8, indices, block_q, block_k))


def block_forward_fp8(q, k, v, indices, block_q: int, block_k: int, scale: float, tiles: dict | None = None,
                      k_mean: torch.Tensor | None = None, pooled: list[torch.Tensor] | None = None):
    """FP8 block-sparse attention: O ``(B, H, Nq, D)`` in q's dtype and natural-log LSE ``(B, H, Nq)`` fp32 of the
    quantized forward (``fp8_quant.quantize_kv``'s pre-pass, then ``block_attend_fp8``).

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``, any float dtype, contiguous; indices: ``(B, H, Tq, K)`` int32
    key-block ids (contiguous); k_mean: K's smoothing mean ``(B, Hk, 1, D)`` fp32 where the caller has it, zeros for
    unsmoothed K; pooled: ``fp8_quant.pool_quantize``'s operands of these q, k, v (``fp8_quant.quantize_kv``)."""
    return block_attend_fp8(q, quantize_kv(k, v, block_k, k_mean, pooled), indices, block_q, block_k, scale, tiles,
                            pooled[:2] if pooled else None)


def block_attend_fp8(q, kv, indices, block_q: int, block_k: int, scale: float, tiles: dict | None = None,
                     q_part: list[torch.Tensor] | None = None):
    """The kernel on q and ``fp8_quant.quantize_kv``'s outputs ``kv``: O ``(B, H, Nq, D)`` in q's dtype, LSE fp32.
    ``q_part``: Q's e4m3 blocks and scales where the caller has them (``fp8_quant.pool_quantize``). Where
    ``gluon_runs`` the warp-specialized Gluon kernel (``fwd_ws_fp8``) runs on them (``quantize_blocks(q)``'s
    without)."""
    if gluon_runs(kv[0], indices, block_q, block_k, tiles):
        run = block_fwd_ws_fp8.ws_block_attend_fp8 if launching_directly() else block_fwd_ws_fp8.block_attn_fp8_ws
        return run(*(q_part or quantize_blocks(q, block_q)), *kv, indices, block_q, block_k, scale, q.dtype)
    o = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    launch_attention(_block_fwd_fp8_kernel, q, kv, indices, o, lse, block_q, block_k, scale, tiles, q_part=q_part)
    return o, lse


def fp8_geometry(block_q: int, block_k: int, nq: int, nk: int, tiles: dict, topk: int, emulate: bool) -> dict:
    """``block_sparse.fwd.geometry`` of the FP8 forward's ``tiles``: key blocks side by side until one fp8 dot reduces
    over at least 32 keys (``emulate``: the interpreter's fp16 stand-in needs no such width), and ``PAIRS``: two
    whole blocks per step, an odd list's last block in a step of its own (``attend_fp8``), so that the keys need a
    mask only on a ragged N or a split block."""
    kb = tiles["KB"] if emulate else max(tiles["KB"], 32 // tile_split(block_k, tiles["BN"])[0])
    geo = geometry(block_q, block_k, nq, nk, tiles["BM"], tiles["BN"], topk, k_group=kb)
    geo["PAIRS"] = geo["K_GROUP"] == 2 and (emulate or geo["TILE_K"] >= 32)
    if geo["PAIRS"]:
        geo["MASK_K"] = nk % block_k != 0 or block_k != geo["TILE_K"]
    return geo


def launch_attention(kernel, q, kv, indices, o, lse, block_q: int, block_k: int, scale: float,
                     tiles: dict | None = None, extra: tuple = (), q_part: list[torch.Tensor] | None = None,
                     **constexprs) -> None:
    """Launch ``kernel`` over the FP8 forward's grid (one program per query tile and batch x head) with
    ``_block_fwd_fp8_kernel``'s arguments (q contiguous, ``kv`` from ``fp8_quant.quantize_kv``, the index table and
    the outputs ``o`` and ``lse``), then ``extra`` and ``constexprs``: the Triton FP8 forward's launch, shared by the
    kernels that run ``attend_fp8``. ``q_part``: ``[q8, q_scales]`` to load (``fp8_quant.pool_quantize``), else the
    kernel quantizes Q. ``tiles``: ``forward_tiles``'s by default; its ``maxnreg`` caps the registers per thread of a
    direct launch (``registry.register_cap``)."""
    k8, k_scales, k_mean, vt8, v_scales = kv
    bsz, heads, nq, d = q.shape
    nk, np_ = k8.shape[2], vt8.shape[3]
    tq, topk = indices.shape[2], indices.shape[3]
    emulate = k8.dtype != E4M3
    tiles = tiles or forward_tiles(q.device, d)
    geo = fp8_geometry(block_q, block_k, nq, nk, tiles, topk, emulate)
    warps = tiles["warps"] or (4 if geo["BM"] <= 64 else 8)
    if q_part is None:
        q8, q_scales = torch.empty(q.shape, device=q.device, dtype=k8.dtype), q    # q8 written by the kernel
    else:
        q8, q_scales = q_part
    launcher(kernel)[(tq * geo["Q_SPLIT"], bsz * heads)](
        q, q8, q_scales, k8, vt8, 1.0 / k_scales, v_scales, k_mean, indices, o, lse, heads, heads // k8.shape[1], nq,
        nk, np_ // 16, tq, k_scales.shape[2], topk, *extra, D=d, BD=pow2(d, 16 if emulate else 32), SCALE=float(scale),
        SCALE2=float(scale * LOG2E.value), STAGES=tiles["stages"], FRESH_ACC=tiles["fresh_acc"], EMULATE=emulate,
        PERMUTED=permutes_keys(block_k), Q_READY=q_part is not None, num_warps=warps, num_stages=tiles["stages"],
        **geo, **constexprs, **register_cap(tiles.get("maxnreg")))
