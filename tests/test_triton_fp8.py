"""The FP8 (e4m3) Triton forward of the quantized block-sparse branch (``flexsparse::block_attn_fp8``:
``triton/block_sparse/fp8_quant.py`` pre-pass + ``triton/block_sparse/fwd_fp8.py`` kernel; docs/methods.md "FP8 QAT").

CPU (CI): the kernels run through the Triton interpreter on fp16 stand-ins of the e4m3 values (tiny shapes,
odd N, GQA, several block sizes and tile choices, fp32/fp16/bf16 inputs) in a child pytest started with
``TRITON_INTERPRET=1`` (``triton_support``): the in-kernel e4m3 rounding against torch's cast, the pre-pass
against ``flexsparse.quant.formats`` bit for bit, the kernel against a PyTorch emulation of its own math
(its running max in its key-tile order: tight) and against the ``torch`` backend's fake quantization (the
elementwise bound of docs/methods.md "What agreement to FP8 rounding means for a kernel"), the QAT gradients
(the softmax backward at the kernel's O and LSE). The parent process checks the torch fallback,
opcheck, fullgraph tracing, refusals and ``backend="auto"``.
GPU (``pytest -m gpu``): real e4m3 (``float8_e4m3fn``, fp8 ``tl.dot``) at N ~ 4K: the same comparisons, the
rounding emulation against the hardware cast, the error against the bf16 kernel, compiled fullgraph training.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import triton_support as ts

pytest.importorskip("triton")
pytest.importorskip("torchao")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import flexsparse  # noqa: E402
from flexsparse import backends  # noqa: E402
from flexsparse.backends import BACKENDS  # noqa: E402
from flexsparse.backends.triton_backend import fp8_block_sparse_attention  # noqa: E402
from flexsparse.bench import structured_qkv  # noqa: E402
from flexsparse.config import Config, QuantConfig  # noqa: E402
from flexsparse.masks import BlockSelection, num_blocks  # noqa: E402
from flexsparse.methods import METHODS  # noqa: E402
from flexsparse.quant import E4M3, block_scales, channel_scales, quantize  # noqa: E402
from flexsparse.triton._runtime.registry import launcher  # noqa: E402
from flexsparse.triton.block_sparse import op as block_op  # noqa: E402
from flexsparse.triton.block_sparse import fp8_quant  # noqa: E402
from flexsparse.triton.block_sparse.fp8_quant import (quantize_blocks, quantize_keys, quantize_qkv,  # noqa: E402
                                                      quantize_v_transposed, stored_keys, to_e4m3)
from flexsparse.triton.block_sparse.fwd import geometry  # noqa: E402
from flexsparse.triton.block_sparse.fwd_fp8 import block_attend_fp8, forward_tiles, gluon_runs  # noqa: E402

cpu_only, cpu_parent, gpu = ts.cpu_only, ts.cpu_parent, ts.gpu
random_selection = ts.random_selection
TRITON, TORCH = BACKENDS["triton"], BACKENDS["torch"]


test_interpreter_suite, test_interpreter_suite_exhaustive = ts.interpreter_suites(__file__)
DEFAULT_TIER_CASES = 1   # interpreter tests: the first case of each in the default tier (conftest)


def make_qkv(bsz, heads, kv_heads, n, d, dtype=torch.float32, device="cpu"):
    """Fresh random q, k (with a per-head offset, as real keys: the smoothing removes it), v."""
    return ts.make_qkv(bsz, heads, kv_heads, n, n, d, dtype, device, key_offset=1.0)


# ------------------------------------------------------------------------------------ references

def e4m3(x: torch.Tensor) -> torch.Tensor:
    """torch's saturating e4m3 rounding (round to nearest even), as fp32."""
    return x.float().clamp(-448, 448).to(E4M3).float()


ONE_BLOCK_PER_STEP = dict(BM=64, BN=64, KB=1, warps=4, stages=2, fresh_acc=True)
PAIRS = dict(BM=64, BN=64, KB=2, warps=4, stages=3, fresh_acc=True)   # two key blocks per softmax step
GLUON_ONE_BLOCK = {"pairs": False, "fresh_acc": True, "stages": 3}       # the Gluon kernel in ONE_BLOCK_PER_STEP


def kernel_tiles(pre, indices: torch.Tensor, block_q: int, block_k: int) -> dict:
    """The key-tile order of the kernel ``block_attend_fp8`` runs on these inputs, for ``emulate_kernel``: the Gluon
    kernel's (two key blocks per step with its default ``pairs``, else one), or the Triton kernel's default tiles."""
    if gluon_runs(pre[2], indices, block_q, block_k):
        from flexsparse.triton.block_sparse.fwd_ws_fp8 import default_tiles
        return PAIRS if default_tiles(pre[0].shape[-1])["pairs"] else ONE_BLOCK_PER_STEP
    return forward_tiles(pre[0].device, pre[0].shape[-1])


def flips_tolerance(d: int) -> float:
    """Rel L2 allowed between a GPU kernel's O and another computation of the same math in the same key order: logits
    a last bit apart (the fp8 MMA's accumulation) round some e4m3 P one step apart, more of them at D=128 (5.03e-3
    seen with 8 pairs of 64 keys on the H200; 5.3e-3 at 36 blocks, ``test_gpu_fuzz``); a wrong key block is an O(1)
    error."""
    return 1e-2 if d > 64 else 5e-3


def key_ordered(vt8: torch.Tensor, block_k: int) -> torch.Tensor:
    """V^T as the pre-pass stores it for key blocks of ``block_k`` (``fp8_quant.permutes_keys``), keys in order."""
    if not fp8_quant.permutes_keys(block_k):
        return vt8
    return vt8[..., torch.argsort(stored_keys(vt8.shape[-1])).to(vt8.device)]


