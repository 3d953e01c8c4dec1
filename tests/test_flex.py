"""``backend="flex"``: BlockMask tables, CPU compiled forward, GPU forward/backward and torch.compile.

CPU compiles are slow (~10-40 s each, ~1-2 min for the first): few CPU cases, and each test's
calls share shapes so that its compiled graph is reused. Every test starts with fresh dynamo
caches and fails on a hit recompile limit instead of silently running eager FlexAttention.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import flexsparse
from flexsparse import backends
from flexsparse.backends import BACKENDS
from flexsparse.backends import flex_backend as flex
from flexsparse.config import Config
from flexsparse.masks import BlockSelection, llsa_block_ids, ring_llsa_layout
from flexsparse.masks.block_mask import (block_mask_from_ids, block_selection_to_block_mask, block_tables,
                                         llsa_block_mask)
from flexsparse.methods import METHODS
from flexsparse.methods.blocks import select_blocks
from flexsparse.methods.dense import block_sparse_dense
from flexsparse.methods.llsa.reference import llsa_dense
from flexsparse.methods.vsa.reference import vsa_dense
from flexsparse.triton.block_sparse import naive as block_naive
from flexsparse.triton.llsa import naive as llsa_naive
from flexsparse.triton.pooling.naive import mean_pool, pool_pyramid
from flexsparse.triton.selection.naive import block_topk, llsa_topk
from helpers import rel_err

gpu = pytest.mark.gpu  # skipped without CUDA (conftest.py)


@pytest.fixture(autouse=True)
def _fresh_dynamo_no_silent_eager_fallback():
    """Each test starts with empty dynamo caches (the module-level compiled flex_attention would
    otherwise collect one entry per dtype/block/head-dim combination across the session)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


def _qkv(b, h, hk, nq, nk, d, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((b, h, nq, d), (b, hk, nk, d), (b, hk, nk, d))
    return [torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype) for s in shapes]


def _f64(*xs):
    return [x.detach().double() for x in xs]


def _without_triton(name):
    """Method ``name`` with the backends reference, torch and flex only (``backends.resolve``'s "auto" then never
    picks triton, whatever the machine)."""
    method = METHODS[name]
    return type(type(method).__name__, (type(method),), {"backends": ("reference", "torch", "flex")})()


def _random_ids(b, h, rows, cols, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(cols, generator=gen)[:k] for _ in range(b * h * rows)])
    return ids.view(b, h, rows, k).sort(-1).values.to(torch.int32)


# ---------------------------------------------------------------- tables (no compile)