def emulate_kernel(pre, indices: torch.Tensor, block_q: int, block_k: int, scale: float, tiles: dict):
    """The kernel's math in PyTorch fp32 on the pre-pass outputs, with its key tiles in its order (``list_rows``
    of ``block_sparse.fwd``): per step raw ``s = q8 k8^T``, the factor ``c = scale log2(e) / s_q * (1 / s_k)``, running
    max of ``s c``, ``p = exp2(s c - m + log2 448)`` (448 times the softmax numerator), ``l`` summed from the
    unquantized ``p``, ``acc = acc alpha + e4m3(p) v8``; ``o = acc / (l s_v)``, LSE with the smoothing term.
    Vectorized over (batch, head, query block). Returns o ``(B, H, Nq, D)`` fp32 and the LSE."""
    q8, qs, k8, ks, k_mean, vt8, vs = [x.float() for x in pre]
    vt8 = key_ordered(vt8, block_k)
    bsz, heads, nq, d = q8.shape
    group, nk, (tq, topk) = heads // k8.shape[1], k8.shape[2], indices.shape[2:]
    device = q8.device
    kb = tiles["KB"] if pre[0].dtype != E4M3 else max(tiles["KB"], 32 // geometry(block_q, block_k, nq, nk, tiles["BM"],
                                                                                tiles["BN"], topk)["TILE_K"])
    geo = geometry(block_q, block_k, nq, nk, tiles["BM"], tiles["BN"], topk, k_group=kb)
    tile, split, kgroup = geo["TILE_K"], geo["K_SPLIT"], geo["K_GROUP"]
    heads_kv = torch.arange(heads, device=device) // group
    k_rows, v_rows = k8[:, heads_kv], vt8[:, heads_kv].transpose(-1, -2)[:, :, :nk]       # (B, H, Nk, D)
    descale = (1.0 / ks)[:, heads_kv]                                                    # (B, H, Tk)
    q_factor = (scale * math.log2(math.e)) / qs                                          # (B, H, Tq)
    log2_448 = math.log2(448)
    rows = torch.arange(tq * block_q, device=device)
    q = torch.where((rows < nq)[:, None], q8[:, :, rows.clamp(max=nq - 1)], 0.0).view(bsz, heads, tq, block_q, d)
    m = torch.full((bsz, heads, tq, block_q), -math.inf, device=device)
    l, acc = torch.zeros_like(m), torch.zeros(bsz, heads, tq, block_q, d, device=device)
    idx = indices.long()
    steps = topk * split if kgroup == 1 else -(-topk // kgroup)
    for e in range(steps):
        if kgroup == 1:
            local = (e % split) * tile + torch.arange(tile, device=device)
            keys = idx[..., e // split, None] * block_k + local                              # (B, H, Tq, tile)
            ok = (local < block_k) & (keys < nk)
        else:
            c = torch.arange(kgroup * tile, device=device)
            slot, local = e * kgroup + c // tile, c % tile
            keys = idx[..., slot.clamp(max=topk - 1)] * block_k + local
            ok = (slot < topk) & (local < block_k) & (keys < nk)
        keys = keys.clamp(max=nk - 1)
        flat = keys.flatten(2)                                                               # (B, H, Tq * BN)
        kk = torch.gather(k_rows, 2, flat[..., None].expand(-1, -1, -1, d)).view(*keys.shape, d)
        vv = torch.gather(v_rows, 2, flat[..., None].expand(-1, -1, -1, d)).view(*keys.shape, d)
        s = torch.einsum("bhiqd,bhikd->bhiqk", q, kk).masked_fill(~ok[..., None, :], -math.inf)
        if kgroup == 1:
            factor = (q_factor * descale.gather(2, idx[..., e // split]))[..., None, None]
            m_new = torch.maximum(m, s.amax(-1) * factor[..., 0])
        else:
            factor = (q_factor[..., None] * descale.gather(2, flat // block_k).view(keys.shape))[..., None, :]
            m_new = torch.maximum(m, (s * factor).amax(-1))
        m_use = torch.where(m_new == -math.inf, 0.0, m_new)
        alpha = torch.exp2(m - m_use)
        p = torch.exp2(s * factor - (m_use - log2_448)[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bhiqk,bhikd->bhiqd", e4m3(p), vv)
        m = m_new
    o = acc / (l[..., None] * vs[:, heads_kv, None, None, :])
    lse = (m + torch.log2(l) - log2_448) * math.log(2) + torch.einsum("bhiqd,bhd->bhiq", q, k_mean[:, heads_kv]) * (
        scale / qs[..., None])
    return o.flatten(2, 3)[:, :, :nq], lse.flatten(2)[:, :, :nq]


def fake_quant_branch(q, k, v, selection: BlockSelection, scale: float):
    """The ``torch`` backend's fake-quantized branch (the spec in fp32), o and LSE."""
    with torch.no_grad():
        return TORCH.block_sparse_attention(q, k, v, selection, scale, quant=QuantConfig())


def spec_bound(pre, selection: BlockSelection, scale: float) -> torch.Tensor:
    """Elementwise ``2^-3 (P |V^|) + (2^-9 / 448) sum_j |V^_j| / l`` (docs/methods.md), dense in fp64 from the
    dequantized pre-pass values, plus 3% of the first term and 1e-6 for fp32 rounding."""
    q8, qs, k8, ks, _, vt8, vs = [x.double() for x in pre]
    vt8 = key_ordered(vt8, selection.block_k)
    bsz, heads, n, d = q8.shape
    heads_kv = torch.arange(heads, device=q8.device) // (heads // k8.shape[1])
    token_q = torch.arange(n, device=q8.device) // selection.block_q
    token_k = torch.arange(k8.shape[2], device=q8.device) // selection.block_k
    q_hat = q8 / qs[..., token_q, None]
    k_hat = (k8 / ks[..., token_k, None])[:, heads_kv]
    v_hat = (vt8[..., : k8.shape[2]].transpose(-1, -2) / vs[:, :, None, :])[:, heads_kv]
    picked = torch.zeros(bsz, heads, selection.num_q_blocks, num_blocks(k8.shape[2], selection.block_k),
                         dtype=torch.bool, device=q8.device)
    picked.scatter_(-1, selection.indices.long(), True)
    mask = picked[:, :, token_q][..., token_k]
    s = (scale * q_hat @ k_hat.transpose(-1, -2)).masked_fill(~mask, -math.inf)
    w = torch.exp(s - s.amax(-1, keepdim=True))
    l = w.sum(-1, keepdim=True)
    pv = (w / l) @ v_hat.abs()
    return 0.125 * 1.03 * pv + 2.0**-9 / 448 * (mask.double() @ v_hat.abs()) / l + 1e-6


# ----------------------------------------------------------------------------------------------- CPU

@triton.jit
def _round_kernel(X, OUT, N, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    tl.store(OUT + offs, to_e4m3(x, EMULATE).to(tl.float32), mask=offs < N)


def kernel_round(x: torch.Tensor, emulate: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    launcher(_round_kernel)[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), EMULATE=emulate, BLOCK=1024)
    return out


def rounding_cases(device="cpu") -> torch.Tensor:
    """Exact grid values, round-to-even ties in normals and subnormals, the 448 edge, saturation, a wide spread."""
    special = torch.tensor([0.0, -0.0, 2.0**-9, 3 * 2.0**-9, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-6,
                            2.0**-6 - 2.0**-10, 1.0625, 1.1875, 1.0625 + 2.0**-20, 127.97, 240.0, 248.0, 447.0,
                            448.0, 460.0, 464.0, 1e4, 2.0**-30, 1e-12])
    spread = torch.randn(20000) * torch.exp2(torch.randint(-14, 10, (20000,)).float())
    return torch.cat([special, -special, spread]).to(device)


@cpu_only
def test_in_kernel_e4m3_rounding_is_torchs_cast():
    x = rounding_cases()
    assert torch.equal(kernel_round(x, True), e4m3(x))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prepass_equals_the_quant_formats_bit_for_bit(dtype):
    """Scales and e4m3 values of Q per block, smoothed K per block (mean in fp32) and V per channel
    (transposed, zero padded to a multiple of 16 tokens) equal ``flexsparse.quant.formats``."""
    x = (torch.randn(2, 3, 37, 24) * torch.exp2(torch.randint(-12, 6, (2, 3, 37, 1)).float())).to(dtype)
    x[0, 0, :8] = 0                                                           # an all-zero block: amax clamp
    mean = x.mean(dim=2, dtype=torch.float32)
    for block in (8, 16, 24):
        for shift in (None, mean):
            values, scales = quantize_blocks(x, block, shift)
            xs = x.float() if shift is None else x.float() - shift[:, :, None]
            want_scales = block_scales(xs, block)[..., 0]
            assert scales.dtype == torch.float32 and torch.equal(scales, want_scales)
            per_token = want_scales.repeat_interleave(block, dim=2)[:, :, :37, None]
            assert values.dtype == torch.float16 and torch.equal(values.float(), quantize(xs, per_token))
    v = (torch.randn(2, 3, 37, 24) * torch.exp2(torch.randint(-12, 6, (2, 3, 1, 24)).float())).to(dtype)
    k8, k_scales, v_amax = quantize_keys(x, v, 8, mean)             # K's pass also takes V's amax
    assert all(map(torch.equal, (k8, k_scales), quantize_blocks(x, 8, mean)))
    assert torch.equal(v_amax, v.float().abs().amax(dim=2))
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, v)]
    assert all(map(torch.equal, quantize_keys(*strided, 8, mean), (k8, k_scales, v_amax)))
    vt, v_scales = quantize_v_transposed(v, v_amax)
    assert vt.shape == (2, 3, 24, 48) and torch.equal(v_scales, channel_scales(v)[:, :, 0])
    assert torch.equal(vt[..., :37].float(), quantize(v, channel_scales(v)).transpose(-1, -2))
    assert (vt[..., 37:] == 0).all()
    given = quantize_qkv(x, x, v, 16, 8, mean[:, :, None])          # the selection's mean, (B, Hk, 1, D)
    assert torch.equal(given[0], quantize_blocks(x, 16)[0]) and torch.equal(given[4], mean)
    assert all(map(torch.equal, given[2:4] + given[5:], (k8, k_scales, vt, v_scales)))
    own_mean = quantize_qkv(x, x, v, 16, 8)[4]                      # none given: the pre-pass takes it
    assert ((own_mean - mean).abs() <= 1e-5 * x.float().abs().mean(dim=2)).all()          # fp32 rounding only


# (B, N, block_q, block_k, H, Hk, D, K). Interpreter tiles are 16 x 16: larger blocks split into several tiles.
CASES = [
    (2, 64, 16, 16, 1, 1, 16, 2),      # even: no masks; batch offsets
    (1, 37, 16, 16, 2, 1, 16, 2),      # odd N, GQA
    (1, 70, 32, 16, 2, 2, 24, 3),      # block_q != block_k, split query tiles, D not a power of two
    (1, 77, 16, 32, 4, 2, 16, 2),      # split key tiles, GQA 2
    (1, 50, 24, 8, 1, 1, 16, 4),       # blocks that are no multiple of the tile, block_k < tile
    (1, 40, 16, 16, 2, 1, 32, 3),      # K = every key block
    (1, 128, 64, 64, 1, 1, 16, 1),     # 4 x 4 tiles per block pair
]


@cpu_only
@pytest.mark.parametrize("bsz,n,block_q,block_k,heads,kv_heads,d,topk", CASES)
def test_kernel_matches_its_emulation_and_the_fake_quant_spec(bsz, n, block_q, block_k, heads, kv_heads, d, topk):
    """Tight against the emulation of its own math (same quantized inputs, same key-tile order); against the
    torch backend's fake quantization within the FP8-rounding bound, LSE tight (l is not quantized)."""
    q, k, v = make_qkv(bsz, heads, kv_heads, n, d)
    selection = random_selection(bsz, heads, n, n, block_q, block_k, topk)
    scale = d**-0.5
    pre = quantize_qkv(q, k, v, block_q, block_k)
    o, lse = block_attend_fp8(q, pre[2:], selection.indices, block_q, block_k, scale)
    want_o, want_lse = emulate_kernel(pre, selection.indices, block_q, block_k, scale, forward_tiles(q.device, d))
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:3]
    assert ts.rel_err(o, want_o) < 5e-3 and ts.rel_err(lse, want_lse) < 1e-5
    spec_o, spec_lse = fake_quant_branch(q, k, v, selection, scale)
    assert ((o - spec_o).abs() <= spec_bound(pre, selection, scale)).all()
    assert ts.rel_err(o, spec_o) < 0.05 and ts.rel_err(lse, spec_lse) < 1e-5
    got_o, got_lse = fp8_block_sparse_attention(q, k, v, selection, scale)      # the op, end to end
    assert torch.equal(got_o, o) and torch.equal(got_lse, lse)


PERMUTED_CASES = [CASES[i] for i in (1, 3, 4, 6)]   # 16-, 32- (split tiles), 8- (kept in order) and 64-key blocks


@cpu_only
@pytest.mark.parametrize("bsz,n,block_q,block_k,heads,kv_heads,d,topk", PERMUTED_CASES)
def test_kernel_with_permuted_keys(bsz, n, block_q, block_k, heads, kv_heads, d, topk, monkeypatch):
    """V^T's keys stored permuted within 16-key groups (``fp8_quant.PERMUTED_KEYS``, the default) and P's columns
    permuted alike in the kernel: the same O as keys in order up to the dot's summation order, the same LSE, and O
    tight against the emulation; blocks of 8 keys are stored in order."""
    q, k, v = make_qkv(bsz, heads, kv_heads, n, d)
    selection = random_selection(bsz, heads, n, n, block_q, block_k, topk)
    scale = d**-0.5
    pre = quantize_qkv(q, k, v, block_q, block_k)
    o, lse = block_attend_fp8(q, pre[2:], selection.indices, block_q, block_k, scale)
    assert fp8_quant.permutes_keys(block_k) == (block_k % 16 == 0)
    want_o, want_lse = emulate_kernel(pre, selection.indices, block_q, block_k, scale, forward_tiles(q.device, d))
    assert ts.rel_err(o, want_o) < 5e-3 and ts.rel_err(lse, want_lse) < 1e-5
    monkeypatch.setattr(fp8_quant, "PERMUTED_KEYS", False)
    in_order = block_attend_fp8(q, quantize_qkv(q, k, v, block_q, block_k)[2:], selection.indices, block_q, block_k,
                                scale)
    assert ts.rel_err(o, in_order[0]) < 1e-5 and torch.equal(lse, in_order[1])


@cpu_only
def test_prepass_stores_permuted_keys_in_key_slot_order():
    """``quantize_v_transposed(..., permute=True)``: column ``k`` holds key ``stored_keys(NP)[k]`` of the keys in
    order, a permutation within each 16-key group (N = 37: the last group partial, zeros past N)."""
    x = torch.randn(2, 3, 37, 24)
    amax = x.abs().amax(dim=2)
    in_order, scales = quantize_v_transposed(x, amax)
    permuted, permuted_scales = quantize_v_transposed(x, amax, permute=True)
    order = stored_keys(48)
    assert torch.equal(permuted, in_order[..., order]) and torch.equal(permuted_scales, scales)
    assert torch.equal(order.view(3, 16).sort(-1).values, torch.arange(48).view(3, 16))
    assert not torch.equal(order, torch.arange(48))


TILE_OVERRIDES = {   # tiles, block_q, block_k, topk, N
    "unsplit 32-row tiles": ('{"block_fwd_fp8": {"BM": 32, "BN": 32, "stages": 2}}', 32, 32, 2, 90),
    "blocks side by side": ('{"block_fwd_fp8": {"KB": 2}}', 16, 8, 3, 90),
    "pairs, ragged last block": ('{"block_fwd_fp8": {"KB": 2}}', 32, 16, 3, 90),
    "pairs, odd list": ('{"block_fwd_fp8": {"KB": 2}}', 32, 16, 5, 96),     # unmasked pairs, the last block alone
    "four blocks per step": ('{"block_fwd_fp8": {"KB": 4, "BN": 16}}', 16, 16, 5, 90),
    "accumulate in the MMA": ('{"block_fwd_fp8": {"fresh_acc": false}}', 32, 16, 3, 90),
}


@cpu_only
@pytest.mark.parametrize("name", list(TILE_OVERRIDES))
def test_tile_overrides(name, monkeypatch):
    """Other key-tile orders through ``FLEXSPARSE_TRITON_TILES``: the emulation follows the same order."""
    tiles, block_q, block_k, topk, n = TILE_OVERRIDES[name]
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", tiles)
    q, k, v = make_qkv(1, 2, 1, n, 16)
    selection = random_selection(1, 2, n, n, block_q, block_k, topk)
    pre = quantize_qkv(q, k, v, block_q, block_k)
    o, lse = block_attend_fp8(q, pre[2:], selection.indices, block_q, block_k, 0.3)
    want_o, want_lse = emulate_kernel(pre, selection.indices, block_q, block_k, 0.3, forward_tiles(q.device, 16))
    assert ts.rel_err(o, want_o) < 5e-3 and ts.rel_err(lse, want_lse) < 1e-5


@cpu_only
def test_kernel_scales_a_query_block_by_its_amax_over_its_programs():
    """A query block of several programs (32 rows, 16-row tiles in the interpreter) takes one scale, its amax, as
    ``quantize_blocks``: with an outlier row in each block's first tile, the second tile's rows are quantized on the
    block's coarse grid, not on a finer one of their own."""
    q, k, v = make_qkv(1, 2, 1, 60, 16)
    q[:, :, ::32] *= 50.0
    selection = random_selection(1, 2, 60, 60, 32, 16, 2)
    pre = quantize_qkv(q, k, v, 32, 16)
    assert not torch.equal(quantize_blocks(q, 16)[1][:, :, 1::2], pre[1])       # the tiles' own scales differ
    o, lse = block_attend_fp8(q, pre[2:], selection.indices, 32, 16, 0.3)
    want_o, want_lse = emulate_kernel(pre, selection.indices, 32, 16, 0.3, forward_tiles(q.device, 16))
    assert ts.rel_err(o, want_o) < 1e-5 and ts.rel_err(lse, want_lse) < 1e-6


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    """fp16/bf16 q, k, v: the pre-pass reads them, the output is in their dtype."""
    q, k, v = make_qkv(1, 2, 1, 45, 16, dtype)
    selection = random_selection(1, 2, 45, 45, 16, 16, 2)
    o, lse = fp8_block_sparse_attention(q, k, v, selection, 0.25)
    assert o.dtype == dtype and lse.dtype == torch.float32
    pre = quantize_qkv(q, k, v, 16, 16)
    want_o, want_lse = emulate_kernel(pre, selection.indices, 16, 16, 0.25, forward_tiles(q.device, 16))
    assert ts.rel_err(o, want_o) < 5e-3 and ts.rel_err(lse, want_lse) < 1e-5


# the CPU cases: each FP8 method's registry example on 16-token query and 8-token key blocks with K = 3 or 40% of
# the key blocks, changed as listed here
VARIANTS = {"sla": {"block_size": 16, "negligible_ratio": 0.2}, "sla2": {"block_q": 32, "block_k": 16}}
METHOD_CONFIGS = [ts.example_config(name, **ts.merged({"block_q": 16, "block_k": 8, "topk": 3, "topk_ratio": 0.4},
                                                      VARIANTS.get(name, {})))
                  for name in ts.fp8_methods()]


def _params(cfg: dict, d: int, heads: int, n: int, device="cpu") -> dict:
    params = METHODS[cfg["method"]].init_params(Config.from_dict(cfg), d, heads, n)
    return {name: (p + 0.1 * torch.randn(p.shape)).to(device).requires_grad_() for name, p in params.items()}


def _loss_grads(out, lse, leaves):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(out.shape, generator=gen).to(out)
    return torch.autograd.grad((out * w).sum() + lse.sum(), leaves, allow_unused=True)


@cpu_only
def test_branch_gradients_are_the_backward_at_the_kernels_output():
    """The op's gradients (its registered backward: the bf16 kernels) are the written-out softmax backward
    (``block_sparse.naive``) on the unquantized q, k, v at the FP8 kernel's o and LSE, an LSE gradient included."""
    from flexsparse.triton.block_sparse import naive
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 4, 2, 75, 16))
    selection = random_selection(1, 4, 75, 75, 16, 8, 3)
    o, lse = fp8_block_sparse_attention(q, k, v, selection, 0.25, deterministic=True)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    got = torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), (q, k, v))
    want = naive.block_sparse_attention_backward(do, dlse, q.detach(), k.detach(), v.detach(), selection, 0.25,
                                                 o.detach(), lse.detach())
    assert all(ts.rel_err(a, b) < 1e-5 for a, b in zip(got, want))


@cpu_only
@pytest.mark.parametrize("cfg", METHOD_CONFIGS, ids=lambda c: c["method"])
def test_methods_forward_is_the_kernel_and_gradients_at_its_output(cfg):
    """``flexsparse.attention(..., backend="triton")`` with ``quant``: the values of the no-grad (kernel) run,
    within the FP8 error of the torch backend's fake quantization; gradients of q, k and v at the kernel's O and
    LSE (a few % from the unquantized Triton branch's), as is SLA2's alpha's, which multiplies O_s, and exactly the
    unquantized gradients of every other parameter. Inputs on which the triton backend's selection (interpreted
    kernels) is the torch backend's (``ts.draw_selecting_alike``)."""
    n, d, heads = 75, 16, 2
    params = _params(cfg, d, heads, n)
    config = {**cfg, "quant": {}}
    q, k, v = (x.requires_grad_() for x in ts.draw_selecting_alike(lambda: make_qkv(1, heads, 1, n, d), config,
                                                                   params, ("triton", "torch")))
    out, lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True, params=params)
    with torch.no_grad():
        frozen, frozen_lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True, params=params)
        spec = flexsparse.attention(q, k, v, config, backend="torch", params=params)
        plain_out = flexsparse.attention(q, k, v, cfg, backend="triton", params=params)
    assert torch.equal(out, frozen) and torch.equal(lse, frozen_lse)
    assert ts.rel_err(out, spec) < 0.05 and ts.rel_err(out, plain_out) > 1e-2
    leaves = [q, k, v, *params.values()]
    grads = _loss_grads(out, lse, leaves)
    plain = flexsparse.attention(q, k, v, cfg, backend="triton", return_lse=True, params=params)
    want = _loss_grads(*plain, leaves)
    assert [g is None for g in grads] == [g is None for g in want]
    differing = [name for name, a, b in zip([*"qkv", *params], grads, want) if a is not None and not torch.equal(a, b)]
    assert differing == [*"qkv"] + (["alpha_logit"] if cfg["method"] == "sla2" else [])
    assert all(ts.rel_err(a, b) < 0.2 for a, b in zip(grads[:3], want[:3]))


@cpu_only
def test_op_smooths_k_with_the_given_mean():
    """``k_mean`` (a selection's ``key_mean``): the op's pre-pass smooths K with it, bit for bit the kernel on
    ``quantize_qkv(..., k_mean)``; any mean gives the attention up to quantization (the LSE takes the shift back)
    and the same gradient formula; a mean of another shape is refused, naming it."""
    from flexsparse.triton.block_sparse import naive
    bsz, n, block_q, block_k, heads, kv_heads, d, topk = CASES[1]
    q, k, v = (x.requires_grad_() for x in make_qkv(bsz, heads, kv_heads, n, d))
    selection = random_selection(bsz, heads, n, n, block_q, block_k, topk)
    scale = d**-0.5
    shift = k.detach().mean(dim=2, keepdim=True) + 0.1 * torch.randn(bsz, kv_heads, 1, d)
    o, lse = block_op.block_attn_fp8(q, k, v, selection.indices, block_q, block_k, scale, False, shift)
    with torch.no_grad():
        pre = quantize_qkv(q, k, v, block_q, block_k, shift)
        want_o, want_lse = block_attend_fp8(q, pre[2:], selection.indices, block_q, block_k, scale)
        own_o, own_lse = block_op.block_attn_fp8(q, k, v, selection.indices, block_q, block_k, scale, False)
        plain, _ = naive.block_sparse_attention(q, k, v, selection, scale)
    assert torch.equal(pre[4], shift[:, :, 0]) and torch.equal(o, want_o) and torch.equal(lse, want_lse)
    # K quantized otherwise: each output within the e4m3 error (~5 % on iid inputs) of the unquantized branch
    assert 0 < ts.rel_err(o, own_o) < 0.1 and ts.rel_err(lse, own_lse) < 1e-2
    assert ts.rel_err(o, plain) < 0.08 and ts.rel_err(own_o, plain) < 0.08
    do = torch.randn_like(o)
    got = torch.autograd.grad((o * do).sum(), (q, k, v))
    want = naive.block_sparse_attention_backward(do, None, q.detach(), k.detach(), v.detach(), selection, scale,
                                                 o.detach(), lse.detach())
    assert all(ts.rel_err(a, b) < 1e-5 for a, b in zip(got, want))
    with pytest.raises(ValueError, match=r"k_mean must hold one mean per batch, KV head and channel"):
        quantize_qkv(q.detach(), k.detach(), v.detach(), block_q, block_k, shift[:, :, :, :-1])


@cpu_only
def test_methods_smooth_k_with_their_selections_mean(monkeypatch):
    """With ``quant`` each block method takes the keys' mean from the block sums its selection pooled
    (``BlockSelection.key_mean``: ``mean_N k`` up to fp32 rounding) and the FP8 pre-pass uses it, with no pass over K
    of its own; without ``quant`` no mean is taken."""
    n, d, heads = 75, 16, 2
    q, k, v = make_qkv(1, heads, 1, n, d)
    means = []
    backend_type = type(TRITON)
    taken = backend_type.key_mean

    def spy(self, keys, block, sums=None):
        mean = taken(self, keys, block, sums)
        means.append((sums is not None, ts.rel_err(mean, keys.float().mean(dim=2, keepdim=True))))
        return mean

    def no_pass(*args):
        raise AssertionError("the FP8 pre-pass took the keys' mean itself")

    monkeypatch.setattr(backend_type, "key_mean", spy)
    monkeypatch.setattr(fp8_quant, "key_mean", no_pass)
    for cfg in METHOD_CONFIGS:
        params = _params(cfg, d, heads, n)
        means.clear()
        with torch.no_grad():
            flexsparse.attention(q, k, v, cfg, backend="triton", params=params)
            assert means == [], cfg["method"]
            flexsparse.attention(q, k, v, {**cfg, "quant": {}}, backend="triton", params=params)
        assert len(means) == 1 and means[0][0] and means[0][1] < 1e-6, cfg["method"]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pooling_pass_quantizes_q_and_k_as_the_prepass(dtype):
    """``fp8_quant.pool_quantize`` (strided q, k, v, GQA, ragged blocks): e4m3 Q and unsmoothed K per block with their
    scales bit for bit ``quantize_blocks``', V's amax ``max_N |v|``, the block means of q and k and k's block sums
    within fp32 rounding of the PyTorch pooling (``pooling.naive.block_pooling``); the op's PyTorch path alike.
    ``pool_quantize_queries`` (smoothed keys): the same pooling and Q's operands, bit for bit."""
    from flexsparse.triton.pooling import naive as pooling
    q, k, v = (x.to(dtype).transpose(1, 2).contiguous().transpose(1, 2) for x in make_qkv(2, 4, 2, 45, 24))
    for block_q, block_k in ((16, 8), (32, 16)):
        (q_means, k_means, k_sums), (q8, q_scales, k8, k_scales, v_amax) = fp8_quant.pool_quantize(
            q, k, v, block_q, block_k)
        assert all(map(torch.equal, (q8, q_scales), quantize_blocks(q, block_q)))
        assert all(map(torch.equal, (k8, k_scales), quantize_blocks(k, block_k)))
        assert torch.equal(v_amax, v.float().abs().amax(dim=2))
        for got, want in zip((q_means, k_means, k_sums), pooling.block_pooling(q, k, block_q, block_k)):
            assert got.dtype == torch.float32 and ts.rel_err(got, want) < 1e-6
        reference = block_op._pool_quantize_reference(q, k, v, block_q, block_k)   # the op's PyTorch path
        assert all(map(torch.equal, reference[3:], (q8, q_scales, k8, k_scales, v_amax)))
        assert all(ts.rel_err(a, b) < 1e-6 for a, b in zip(reference[:3], (q_means, k_means, k_sums)))
        queries = fp8_quant.pool_quantize_queries(q, k, block_q, block_k)        # smoothed keys: Q's alone
        assert all(map(torch.equal, (*queries[0], *queries[1]), (q_means, k_means, k_sums, q8, q_scales)))
    columns = [x.transpose(2, 3).contiguous().transpose(2, 3) for x in (q, k, v)]      # channels strided: the ops
    assert all(map(torch.equal, block_op.pool_quantize(*columns, block_q, block_k),    # copy the rows
                   (q_means, k_means, k_sums, q8, q_scales, k8, k_scales, v_amax)))
    assert all(map(torch.equal, block_op.pool_quantize_queries(*columns[:2], block_q, block_k),
                   (q_means, k_means, k_sums, q8, q_scales)))


SINGLE_PASS = {"smooth_keys": False}


def counted_pooling_passes(monkeypatch, name: str = "pool_quantize") -> list:
    """A list that gets an entry per call of ``fp8_quant``'s pooling pass ``name`` from here on (the pass still
    runs)."""
    calls, pooling = [], getattr(fp8_quant, name)
    monkeypatch.setattr(fp8_quant, name, lambda *a: calls.append(1) or pooling(*a))
    return calls


@cpu_only
@pytest.mark.parametrize("quant", [{}, SINGLE_PASS], ids=["smoothed", "unsmoothed"])
@pytest.mark.parametrize("cfg", METHOD_CONFIGS, ids=lambda c: c["method"])
def test_selections_pooling_pass_quantizes_for_the_fp8_branch(cfg, quant, monkeypatch):
    """The selection's pooling pass quantizes Q (``pool_quantize_queries``) and, with ``smooth_keys=False``, K
    (``pool_quantize``), and the FP8 branch takes them (unsmoothed: no K pass, no mean): the same o, LSE and
    gradients as the kernels quantizing the inputs themselves, within the FP8 error of the torch backend's fake
    quantization of the spec; the unsmoothed forward other than the smoothed one."""
    n, d, heads = 75, 16, 2
    params = _params(cfg, d, heads, n)
    config = {**cfg, "quant": quant}
    q, k, v = (x.requires_grad_() for x in ts.draw_selecting_alike(lambda: make_qkv(1, heads, 1, n, d), config,
                                                                   params, ("triton", "torch")))
    leaves = [q, k, v, *params.values()]
    pooled = counted_pooling_passes(monkeypatch, "pool_quantize" if quant else "pool_quantize_queries")
    handed, check = [], block_op.checked_pooled
    monkeypatch.setattr(block_op, "checked_pooled", lambda *a: handed.append(check(*a)) or handed[-1])
    keys_pass = fp8_quant.quantize_keys

    def no_keys_pass(*args):
        raise AssertionError("the FP8 pre-pass quantized K again")

    if quant:
        monkeypatch.setattr(fp8_quant, "quantize_keys", no_keys_pass)
    out, lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True, params=params)
    assert pooled == [1] and handed and all(len(x) == (5 if quant else 2) for x in handed)
    handed.clear()
    grads = _loss_grads(out, lse, leaves)
    monkeypatch.setattr(fp8_quant, "quantize_keys", keys_pass)
    monkeypatch.setattr(type(TRITON), "quantizing_pooling", backends.base.Backend.quantizing_pooling)
    own_out, own_lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True, params=params)
    assert pooled == [1] and handed and all(x is None for x in handed)
    assert torch.equal(out, own_out) and torch.equal(lse, own_lse)
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(grads, _loss_grads(own_out, own_lse,
                                                                                                 leaves)))
    with torch.no_grad():
        spec = flexsparse.attention(q, k, v, config, backend="torch", params=params)
        smoothed = flexsparse.attention(q, k, v, {**cfg, "quant": {}}, backend="triton", params=params)
    assert ts.rel_err(out, spec) < 0.05 and torch.equal(out, smoothed) != bool(quant)


@cpu_only
def test_prepared_operands_serve_only_the_tensors_they_were_made_from(monkeypatch):
    """A selection's pooled FP8 operands are used only for the q, k, v they came from: SLA2 with ``smooth_k="all"``
    (its branches attend smoothed keys) pools without them, and a selection handed other tensors is attended as
    if it had none."""
    n, d, heads = 75, 16, 2
    cfg = {**next(c for c in METHOD_CONFIGS if c["method"] == "sla2"), "smooth_k": "all", "quant": SINGLE_PASS}
    params = _params(cfg, d, heads, n)
    q, k, v = make_qkv(1, heads, 1, n, d)
    pooled = counted_pooling_passes(monkeypatch)
    with torch.no_grad():
        flexsparse.attention(q, k, v, cfg, backend="triton", params=params)
        assert pooled == []
        topk = next(c for c in METHOD_CONFIGS if c["method"] == "topk")
        selection = METHODS["topk"].select(q, k, v, Config.from_dict({**topk, "quant": SINGLE_PASS}), TRITON, {})
        assert pooled == [1] and selection.prepared is not None
        other_q = q + 0.5 * torch.randn_like(q)             # other values: the pooled Q must not serve them
        got = fp8_block_sparse_attention(other_q, k, v, selection, 0.25, smooth_keys=False)
        want = fp8_block_sparse_attention(other_q, k, v, dataclasses.replace(selection, prepared=None), 0.25,
                                          smooth_keys=False)
    assert all(map(torch.equal, got, want))