def test_block_tables_match_flex_transpose_and_bits():
    b, h, rows, cols, k = 2, 3, 7, 40, 5
    ids = _random_ids(b, h, rows, cols, k)
    kv_num, kv_idx, q_num, q_idx, bits, *partial = block_tables(ids, cols, True)
    forward_only = block_tables(ids, cols, False)  # no key-major tables: kv_num, kv_idx, bits, two partial
    assert len(forward_only) == 5 and all(torch.equal(a, b) for a, b in zip(forward_only, (kv_num, kv_idx, bits)))
    assert kv_idx.shape == (b, h, rows, cols) and torch.equal(kv_idx[..., :k], ids)
    assert len(partial) == 4  # CPU: all four partial tables (CUDA: the counts only)
    for empty, full in zip(partial, (kv_num, kv_idx, q_num, q_idx)):  # same layout: the kernels share strides
        assert not empty.any() and empty.shape == full.shape and empty.stride() == full.stride()
    assert torch.equal(kv_num, torch.full((b, h, rows), k, dtype=torch.int32))
    ref = BlockMask.from_kv_blocks(torch.zeros_like(kv_num), torch.zeros_like(kv_idx), kv_num, kv_idx.clone(),
                                   BLOCK_SIZE=16)
    assert torch.equal(q_num, ref.full_q_num_blocks)
    valid = torch.arange(rows) < q_num.unsqueeze(-1)
    assert torch.equal(q_idx[valid], ref.full_q_indices[valid])
    dense = torch.zeros(b, h, rows, cols, dtype=torch.bool).scatter_(-1, ids.long(), True)
    j = torch.arange(cols)
    assert torch.equal((bits[..., j // 32] >> (j % 32)) & 1 == 1, dense)


def test_eager_flex_honours_the_selection():
    """Uncompiled FlexAttention ignores the index lists: the mask_mod alone must give the sparse result."""
    q, k, v = _qkv(1, 4, 2, 300, 300, 32)
    top, _ = block_topk(mean_pool(q, 32), mean_pool(k, 16), 5)
    selection = BlockSelection(top, 32, 16, 300, 300)
    out = flex_attention(q, k, v, block_mask=block_selection_to_block_mask(selection), scale=0.2, enable_gqa=True)
    torch.testing.assert_close(out, block_naive.block_sparse_attention(q, k, v, selection, 0.2)[0],
                               atol=1e-5, rtol=1e-5)

    levels, topk = 2, (3, 2)
    k_levels, v_levels = pool_pyramid(k, 16, levels), pool_pyramid(v, 16, levels)
    sel = llsa_topk(q, k, topk, 16)
    mask, layout = llsa_block_mask(sel)
    k_ext = llsa_naive.extended_kv([k, *k_levels], layout, q.dtype)
    v_ext = llsa_naive.extended_kv([v, *v_levels], layout, q.dtype)
    out = flex_attention(q, k_ext, v_ext, score_mod=flex.llsa_score_mod(layout),
                         block_mask=mask, scale=0.2, enable_gqa=True)
    ref, _ = llsa_naive.llsa_attention(q, [k, *k_levels], [v, *v_levels], sel, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    # a chunk of whole query blocks over its fetched fine blocks (level 0 not the sequence) and the whole pyramid
    rows = torch.arange(5, 12)
    fine, position = chunk_fine_blocks(k, v, sel, rows, 16)
    chunk = ring_llsa_layout(300, 16, levels, fine[0].shape[2])
    ids = llsa_block_ids(sel, chunk, rows, position)
    q_c = q[:, :, 5 * 16:12 * 16]
    mask = block_mask_from_ids(ids, chunk.num_blocks, 16, 16, (q_c.shape[2], chunk.length))
    k_ext = llsa_naive.extended_kv([fine[0], *k_levels], chunk, q.dtype)
    v_ext = llsa_naive.extended_kv([fine[1], *v_levels], chunk, q.dtype)
    out = flex_attention(q_c, k_ext, v_ext, score_mod=flex.llsa_score_mod(chunk), block_mask=mask, scale=0.2,
                         enable_gqa=True)
    torch.testing.assert_close(out, ref[:, :, 5 * 16:12 * 16], atol=1e-5, rtol=1e-5)


def chunk_fine_blocks(k, v, selection, rows, block):
    """The fine blocks the query blocks ``rows`` select, in sequence order, as a ring rank fetches them:
    ``((k_c, v_c), position)``, ``position[i]`` block i's place among them."""
    wanted = torch.unique(selection.indices[0][:, :, rows]).long()
    tokens = (wanted[:, None] * block + torch.arange(block, device=k.device)).flatten()
    tokens = tokens[tokens < k.shape[2]]
    position = torch.full((-(-k.shape[2] // block),), -1, dtype=torch.int64, device=k.device)
    position[wanted] = torch.arange(wanted.numel(), device=k.device)
    return (k[:, :, tokens], v[:, :, tokens]), position


# ---------------------------------------------------------------- CPU forward (compiled)

BLOCK_CASES = [  # (H, Hk, Nq, Nk, block_q, block_k, topk): GQA, MQA + cross lengths + q != kv blocks
    (4, 2, 1000, 1000, 64, 64, 4),
    (2, 1, 17, 1500, 16, 32, 6),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=["gqa-1000-b64", "mqa-17x1500-b16x32"])
def test_topk_and_vsa_forward_cpu(case):
    h, hk, nq, nk, bq, bk, topk = case
    q, k, v = _qkv(2, h, hk, nq, nk, 32)
    scale = 0.3
    cfg = Config.from_dict({"method": "topk", "block_q": bq, "block_k": bk, "topk": topk})
    with torch.no_grad():
        out = flexsparse.attention(q, k, v, cfg, backend="flex", scale=scale)
        selection = select_blocks(q, k, v, cfg, BACKENDS["flex"])
        ref, _ = block_sparse_dense(*_f64(q, k, v), selection, scale)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out, flexsparse.attention(q, k, v, cfg, backend="torch", scale=scale),
                                   atol=2e-5, rtol=2e-5)

        vsa_cfg = Config.from_dict({"method": "vsa", "block_q": bq, "block_k": bk, "topk": topk, "gate": True})
        module = flexsparse.SparseAttention(vsa_cfg, head_dim=32, num_heads=h, backend="flex")
        module.params["gate_weight"].normal_()
        module.params["gate_bias"].fill_(0.5)
        gate = torch.einsum("bhnd,hd->bhn", q, module.params["gate_weight"]).unsqueeze(-1) + 0.5
        out = module(q, k, v, scale=scale)
        ref, _ = vsa_dense(*_f64(q, k, v), selection, scale, gate.double())
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


LLSA_CASES = [  # (N, block, topk per level, H, Hk): L = 1, 2, 3, odd lengths
    (1000, 16, (4,), 4, 2),
    (1500, 16, (4, 3), 2, 2),
    (1000, 8, (4, 2, 2), 2, 1),
]


@pytest.mark.parametrize("case", LLSA_CASES, ids=["L1-1000-gqa", "L2-1500", "L3-1000-b8-mqa"])
def test_llsa_forward_cpu(case):
    n, block, topk, h, hk = case
    q, k, v = _qkv(1, h, hk, n, n, 32, seed=1)
    cfg = Config.from_dict({"method": "llsa", "block_size": block, "topk": list(topk)})
    with torch.no_grad():
        out = flexsparse.attention(q, k, v, cfg, backend="flex")
        selection = llsa_topk(q, k, topk, block)
        ref, _ = llsa_dense(*_f64(q, k, v), selection, q.shape[-1] ** -0.5)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out, flexsparse.attention(q, k, v, cfg, backend="torch"), atol=2e-5, rtol=2e-5)


def test_cpu_flex_refuses_backward_and_lse_and_auto_falls_back():
    q, k, v = _qkv(1, 2, 2, 128, 128, 32)
    q.requires_grad_(True)
    cfg = {"method": "topk", "block_size": 64, "topk": 1}
    with pytest.raises(ValueError, match="no backward on CPU"):
        flexsparse.attention(q, k, v, cfg, backend="flex")
    selection = BlockSelection(torch.zeros(1, 2, 2, 1, dtype=torch.int32), 64, 64, 128, 128)
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        flex.block_sparse_attention(q, k, v, selection, 0.1)
    with pytest.raises(ValueError, match="no LSE"):
        flexsparse.attention(q.detach(), k, v, cfg, backend="flex", return_lse=True)
    cpu, topk = torch.device("cpu"), _without_triton("topk")
    assert backends.resolve("auto", topk, cpu, needs_grad=True).name == "torch"
    assert backends.resolve("auto", topk, cpu, needs_grad=False, needs_lse=True).name == "torch"
    assert backends.resolve("auto", topk, cpu, needs_grad=False, dtype=torch.float64).name == "torch"
    assert backends.resolve("auto", topk, cpu, needs_grad=False).name == "flex"
    out, lse = flexsparse.attention(q, k, v, cfg, return_lse=True)       # auto -> torch: trains on CPU
    (out.sum() + lse.sum()).backward()
    assert q.grad is not None


def test_cpu_flex_refuses_the_block_sizes_its_kernel_gets_wrong():
    """torch's C++ FlexAttention is wrong for KV blocks of 8 mod 16 tokens at head dim 8 or 16: flex says so,
    auto runs torch (which agrees with the reference)."""
    q, k, v = _qkv(1, 2, 2, 75, 75, 16)
    cfg = {"method": "topk", "block_q": 16, "block_k": 8, "topk": 3}
    with torch.no_grad(), pytest.raises(ValueError, match="wrong results for head dim 16 with blocks of \\[8\\]"):
        flexsparse.attention(q, k, v, cfg, backend="flex")
    cpu, topk = torch.device("cpu"), _without_triton("topk")
    assert backends.resolve("auto", topk, cpu, needs_grad=False, blocks=(16, 24), head_dim=8).name == "torch"
    assert backends.resolve("auto", topk, cpu, needs_grad=False, blocks=(16, 8), head_dim=32).name == "flex"
    with torch.no_grad():
        out = flexsparse.attention(q, k, v, cfg)
        selection = select_blocks(q, k, v, Config.from_dict(cfg), BACKENDS["torch"])
        ref, _ = block_sparse_dense(*_f64(q, k, v), selection, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- torch.compile of a DiT block

class DiTBlock(nn.Module):
    """Pre-norm attention + MLP block calling ``flexsparse.attention`` with a config dict."""

    def __init__(self, dim: int, heads: int, config: dict, backend: str):
        super().__init__()
        self.heads, self.config, self.backend = heads, config, backend
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = flexsparse.attention(q, k, v, self.config, backend=self.backend)
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


def _compile_and_step(block, inputs, *, train: bool, backend: str = "inductor"):
    """Compile with fullgraph=True and run every input (one optimizer step each when training).
    Any recompile fails (recompile_limit=1). Returns the compiled output and (when training) the
    parameter gradients of the first input."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cpu = inputs[0].device.type == "cpu"
    compiled = torch.compile(block, fullgraph=True, backend=backend, dynamic=False if cpu else None)
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    first, first_grads = None, None
    with torch._dynamo.config.patch(recompile_limit=1), torch.set_grad_enabled(train):
        for x in inputs:
            y = compiled(x)
            first = y.detach() if first is None else first
            if train:
                y.square().mean().backward()
                if first_grads is None:
                    first_grads = {name: p.grad.clone() for name, p in block.named_parameters()}
                opt.step()
                opt.zero_grad()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    return first, first_grads


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.exhaustive)])
def test_compile_dit_block_fullgraph_no_recompiles_cpu(backend):
    """One graph, no breaks, no recompiles over 5 steps with new masks. ``aot_eager`` checks the
    tracing quickly (FlexAttention then runs its eager path through the mask_mod); ``inductor``
    (slow on CPU, ~1 min) also compiles the C++ FlexAttention kernel inside the user's graph."""
    torch.manual_seed(0)
    block = DiTBlock(64, 2, {"method": "llsa", "block_size": 16, "topk": [4, 2]}, "flex").eval()
    inputs = [torch.randn(1, 1000, 64) for _ in range(5)]
    out, _ = _compile_and_step(block, inputs, train=False, backend=backend)
    block.backend = "torch"
    with torch.no_grad():
        torch.testing.assert_close(out, block(inputs[0]), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- GPU: forward + backward vs reference

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-3}        # relative L2 error of outputs (grads: 2x)
LSE_TOL = {torch.bfloat16: 5e-2, torch.float32: 1e-3}    # max abs error of the LSE


def _check_fwd_bwd(method_out, method_lse, ref_fn, q, k, v, dtype, record):
    """Compare flex output/LSE/grads with the fp64 reference ``ref_fn(q64, k64, v64) -> (o, lse)``; the errors
    go to ``record`` (pytest's ``record_property``), summed up at the end of the run (conftest)."""
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref, ref_lse = ref_fn(q64, k64, v64)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    method_out.backward(grad.to(dtype))
    errors = {"out rel L2": rel_err(method_out, ref)}
    if method_lse is not None:
        errors["lse max abs"] = (method_lse.double() - ref_lse).abs().max().item()
    errors.update({f"{name} rel L2": rel_err(x.grad, x64.grad) for name, x, x64 in (("dq", q, q64), ("dk", k, k64),
                                                                                   ("dv", v, v64))})
    record("errors", {"dtype": str(dtype).removeprefix("torch."), **errors})
    tol = TOL[dtype]
    for name, err in errors.items():
        assert err < (LSE_TOL[dtype] if name.startswith("lse") else tol if name.startswith("out") else 2 * tol), name


def _cuda_qkv(h, hk, n, d, dtype, seed=0):
    return [x.requires_grad_(True) for x in _qkv(2, h, hk, n, n, d, dtype, "cuda", seed)]


METHOD_CASES = {  # method -> (config, N): GQA 4 -> 2 heads, odd lengths
    "topk": ({"method": "topk", "block_size": 64, "topk": 5}, 1000),
    "vsa": ({"method": "vsa", "block_size": 64, "topk": 5}, 1000),
    "llsa": ({"method": "llsa", "block_size": 16, "topk": [4, 2]}, 1000),
}


def _reference_of(method, cfg, q, k, v, scale):
    """fp64 reference on the method's own selection on the flex backend (computed from the same inputs)."""
    selection = METHODS[method].select(q, k, v, cfg, BACKENDS["flex"], {})
    if method == "llsa":
        return lambda q64, k64, v64: llsa_dense(q64, k64, v64, selection.selection, scale)
    if method == "vsa":
        return lambda q64, k64, v64: vsa_dense(q64, k64, v64, selection.blocks, scale, None)
    return lambda q64, k64, v64: block_sparse_dense(q64, k64, v64, selection, scale)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("method", sorted(METHOD_CASES))
def test_gpu_forward_backward_vs_reference(method, head_dim, dtype, record_property):
    config, n = METHOD_CASES[method]
    cfg = Config.from_dict(config)
    q, k, v = _cuda_qkv(4, 2, n, head_dim, dtype)
    scale = head_dim ** -0.5
    out, lse = flexsparse.attention(q, k, v, cfg, backend="flex", return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    _check_fwd_bwd(out, lse, _reference_of(method, cfg, q.detach(), k.detach(), v.detach(), scale), q, k, v, dtype,
                   record_property)


@gpu
@pytest.mark.parametrize("blocks", [(16, 16), (32, 32), (64, 64), (128, 128), (128, 64), (64, 128), (32, 16)],
                         ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_block_sizes_bf16(blocks, head_dim, record_property):
    bq, bk = blocks
    cfg = Config.from_dict({"method": "topk", "block_q": bq, "block_k": bk, "topk": 3})
    q, k, v = _cuda_qkv(4, 2, 1000, head_dim, torch.bfloat16, seed=2)
    out, lse = flexsparse.attention(q, k, v, cfg, backend="flex", return_lse=True)
    ref_fn = _reference_of("topk", cfg, q.detach(), k.detach(), v.detach(), head_dim ** -0.5)
    _check_fwd_bwd(out, lse, ref_fn, q, k, v, torch.bfloat16, record_property)


@gpu
@pytest.mark.parametrize("blocks", [(128, 128), (128, 64), (64, 128)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_gpu_long_sequence_large_blocks_compile_and_match_triton(blocks):
    """At N = 65536 the 128 x 128 forward tile ran out of shared memory on Hopper (short sequences compiled). Both
    backends attend the flex backend's selection (the triton backend selects with its own kernels, whose fp32
    scores may break a near-tie the other way)."""
    cfg = Config.from_dict({"method": "topk", "block_q": blocks[0], "block_k": blocks[1], "topk": 4})
    q, k, v = _qkv(1, 2, 2, 65536, 65536, 64, torch.bfloat16, "cuda", 5)
    method = METHODS["topk"]
    selection = method.select(q, k, v, cfg, BACKENDS["flex"], {})
    grad = torch.randn_like(q)
    results = []
    for backend in ("flex", "triton"):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        if backend == "flex":
            out = flexsparse.attention(*leaves, cfg, backend=backend)
        else:
            chosen = BACKENDS[backend]
            inputs = chosen.prepare_inputs(*leaves, keep_views=method.keeps_views, needs_grad=True)
            out, _ = chosen.attend(method, *inputs, selection, cfg, scale=64 ** -0.5, params={}, need_lse=False)
        results.append([out, *torch.autograd.grad(out, leaves, grad)])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        assert rel_err(got, want) < 1e-2, name


@gpu
@pytest.mark.parametrize("case", [(1000, (8,)), (4097, (8, 4)), (5000, (8, 4, 2))], ids=["L1", "L2", "L3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_llsa_levels(case, dtype, record_property):
    n, topk = case
    cfg = Config.from_dict({"method": "llsa", "block_size": 16, "topk": list(topk)})
    q, k, v = _cuda_qkv(4, 1, n, 64, dtype, seed=3)
    selection = BACKENDS["flex"].llsa_select(q.detach(), k.detach(), v.detach(), 16, topk).selection
    out, lse = flexsparse.attention(q, k, v, cfg, backend="flex", return_lse=True)
    _check_fwd_bwd(out, lse, lambda a, b, c: llsa_dense(a, b, c, selection, 0.125), q, k, v, dtype, record_property)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_llsa_chunk_over_fetched_blocks(dtype, record_property):
    """A ring rank's LLSA step on flex: a chunk of query blocks over its fetched fine blocks (a level 0 shorter than
    the sequence) and the whole pyramid, the short last query block among them, against the fp64 gather form."""
    n, b, topk, scale = 4097, 16, (8, 4), 0.125
    q, k, v = (x.detach() for x in _cuda_qkv(4, 2, n, 64, dtype, seed=5))
    k_levels, v_levels = pool_pyramid(k, b, 2), pool_pyramid(v, b, 2)
    selection = llsa_topk(q, k, topk, b)
    rows = torch.arange(200, 257, device="cuda")          # the last query blocks, the short one among them
    (k_c, v_c), position = chunk_fine_blocks(k, v, selection, rows, b)
    layout = ring_llsa_layout(n, b, 2, k_c.shape[2])
    ids = llsa_block_ids(selection, layout, rows, position)
    q_c, k_c, v_c = (x.clone().requires_grad_() for x in (q[:, :, 200 * b:], k_c, v_c))
    out, lse = BACKENDS["flex"].llsa_extended_softmax(q_c, [k_c, *k_levels], [v_c, *v_levels], ids, layout, scale)

    def reference(q64, k64, v64):
        return llsa_naive.extended_attention(q64, [k64, *(x.double() for x in k_levels)],
                                             [v64, *(x.double() for x in v_levels)], ids, layout, scale)
    _check_fwd_bwd(out, lse, reference, q_c, k_c, v_c, dtype, record_property)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_forward_tiles_divide_the_blocks_and_keep_key_tiles_at_most_64(dtype, head_dim):
    """Kernel tiles must divide the sparse blocks; a 128-key tile (torch 2.11's own sm90 default at D=64) ran out of
    shared memory on Hopper at long sequences."""
    for bq in (16, 32, 64, 128, 256, 48):
        for bk in (16, 32, 64, 128, 256, 80):
            options = flex.tile_options(bq, bk, dtype, head_dim)
            assert bq % options["fwd_BLOCK_M"] == 0 and bk % options["fwd_BLOCK_N"] == 0
            assert 16 <= options["fwd_BLOCK_N"] <= 64 and 16 <= options["fwd_BLOCK_M"] <= 128


def test_cuda_calls_take_static_graphs_for_the_first_variants_then_dynamic(monkeypatch):
    monkeypatch.setattr(flex.FLEX_ATTENTION, "budget", 2)
    monkeypatch.setattr(flex.FLEX_ATTENTION, "seen", set())
    picks = [flex.FLEX_ATTENTION.pick(key) for key in ("a", "b", "c", "a", None, "d", "b")]
    static, dynamic = flex.FLEX_ATTENTION.static, flex.FLEX_ATTENTION.dynamic
    assert picks == [static, static, dynamic, static, static, dynamic, static]


def test_variant_key_ignores_the_selection_and_sees_the_shape():
    """A training step's new selection is the same variant (the static budget is not spent per step); another
    length is another one."""
    keys = []
    for n, seed in ((512, 0), (512, 1), (576, 0)):
        q, k, v = _qkv(1, 2, 2, n, n, 16)
        tiles = n // 64
        mask = block_selection_to_block_mask(BlockSelection(_random_ids(1, 2, tiles, tiles, 2, seed), 64, 64, n, n))
        keys.append(flex._variant_key(q, k, v, mask, None, {"fwd_BLOCK_M": 64}))
    assert keys[0] == keys[1] and keys[0] != keys[2]


@gpu
def test_gpu_static_graphs_per_shape_then_dynamic(monkeypatch):
    """With a budget of 2 static variants: two lengths on static graphs, the next two on dynamic-shape graphs
    (no recompile-limit error), a length seen before on its static graph again; every output as the torch
    backend's."""
    monkeypatch.setattr(flex.FLEX_ATTENTION, "budget", 2)
    monkeypatch.setattr(flex.FLEX_ATTENTION, "seen", set())
    picked, pick = [], flex.FLEX_ATTENTION.pick
    monkeypatch.setattr(flex.FLEX_ATTENTION, "pick", lambda key: picked.append(pick(key)) or picked[-1])
    cfg = {"method": "topk", "block_size": 64, "topk": 4}
    for seed, n in enumerate((1024, 2048, 3072, 4096, 2048)):
        q, k, v = _cuda_qkv(4, 2, n, 64, torch.bfloat16, seed=seed)
        with torch.no_grad():
            got = flexsparse.attention(q, k, v, cfg, backend="flex")
            want = flexsparse.attention(q.float(), k.float(), v.float(), cfg, backend="torch")
        assert rel_err(got, want) < 2e-2, n
    static, dynamic = flex.FLEX_ATTENTION.static, flex.FLEX_ATTENTION.dynamic
    assert picked == [static, static, dynamic, dynamic, static]


@gpu
def test_gpu_auto_picks_flex_for_training():
    chosen = backends.resolve("auto", _without_triton("topk"), torch.device("cuda"), needs_grad=True,
                              needs_lse=True, dtype=torch.bfloat16, blocks=(64, 64))
    assert chosen.name == "flex"


@gpu
@pytest.mark.parametrize("config", [{"method": "topk", "block_size": 64, "topk": 4},
                                    {"method": "llsa", "block_size": 16, "topk": [4, 2]}], ids=["topk", "llsa"])
def test_gpu_compile_dit_block_training_no_recompiles(config):
    """fullgraph compile of fwd+bwd, 5 optimizer steps with new masks, one graph; the first step's
    output and parameter gradients match the uncompiled torch backend."""
    torch.manual_seed(0)
    block = DiTBlock(256, 4, config, "flex").cuda().to(torch.bfloat16)
    inputs = [torch.randn(2, 2000, 256, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    reference = DiTBlock(256, 4, config, "torch").cuda().to(torch.bfloat16)
    reference.load_state_dict(block.state_dict())
    out, grads = _compile_and_step(block, inputs, train=True)
    want = reference(inputs[0])
    want.square().mean().backward()
    assert rel_err(out, want.detach()) < 2e-2
    for name, p in reference.named_parameters():
        assert rel_err(grads[name], p.grad) < 5e-2, name


SLA_CASES = [({"method": "sla", "block_size": 64, "topk_ratio": 0.3, "linear": "masked"}, 1000),
             ({"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.3}, 1000)]


def _perturbed_module(config, backend, head_dim, heads, n, device):
    module = flexsparse.SparseAttention(config, head_dim=head_dim, num_heads=heads, seq_len=n, backend=backend)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return module.to(device)


@pytest.mark.parametrize("config, n", SLA_CASES, ids=["sla", "sla2"])
def test_sla_methods_flex_forward_matches_torch_cpu(config, n):
    q, k, v = _qkv(1, 4, 2, n, n, 32, torch.float32, "cpu", 3)
    flex_out = _perturbed_module(config, "flex", 32, 4, n, "cpu")
    torch_out = _perturbed_module(config, "torch", 32, 4, n, "cpu")
    with torch.no_grad():
        assert rel_err(flex_out(q, k, v), torch_out(q, k, v)) < 1e-5


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("config, n", SLA_CASES, ids=["sla", "sla2"])
def test_gpu_sla_methods_flex_vs_reference(config, n, dtype):
    """Sparse branch on flex, linear branch and mixing in PyTorch: output, LSE and gradients of q, k,
    v and of the learnable parameters against the fp64 reference with the same parameters."""
    q, k, v = _cuda_qkv(4, 2, n, 64, dtype, seed=4)
    module = _perturbed_module(config, "flex", 64, 4, n, "cuda")
    reference = _perturbed_module(config, "reference", 64, 4, n, "cuda").double()
    out, lse = module(q, k, v, return_lse=True)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, return_lse=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out.backward(grad.to(dtype))
    tol = TOL[dtype]
    assert rel_err(out, ref) < tol
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL[dtype]
    for x, x64 in ((q, q64), (k, k64), (v, v64)):
        assert rel_err(x.grad, x64.grad) < 2 * tol
    for (name, p), p64 in zip(module.named_parameters(), reference.parameters()):
        if p64.grad is None:   # the hard SLA2 router is not trained by the attention loss
            assert p.grad is None, name
        else:
            assert rel_err(p.grad, p64.grad) < 2 * tol, name