# ------------------------------------------------------------------------------ CPU, parent process

@cpu_parent
def test_cpu_fallback_is_the_torch_fake_quant():
    """Without the interpreter the op runs the torch backend's fake-quantized branch."""
    q, k, v = make_qkv(1, 4, 2, 70, 16)
    selection = random_selection(1, 4, 70, 70, 16, 8, 3)
    with ts.interpreter_env(False):
        o, lse = fp8_block_sparse_attention(q, k, v, selection, 0.25)
    want_o, want_lse = fake_quant_branch(q, k, v, selection, 0.25)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


@cpu_parent
def test_opcheck_cpu_fallback():
    q, k, v = make_qkv(1, 2, 1, 40, 16)
    selection = random_selection(1, 2, 40, 40, 16, 16, 2)
    with ts.interpreter_env(False):
        torch.library.opcheck(block_op.block_attn_fp8.op, (q, k, v, selection.indices, 16, 16, 0.25, False))
        torch.library.opcheck(block_op.block_attn_fp8.op, (q, k, v, selection.indices, 16, 16, 0.25, False,
                                                           k.mean(dim=2, keepdim=True)))


@cpu_parent
def test_op_takes_the_pooled_operands_together_and_unsmoothed():
    """``block_attn_fp8``'s ``q8 ... v_amax``: opcheck with all five unsmoothed and with ``q8, q_scales`` alone either
    way (the CPU fallback quantizes itself, the same values); others, or all five with ``smooth_keys=True``, are a
    ValueError that names them; the pooling ops' opcheck."""
    q, k, v = make_qkv(1, 2, 1, 40, 16)
    selection = random_selection(1, 2, 40, 40, 16, 16, 2)
    pooled = (torch.zeros(q.shape, dtype=torch.float16), torch.ones(1, 2, 3),
              torch.zeros(k.shape, dtype=torch.float16), torch.ones(1, 1, 3), torch.ones(1, 1, 16))
    args = (q, k, v, selection.indices, 16, 16, 0.25, False, None)
    with ts.interpreter_env(False):
        for good in ((*args, False, *pooled), (*args, True, *pooled[:2]), (*args, False, *pooled[:2])):
            torch.library.opcheck(block_op.block_attn_fp8.op, good)
        for bad, names in (((*args, False, *pooled[:3]), "q8, q_scales, k8"), ((*args, True, *pooled), "v_amax"),
                           ((*args, False, None, *pooled[1:3]), "q_scales, k8")):
            with pytest.raises(ValueError, match=rf"five operands .* together and with smooth_keys=False.*{names}"):
                block_op.block_attn_fp8(*bad)
        torch.library.opcheck(block_op.pool_quantize.op, (q, k, v, 16, 8))
        torch.library.opcheck(block_op.pool_quantize_queries.op, (q, k, 16, 8))


@cpu_parent
@pytest.mark.parametrize("quant", [{}, SINGLE_PASS], ids=["smoothed", "unsmoothed"])
def test_fullgraph_trace_of_quantized_training_step(quant, monkeypatch):
    """``torch.compile(fullgraph=True)`` traces the triton backend with quant (the FP8 op and its autograd, the
    bf16 backward op) without graph breaks; aot_eager on the CPU fallback."""
    cfg = {"method": "sla", "block_size": 16, "topk_ratio": 0.3, "quant": quant}
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 2, 64, 16))
    params = _params(cfg, 16, 2, 64)

    def step(q, k, v):
        out, lse = flexsparse.attention(q, k, v, cfg, backend="triton", return_lse=True, params=params)
        return out.square().sum() + lse.sum()

    checked, check = [], block_op.checked_pooled
    monkeypatch.setattr(block_op, "checked_pooled", lambda *a: checked.append(check(*a)) or checked[-1])
    torch._dynamo.reset()
    with ts.interpreter_env(False), ts.triton_ops_on_cpu():
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
        # the FP8 op gets the pooling pass's operands in the graph too: Q's, and K's unsmoothed
        assert checked and all(x is not None and len(x) == (5 if quant else 2) for x in checked)
        grads = torch.autograd.grad(got, (q, k, v))
        want = step(q, k, v)
        want_grads = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)


@cpu_parent
@pytest.mark.parametrize("method,quant,match", [
    ("llsa", {}, "not llsa's levels"),
    ("sla", {"qk_dtype": "int8"}, "qk_dtype='fp8_e4m3' only"),
    ("topk", {"p": "none"}, "p='static' only.*'flex' for p='none'"),
    ("sla2", {"qk": "per_tensor"}, "qk='per_block' only"),
    ("sla", {"v": "per_tensor"}, "v='per_channel' only"),
])
def test_triton_refuses_what_the_kernel_cannot_run_and_auto_skips_it(method, quant, match):
    cfg = ts.example_config(method, block_size=8 if method == "llsa" else 16, topk=2)
    q, k, v = make_qkv(1, 2, 2, 64, 16)
    params = _params(cfg, 16, 2, 64)
    with pytest.raises(ValueError, match=f"backend 'triton' cannot run method '{method}' with config key 'quant'.*"
                                         + match):
        flexsparse.attention(q, k, v, {**cfg, "quant": quant}, backend="triton", params=params)
    cpu = torch.device("cpu")
    with ts.interpreter_env(True):
        assert backends.resolve("auto", METHODS[method], cpu, True, quant=QuantConfig(**quant)).name == "torch"
        for name in ts.fp8_methods():
            assert backends.resolve("auto", METHODS[name], cpu, True, quant=QuantConfig()).name == "triton"
    with pytest.raises(ValueError, match="backend 'triton' cannot run config key 'quant'"):
        TRITON.block_sparse_attention(q, k, v, random_selection(1, 2, 64, 64, 16, 16, 2), 0.25,
                                      quant=QuantConfig(**quant) if quant else QuantConfig(p="none"))


# ----------------------------------------------------------------------------------------------- GPU

def _gpu_inputs(n, heads, kv_heads, d, block_q, block_k, topk, dtype=torch.bfloat16):
    q, k, v = make_qkv(1, heads, kv_heads, n, d, dtype, "cuda")
    return (q, k, v), random_selection(1, heads, n, n, block_q, block_k, topk, "cuda")


@gpu
def test_gpu_e4m3_rounding_emulation_equals_the_hardware_cast():
    x = rounding_cases("cuda")
    real = kernel_round(x, False)
    assert torch.equal(real, e4m3(x))
    assert torch.equal(kernel_round(x, True), real)


@gpu
def test_gpu_prepass_equals_the_quant_formats_bit_for_bit():
    x = (torch.randn(2, 4, 4000, 64, device="cuda") * 3).to(torch.bfloat16)
    mean = x.mean(dim=2, dtype=torch.float32)
    for block in (64, 128):
        values, scales = quantize_blocks(x, block, mean)
        xs = x.float() - mean[:, :, None]
        assert values.dtype == E4M3 and torch.equal(scales, block_scales(xs, block)[..., 0])
        per_token = scales.repeat_interleave(block, dim=2)[:, :, :4000, None]
        assert torch.equal(values.float(), quantize(xs, per_token))
    v = (torch.randn(2, 4, 4000, 64, device="cuda") * torch.rand(2, 4, 1, 64, device="cuda") * 8).to(torch.bfloat16)
    k8, k_scales, v_amax = quantize_keys(x, v, 64, mean)
    assert all(map(torch.equal, (k8, k_scales), quantize_blocks(x, 64, mean)))
    assert torch.equal(v_amax, v.float().abs().amax(dim=2))
    own_mean = quantize_qkv(x, x, v, 64, 64)[4]
    assert ((own_mean - mean).abs() <= 1e-5 * x.float().abs().mean(dim=2)).all()      # a missing row: 2.5e-4
    vt, v_scales = quantize_v_transposed(v, v_amax)
    assert torch.equal(v_scales, channel_scales(v)[:, :, 0])
    assert torch.equal(vt[..., :4000].float(), quantize(v, channel_scales(v)).transpose(-1, -2))
    assert (vt[..., 4000:].float() == 0).all()


GPU_CASES = [  # (N, H, Hk, D, block_q, block_k, K)
    (4096, 4, 2, 64, 64, 64, 8), (4000, 4, 1, 64, 64, 32, 12), (4096, 2, 2, 128, 128, 64, 5),
    (4133, 2, 1, 96, 32, 128, 4), (3000, 2, 2, 64, 64, 16, 20),
]


@gpu
@pytest.mark.parametrize("n,heads,kv_heads,d,block_q,block_k,topk", GPU_CASES)
def test_gpu_kernel_matches_emulation_fake_quant_and_bf16(n, heads, kv_heads, d, block_q, block_k, topk):
    """Real e4m3 dots: tight against the emulation (fp8 MMA accumulation and exp2 differ from torch's),
    within the FP8-rounding bound of the fake-quant spec, and within the quantization error of the bf16
    kernel (random inputs, sla at 25%: 5.3% mean in docs/methods.md)."""
    (q, k, v), selection = _gpu_inputs(n, heads, kv_heads, d, block_q, block_k, topk)
    scale = d**-0.5
    pre = quantize_qkv(q, k, v, block_q, block_k)
    o, lse = block_attend_fp8(q, pre[2:], selection.indices, block_q, block_k, scale)
    want_o, want_lse = emulate_kernel(pre, selection.indices, block_q, block_k, scale,
                                      kernel_tiles(pre, selection.indices, block_q, block_k))
    assert o.dtype == torch.bfloat16
    # LSE: the fp8 MMA accumulates Q K^T with ~14 bits, so logits carry ~1e-4 absolute error
    assert ts.rel_err(o, want_o) < flips_tolerance(d) and ts.rel_err(lse, want_lse) < 1e-4
    spec_o, spec_lse = fake_quant_branch(q, k, v, selection, scale)
    spec_o = spec_o.float()
    assert ts.rel_err(o, spec_o) < 0.04 and ts.rel_err(lse, spec_lse) < 1e-4
    if n <= 4096:
        bound = spec_bound(pre, selection, scale) + 2.0**-7 * spec_o.abs()           # + both outputs' bf16 rounding
        assert ((o.float() - spec_o).abs() <= bound).all()
    plain_o, plain_lse = TRITON.sparse_softmax(q, k, v, selection, scale)
    assert 1e-3 < ts.rel_err(o, plain_o) < 0.07 and ts.rel_err(lse, plain_lse) < 1e-2


@gpu
@pytest.mark.parametrize("n,heads,kv_heads,d,block_q,topk", [(4096, 4, 2, 128, 64, 8), (4000, 2, 2, 128, 128, 5),
                                                              (1000, 4, 1, 128, 128, 3)])
def test_gpu_warp_specialized_fp8_kernel_matches_the_triton_one(n, heads, kv_heads, d, block_q, topk):
    """The Gluon FP8 forward against the Triton FP8 kernel walking the same key order on the same pre-pass outputs:
    the same math up to fp32 reassociation and the fp8 MMAs' accumulation (ragged N, GQA, query blocks of one and
    two tiles), in its default (two key blocks per step, ``P V`` accumulated in the MMA) and with one block per step
    into a fresh accumulator; both against the emulation."""
    from flexsparse.triton.block_sparse.fwd_ws_fp8 import ws_block_attend_fp8
    (q, k, v), selection = _gpu_inputs(n, heads, kv_heads, d, block_q, 64, topk)
    scale = d**-0.5
    pre = quantize_qkv(q, k, v, block_q, 64)
    assert gluon_runs(pre[2], selection.indices, block_q, 64)
    default_order = kernel_tiles(pre, selection.indices, block_q, 64)
    for gluon_tiles, triton_tiles in (({}, default_order), (GLUON_ONE_BLOCK, ONE_BLOCK_PER_STEP)):
        want_o, want_lse = block_attend_fp8(q, pre[2:], selection.indices, block_q, 64, scale, triton_tiles)
        o, lse = ws_block_attend_fp8(*pre, selection.indices, block_q, 64, scale, q.dtype, gluon_tiles)
        assert o.dtype == q.dtype and lse.shape == want_lse.shape
        assert ts.rel_err(o, want_o) < flips_tolerance(d) and ts.rel_err(lse, want_lse) < 1e-4
        emulated, _ = emulate_kernel(pre, selection.indices, block_q, 64, scale, triton_tiles)
        assert ts.rel_err(o, emulated) < flips_tolerance(d)


def test_pairs_need_an_even_ring_of_four_slots():
    """Two key blocks a step hold two slots until the next pair's scores are issued: 2 slots would deadlock."""
    from flexsparse.triton.block_sparse.gluon import block_fwd_ws_fp8
    if block_fwd_ws_fp8 is None:
        pytest.skip("this triton has no Gluon")
    for stages in (2, 3, 5):
        with pytest.raises(ValueError, match=f"pairs needs an even number of ring slots, at least 4, got {stages}"):
            block_fwd_ws_fp8.check_ring({"pairs": True}, stages)
    block_fwd_ws_fp8.check_ring({"pairs": True}, 4)
    block_fwd_ws_fp8.check_ring({"pairs": False}, 3)


@gpu
@pytest.mark.parametrize("n,heads,kv_heads,d,block_q,topk", [(4096, 4, 2, 64, 64, 7), (4000, 2, 2, 128, 128, 5),
                                                              (4096, 2, 1, 128, 64, 8), (1000, 4, 1, 64, 128, 3)])
def test_gpu_two_key_blocks_per_step(n, heads, kv_heads, d, block_q, topk):
    """Both FP8 kernels with two 64-key blocks per softmax step (the running max per pair, an odd list's last block
    alone; ragged N, GQA): the Triton kernel (``KB=2``) and the Gluon one (``pairs``, its ``P V`` in a fresh
    accumulator per pair or accumulated in the MMA) against the emulation in the same key order."""
    (q, k, v), selection = _gpu_inputs(n, heads, kv_heads, d, block_q, 64, topk)
    scale = d**-0.5
    pre = quantize_qkv(q, k, v, block_q, 64)
    want_o, want_lse = emulate_kernel(pre, selection.indices, block_q, 64, scale, PAIRS)
    o, lse = block_attend_fp8(q, pre[2:], selection.indices, block_q, 64, scale, PAIRS)
    assert ts.rel_err(o, want_o) < flips_tolerance(d) and ts.rel_err(lse, want_lse) < 1e-4
    if gluon_runs(pre[2], selection.indices, block_q, 64):
        from flexsparse.triton.block_sparse.fwd_ws_fp8 import ws_block_attend_fp8
        for fresh, tol in ((True, flips_tolerance(d)), (False, 2e-2)):
            o, lse = ws_block_attend_fp8(*pre, selection.indices, block_q, 64, scale, q.dtype,
                                         {"pairs": True, "stages": 4, "fresh_acc": fresh})
            assert ts.rel_err(o, want_o) < tol and ts.rel_err(lse, want_lse) < 1e-4


@gpu
@pytest.mark.parametrize("n,heads,kv_heads,d,block_q,block_k,topk", [(4096, 4, 2, 64, 64, 64, 8),
                                                                     (4000, 2, 2, 128, 128, 64, 5),
                                                                     (3000, 2, 1, 64, 64, 32, 12)])
def test_gpu_permuted_keys_and_deferred_rescale_keep_the_output(n, heads, kv_heads, d, block_q, block_k, topk,
                                                                monkeypatch):
    """The default FP8 kernel with V^T's keys permuted (``fp8_quant.PERMUTED_KEYS``): O as with the keys in order up
    to the dot's summation order, the same LSE, O against the emulation; on sm_90 the Gluon kernel's deferred
    rescale of one key block per step (``defer_rescale``) against the rescale at every step."""
    (q, k, v), selection = _gpu_inputs(n, heads, kv_heads, d, block_q, block_k, topk)
    scale = d**-0.5
    pre = quantize_qkv(q, k, v, block_q, block_k)
    o, lse = block_attend_fp8(q, pre[2:], selection.indices, block_q, block_k, scale)
    tiles = kernel_tiles(pre, selection.indices, block_q, block_k)
    assert ts.rel_err(o, emulate_kernel(pre, selection.indices, block_q, block_k, scale, tiles)[0]) < flips_tolerance(d)
    if gluon_runs(pre[2], selection.indices, block_q, block_k):
        from flexsparse.triton.block_sparse.fwd_ws_fp8 import ws_block_attend_fp8
        one_block = [ws_block_attend_fp8(*pre, selection.indices, block_q, block_k, scale, q.dtype,
                                         {**GLUON_ONE_BLOCK, "defer_rescale": defer}) for defer in (True, False)]
        (deferred, deferred_lse), (undeferred, undeferred_lse) = one_block
        assert ts.rel_err(undeferred, deferred) < 3e-3 and torch.equal(undeferred_lse, deferred_lse)
    monkeypatch.setattr(fp8_quant, "PERMUTED_KEYS", False)
    in_order = quantize_qkv(q, k, v, block_q, block_k)
    want_o, want_lse = block_attend_fp8(q, in_order[2:], selection.indices, block_q, block_k, scale)
    assert ts.rel_err(o, want_o) < 3e-3 and torch.equal(lse, want_lse)


@gpu
@pytest.mark.parametrize("method", ["sla", "sla2"])
def test_gpu_quantized_methods_with_permuted_keys(method, monkeypatch):
    """``sla`` and ``sla2`` with ``quant`` at D=128 (the Gluon kernel with the linear branch in its epilogue on
    sm_90): the same output with V^T's keys permuted (the default) as in order, up to the dot's summation order."""
    module = flexsparse.SparseAttention(ts.example_config(method, quant={}), head_dim=128, num_heads=2, seq_len=4096,
                                        backend="triton").cuda()
    q, k, v = make_qkv(1, 2, 2, 4096, 128, torch.bfloat16, "cuda")
    with torch.no_grad():
        want = module(q, k, v)
        monkeypatch.setattr(fp8_quant, "PERMUTED_KEYS", False)
        got = module(q, k, v)
    assert ts.rel_err(got, want) < 3e-3


@gpu
def test_gpu_structured_inputs_error_against_bf16():
    """Low-rank smooth tokens (V with a mean): the FP8 error drops well below the random-input one."""
    q, k, v = structured_qkv(1, 2, 4096, 64, gain=1.5, seed=0, device="cuda", dtype=torch.bfloat16)
    selection = random_selection(1, 2, 4096, 4096, 64, 64, 16, "cuda")
    o, _ = fp8_block_sparse_attention(q, k, v, selection, 0.125)
    plain, _ = TRITON.sparse_softmax(q, k, v, selection, 0.125)
    assert ts.rel_err(o, plain) < 0.03


GPU_METHODS = [cfg for cfg in ts.GPU_METHODS if cfg["method"] in ts.fp8_methods()]   # the FP8 kernel's methods


@gpu
@pytest.mark.parametrize("cfg", GPU_METHODS, ids=lambda c: c["method"])
def test_gpu_methods_quantized_forward_and_gradients(cfg):
    """Forward within the FP8 error of the torch fake quantization; the branch's gradients the bf16 backward
    kernels' at the FP8 kernel's O and LSE, bit for bit (deterministic dK/dV); at the method level q, k and v's a
    few % from the unquantized ones, and the method's parameters' (but SLA2's alpha, which multiplies the quantized
    output) the unquantized ones: bitwise, ``sla``'s projection weight to rounding (its gradient ``dO^T O_l`` reads
    the O_l of each path, which on sm_90 the unquantized one computes in the Gluon sparse kernel's epilogue,
    ``linear.mix_ws``). Inputs on which the torch backend's selection (PyTorch) is the triton backend's
    (``ts.draw_selecting_alike``)."""
    cfg = {**cfg, "deterministic": True}
    n, d, heads = 4096, 64, 4
    params = _params(cfg, d, heads, n, "cuda")
    config = {**cfg, "quant": {}}
    q, k, v = (x.requires_grad_() for x in ts.draw_selecting_alike(
        lambda: make_qkv(1, heads, 2, n, d, torch.bfloat16, "cuda"), config, params, ("triton", "torch")))
    out, lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True, params=params)
    with torch.no_grad():
        spec = flexsparse.attention(q, k, v, config, backend="torch", params=params)
    assert ts.rel_err(out, spec) < 0.04
    leaves = [q, k, v, *params.values()]
    grads = _loss_grads(out, lse, leaves)
    plain = flexsparse.attention(q, k, v, cfg, backend="triton", return_lse=True, params=params)
    want = _loss_grads(*plain, leaves)
    for name, a, b in zip([*"qkv", *params], grads, want):
        assert (a is None) == (b is None), name
        if a is None or name == "alpha_logit":
            continue
        if name in "qkv":
            assert 1e-3 < ts.rel_err(a, b) < 0.2, name
        elif name == "proj_weight":
            assert ts.rel_err(a, b) < 2e-3, name
        else:
            assert torch.equal(a, b), name
    selection = random_selection(1, heads, n, n, 64, 64, 8, "cuda")
    o, lse = fp8_block_sparse_attention(q, k, v, selection, d**-0.5, deterministic=True)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    got = torch.autograd.grad((o.float() * do.float()).sum() + (lse * dlse).sum(), (q, k, v))
    want = block_op.block_attn_bwd(do, dlse, q.detach(), k.detach(), v.detach(), selection.indices, o.detach(),
                                   lse.detach(), 64, 64, d**-0.5, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@gpu
@pytest.mark.parametrize("quant", [{}, SINGLE_PASS], ids=["smoothed", "unsmoothed"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("cfg", GPU_METHODS, ids=lambda c: c["method"])
def test_gpu_pooling_pass_quantization(cfg, d, quant, monkeypatch):
    """On e4m3 (D = 128: the Gluon kernels on sm_90) the operands of the selection's pooling pass (Q's; K's too with
    ``smooth_keys=False``) give the o, LSE and gradients of the kernels quantizing the inputs themselves, bit for
    bit, within the FP8 error of the torch backend's fake quantization. Without the eager CUDA graphs, which would
    replay the first call's graph for the second."""
    monkeypatch.setenv("FLEXSPARSE_EAGER_GRAPHS", "0")
    n, heads = 4096, 4
    params = _params(cfg, d, heads, n, "cuda")
    config = {**cfg, "deterministic": True, "quant": quant}
    q, k, v = (x.requires_grad_() for x in ts.draw_selecting_alike(
        lambda: make_qkv(1, heads, 2, n, d, torch.bfloat16, "cuda"), config, params, ("triton", "torch")))
    leaves = [q, k, v, *params.values()]
    out, lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True, params=params)
    grads = _loss_grads(out, lse, leaves)
    with torch.no_grad():
        spec = flexsparse.attention(q, k, v, config, backend="torch", params=params)
    monkeypatch.setattr(type(TRITON), "quantizing_pooling", backends.base.Backend.quantizing_pooling)
    own_out, own_lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True, params=params)
    assert torch.equal(out, own_out) and torch.equal(lse, own_lse) and ts.rel_err(out, spec) < 0.04
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(grads, _loss_grads(own_out, own_lse,
                                                                                                 leaves)))


@gpu
@pytest.mark.parametrize("quant", [{}, SINGLE_PASS], ids=["smoothed", "unsmoothed"])
@pytest.mark.parametrize("cfg", GPU_METHODS, ids=lambda c: c["method"])
def test_gpu_compiled_quantized_training_no_graph_breaks(cfg, quant):
    """fullgraph compile of forward + backward with quant on triton (the pooling pass's FP8 operands in the graph):
    one graph, no breaks, no recompiles over 3 steps with new inputs; matches eager."""
    n, d, heads = 4096, 64, 4
    params = _params(cfg, d, heads, n, "cuda")
    config = Config.from_dict({**cfg, "quant": quant})

    def step(q, k, v):
        o, lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True, params=params)
        return o.float().square().sum() + lse.sum(), o

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(3):
            leaves = [x.requires_grad_() for x in make_qkv(1, heads, 2, n, d, torch.bfloat16, "cuda")]
            loss, out = compiled(*leaves)
            loss.backward()
            eager = [x.detach().clone().requires_grad_() for x in leaves]
            eager_loss, eager_out = step(*eager)
            eager_loss.backward()
            assert ts.rel_err(out, eager_out) < 1e-2
            for a, b in zip(leaves, eager):
                assert ts.rel_err(a.grad, b.grad) < 2e-2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]


@gpu
def test_gpu_opcheck():
    (q, k, v), selection = _gpu_inputs(1000, 2, 1, 64, 64, 64, 4)
    torch.library.opcheck(block_op.block_attn_fp8.op, (q, k, v, selection.indices, 64, 64, 0.125, False))
    torch.library.opcheck(block_op.block_attn_fp8.op, (q, k, v, selection.indices, 64, 64, 0.125, False,
                                                       k.float().mean(dim=2, keepdim=True)))


@cpu_only
@pytest.mark.exhaustive
def test_kernel_benchmark_script_runs_in_the_interpreter(tmp_path):
    """benchmarks/gpu_fp8_kernel.py at a tiny size: timings, speedups, errors and a 2-config sweep."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_fp8_kernel.py"
    spec = importlib.util.spec_from_file_location("gpu_fp8_kernel", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--device", "cpu", "--n", "128", "--batch", "1", "--heads", "1", "--head-dims", "16",
                         "--block", "32", "--ratio", "0.5", "--sweep", "--out", str(tmp_path / "k.json")])
    row = report["results"]["D16"]
    assert 0.01 < row["rel_l2_random"] < 0.08 and 0 < row["rel_l2_structured"] < 0.08
    assert row["speedup_kernel"] > 0 and row["prepass_ms"]["median_ms"] > 0
    assert row["speedup_options"] > 0 and row["speedup_default_total"] > 0 and row["rel_l2_in_order"] < 1e-5
    best = row["sweep"]["best"]
    assert len(row["sweep"]["rows"]) == 2 and best["speedup_kernel"] > 0 and best["speedup_kernel_mma_acc"] > 0
    assert (tmp_path / "k.json").is_file()
