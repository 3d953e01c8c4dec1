"""The ``triton`` backend of the block-sparse branch (``topk``, ``vsa``, ``sla``, ``sla2``).

CPU (CI): the kernels run through the Triton interpreter in fp32 on tiny shapes against
the torch backend's ``sparse_softmax`` and the dense reference on identical selections (O, LSE, dQ/dK/dV
with a gradient through the LSE; block_q != block_k, ragged N, Nq != Nk, GQA, head dims that are not a
power of two, K = 1 and K = all blocks, split tiles), the block CSC, determinism and the methods end to
end. They run in a child pytest started with ``TRITON_INTERPRET=1`` (see ``triton_support``). The parent
process checks the torch fallback (interpreter off), opcheck and ``backend="auto"``.
GPU (``pytest -m gpu``): bf16 at N = 4096 and ~16K against the torch and flex backends and the dense
reference, the methods, ``torch.compile(fullgraph=True)`` without recompiles, determinism, opcheck.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import triton_support as ts

pytest.importorskip("triton")

import flexsparse  # noqa: E402
from flexsparse import backends  # noqa: E402
from flexsparse.backends import BACKENDS  # noqa: E402
from flexsparse.config import Config  # noqa: E402
from flexsparse.masks import csr_to_csc  # noqa: E402
from flexsparse.methods import METHODS  # noqa: E402
from flexsparse.methods.dense import block_sparse_dense  # noqa: E402
from flexsparse.triton.block_sparse import op as block_op  # noqa: E402

from _sla_testing import leaf_params, run  # noqa: E402

cpu_only = pytest.mark.skipif(not ts.INTERPRETED or ts.HAS_CUDA,
                              reason="interpreter test: runs in the child process of test_interpreter_suite")
cpu_parent = pytest.mark.skipif(ts.INTERPRETED or ts.HAS_CUDA, reason="CPU test of the parent process")


def gpu(test):
    """``pytest -m gpu`` tests, skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not ts.HAS_CUDA, reason="needs a CUDA GPU")(test))


random_selection, make_qkv = ts.random_selection, ts.make_qkv
# the block-sparse branch of each backend on a given selection: ``(q, k, v, selection, scale) -> (o, lse)``
triton_branch, torch_branch, flex_branch = (BACKENDS[name].sparse_softmax for name in ("triton", "torch", "flex"))


test_interpreter_suite, test_interpreter_suite_exhaustive = ts.interpreter_suites(__file__)


@cpu_parent
def test_without_gluon_the_triton_kernels_serve():
    """A triton whose Gluon lacks what the sm_90 kernels use: the package imports, warns, and
    ``block_sparse.fwd`` / ``block_sparse.bwd`` have their Gluon paths off (the Triton kernels serve every call)."""
    code = ("import sys, warnings\n"
            "sys.modules['triton.experimental.gluon'] = None\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    from flexsparse.triton.block_sparse import bwd, fwd\n"
            "assert fwd.block_fwd_ws is None and bwd.block_bwd_ws is None\n"
            "assert any('Gluon kernels are unavailable' in str(w.message) for w in caught)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ts.ROOT)


def grad_run(fn, q, k, v, selection, scale, terms=("o", "lse"), **kw):
    """o, lse, dq, dk, dv of a random loss of the outputs ``terms`` (the LSE term checks dLSE in the backward)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = fn(*leaves, selection, scale, **kw)
    gen = torch.Generator().manual_seed(0)
    w_o = torch.randn(o.shape, generator=gen).to(o.device)
    w_lse = torch.randn(lse.shape, generator=gen).to(lse.device)
    loss = {"o": (o.float() * w_o).sum(), "lse": (lse.float() * w_lse).sum()}
    sum(loss[term] for term in terms).backward()
    return [o, lse] + [x.grad for x in leaves]


NAMES = ("o", "lse", "dq", "dk", "dv")

# (B, Nq, Nk, block_q, block_k, H, Hk, D, K). CPU tiles are 16 x 16, so 32/64 blocks split into several tiles.
CASES = [
    (2, 64, 64, 16, 16, 1, 1, 16, 2),      # even: no masks; batch offsets
    (1, 37, 37, 16, 16, 2, 1, 16, 2),      # odd N, GQA
    (1, 70, 70, 32, 16, 2, 2, 24, 3),      # block_q != block_k, split query tiles, D not a power of two
    (1, 45, 77, 16, 32, 4, 2, 16, 2),      # Nq != Nk, split key tiles, GQA 2
    (1, 50, 50, 24, 8, 1, 1, 16, 4),       # blocks that are no multiple of the tile, block_k < tile
    (1, 40, 40, 16, 16, 2, 1, 32, 3),      # K = every key block
    (2, 33, 33, 16, 16, 1, 1, 16, 1),      # K = 1
    (1, 1, 1, 16, 16, 1, 1, 16, 1),        # one token
    (1, 128, 128, 64, 64, 1, 1, 16, 1),    # 4 x 4 tiles per block pair
]

# ----------------------------------------------------------------------------------------------- CPU


@cpu_only
@pytest.mark.parametrize("bsz,nq,nk,block_q,block_k,heads,kv_heads,d,topk", CASES)
def test_matches_torch_backend_and_reference(bsz, nq, nk, block_q, block_k, heads, kv_heads, d, topk):
    """Identical selection: O, LSE and gradients against the torch backend and the dense fp64 reference."""
    q, k, v = make_qkv(bsz, heads, kv_heads, nq, nk, d)
    selection = random_selection(bsz, heads, nq, nk, block_q, block_k, topk)
    got = grad_run(triton_branch, q, k, v, selection, d**-0.5)
    want = grad_run(torch_branch, q, k, v, selection, d**-0.5)
    ref = grad_run(block_sparse_dense, q.double(), k.double(), v.double(), selection, d**-0.5)
    for name, a, b, c in zip(NAMES, got, want, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert ts.rel_err(a, b) < 1e-5, name
        assert ts.rel_err(a, c) < 1e-5, name


@cpu_only
@pytest.mark.parametrize("terms", [("o",), ("lse",)])
def test_gradients_of_one_output(terms):
    """A loss of the output alone (the op gets no LSE gradient: none is zero-filled) or of the LSE alone (a zero
    output gradient): the gradients of the torch branch."""
    q, k, v = make_qkv(1, 2, 1, 70, 70, 16)
    selection = random_selection(1, 2, 70, 70, 16, 16, 2)
    got = grad_run(triton_branch, q, k, v, selection, 0.25, terms)
    want = grad_run(torch_branch, q, k, v, selection, 0.25, terms)
    for name, a, b in zip(NAMES, got, want):
        if b is None:                                   # the LSE does not depend on v
            assert a is None or not a.any(), name
        else:
            assert ts.rel_err(a, b) < 1e-5, name


TILE_OVERRIDES = {
    "unsplit 32-row tiles": ('{"block_fwd": {"BM": 32, "BN": 32, "stages": 2}, '
                             '"block_bwd": {"DQ_BM": 32, "DQ_BN": 32, "DKV_BN": 32, "DKV_BM": 32}}', 32, 32, 2),
    "blocks side by side": ('{"block_fwd": {"KB": 2}, "block_bwd": {"DQ_KB": 2, "DKV_QB": 4}}', 16, 8, 3),
}


@cpu_only
@pytest.mark.parametrize("name", list(TILE_OVERRIDES))
def test_tile_overrides(name, monkeypatch):
    """Other tile choices through ``FLEXSPARSE_TRITON_TILES``: unsplit 32-row tiles, and several small
    blocks per step (an odd K, so the last step is half empty)."""
    tiles, block_q, block_k, topk = TILE_OVERRIDES[name]
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", tiles)
    q, k, v = make_qkv(1, 2, 1, 90, 90, 16)
    selection = random_selection(1, 2, 90, 90, block_q, block_k, topk)
    got = grad_run(triton_branch, q, k, v, selection, 0.3)
    want = grad_run(torch_branch, q, k, v, selection, 0.3)
    for name, a, b in zip(NAMES, got, want):
        assert ts.rel_err(a, b) < 1e-5, name


@cpu_only
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("one_kernel", [True, False])
def test_block_csc_is_transpose(deterministic, one_kernel, monkeypatch):
    """Both paths: the one small-table kernel (lists ascending either way) and the count-scan-scatter or sort."""
    from flexsparse.triton.common import csc
    from flexsparse.triton.common.csc import block_csc
    if not one_kernel:
        monkeypatch.setattr(csc, "_SMALL_WORK", 0)
    tk = 7
    selection = random_selection(2, 3, 100, 7 * 16, 8, 16, 3)
    offsets, rows = block_csc(selection.indices.contiguous(), tk, deterministic)
    dense = torch.zeros(2, 3, selection.num_q_blocks, tk, dtype=torch.bool)
    dense.scatter_(-1, selection.indices.long(), True)
    assert offsets.shape == (2, 3, tk + 1) and rows.shape == (2, 3, selection.num_q_blocks * 3)
    for b in range(2):
        for h in range(3):
            for key in range(tk):
                members = rows[b, h, offsets[b, h, key]:offsets[b, h, key + 1]].long()
                assert torch.equal(members.sort().values, dense[b, h, :, key].nonzero().flatten())
    if deterministic or one_kernel:
        want = csr_to_csc(selection.indices, tk)
        assert torch.equal(offsets, want.offsets) and torch.equal(rows, want.rows)


@cpu_only
@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_gradients_do_not_depend_on_program_order(deterministic, monkeypatch):
    """The CSC of a large table (``_SMALL_WORK`` 0, 8 entries per scatter program) built with atomic slots orders
    each key block's list as the scatter's programs ran, and dK/dV sum in that order. Deterministic mode sorts
    instead: the same bits with the programs run last to first. Without it the bits change (the comparison sees
    the order)."""
    from flexsparse.triton.common import csc
    monkeypatch.setattr(csc, "_SMALL_WORK", 0)
    monkeypatch.setattr(csc, "_BE", 8)
    q, k, v = make_qkv(1, 2, 1, 80, 80, 16)
    selection = random_selection(1, 2, 80, 80, 8, 8, 4)
    in_order = grad_run(triton_branch, q, k, v, selection, 0.25, deterministic=deterministic)
    with ts.programs_reversed():
        reversed_order = grad_run(triton_branch, q, k, v, selection, 0.25, deterministic=deterministic)
    same = {name: torch.equal(a, b) for name, a, b in zip(NAMES, in_order, reversed_order)}
    if deterministic:
        assert all(same.values()), same
    else:
        assert not (same["dk"] and same["dv"]), same


# the CPU cases of a method: its registry example on small blocks (16-token query blocks, 8-token key blocks, K = 3 or
# 30% of the key blocks), changed as listed here where a method has options to exercise
VARIANTS = {
    "vsa": [{"block_size": 16, "topk": 2}],
    "sla": [{"negligible_ratio": 0.2}, {"block_size": 16, "topk_ratio": 0.4, "linear": "full", "feature_map": "elu"}],
    "sla2": [{"block_q": 32, "block_k": 16, "deterministic": True}],
}


def _method_configs():
    """Every block-sparse method of the registry on ``backend="triton"``, in the cases of ``VARIANTS``."""
    return [ts.example_config(name, **ts.merged({"block_q": 16, "block_k": 8, "topk": 3, "topk_ratio": 0.3}, variant))
            for name in ts.triton_methods("block") for variant in VARIANTS.get(name, [{}])]


def _method_params(cfg: dict, d: int, heads: int, n: int, device="cpu") -> dict:
    """The method's learned parameters (none for ``topk``, ``llsa`` and ``vsa`` without its gate) plus noise: fp32
    leaves on ``device``."""
    config = Config.from_dict(cfg)
    params = leaf_params(METHODS[config.method].init_params(config, d, heads, n), torch.float32)
    return {name: p.detach().to(device).requires_grad_() for name, p in params.items()}


@cpu_only
@pytest.mark.parametrize("cfg", _method_configs(), ids=lambda c: f"{c['method']}-{c.get('linear', '')}")
def test_methods_match_reference(cfg):
    """``flexsparse.attention(..., backend="triton")``: output, LSE and the gradients of q, k, v and of the
    method's parameters against the dense reference, on the same fp32 inputs, on which the Triton selection kernels
    (interpreted) select as the reference backend's PyTorch selection (``ts.draw_selecting_alike``)."""
    n, d, heads, kv_heads = 75, 16, 2, 1
    params = _method_params(cfg, d, heads, n)
    leaves = [x.requires_grad_() for x in ts.draw_selecting_alike(lambda: make_qkv(1, heads, kv_heads, n, n, d), cfg,
                                                                  params, ("triton", "reference"))]
    got = run(*leaves, cfg, params, "triton")
    want = run(*leaves, cfg, params, "reference")
    ts.assert_runs_near(got, want, 1e-5, 1e-4, lse=ts.rel_err)


@cpu_parent
def test_dkv_program_order_is_head_major_longest_first():
    from flexsparse.triton.block_sparse.bwd import longest_first
    selection = random_selection(2, 4, 300, 300, 16, 16, 5)
    selection.indices[:, :, :, 0] = 3                                   # key block 3: picked by every row
    offsets = csr_to_csc(selection.indices.sort(-1).values, 19).offsets
    for kv_heads in (2, 4):                                             # GQA, and one query head per KV head
        order = longest_first(offsets, kv_heads)
        assert order.dtype == torch.int32
        order, rows = order.long(), 2 * kv_heads
        assert torch.equal(order.sort().values, torch.arange(rows * 19))
        work = (offsets[:, :, 1:] - offsets[:, :, :-1]).view(2, kv_heads, 4 // kv_heads, 19).sum(2).flatten()
        assert torch.equal(order // 19, torch.arange(rows).repeat_interleave(19))
        assert (order % 19).view(rows, 19)[:, 0].eq(3).all()
        assert (work[order].view(rows, 19).diff(dim=1) <= 0).all()


@cpu_parent
def test_dkv_program_order_is_the_identity_for_small_calls():
    """Below SORTED_FROM_ENTRIES CSC entries the order is the identity (kept: the next eager call runs no op);
    from there, off a GPU, longest first."""
    from flexsparse.triton.block_sparse.bwd import SORTED_FROM_ENTRIES, longest_first, program_order
    selection = random_selection(2, 4, 300, 300, 16, 16, 5)
    selection.indices[:, :, :, 0] = 3                                   # key block 3 first: not the identity
    offsets = csr_to_csc(selection.indices.sort(-1).values, 19).offsets
    items = 2 * 2 * 19
    identity = program_order(offsets, 2, 1, SORTED_FROM_ENTRIES - 1)
    assert torch.equal(identity, torch.arange(items, dtype=torch.int32))
    assert program_order(offsets, 2, 4, SORTED_FROM_ENTRIES - 1) is identity
    sorted_order = longest_first(offsets, 2)
    assert not torch.equal(sorted_order, identity)
    assert torch.equal(program_order(offsets, 2, 1, SORTED_FROM_ENTRIES), sorted_order)


@gpu
def test_gpu_dkv_program_order_is_the_identity_only_where_the_grid_fits_the_sms():
    """In a large call (SORTED_FROM_ENTRIES entries), where every dK/dV program runs at once the order cannot matter
    and is the identity (kept for eager calls); else longest first, and always longest first in a graph traced for
    any length (no guard on the length). A small call takes the identity however many waves its grid takes."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from flexsparse.triton.block_sparse.bwd import SORTED_FROM_ENTRIES, longest_first, program_order, sm_count
    selection = random_selection(2, 4, 300, 300, 16, 16, 5)
    selection.indices[:, :, :, 0] = 3                                   # key block 3 first: not the identity
    offsets = csr_to_csc(selection.indices.sort(-1).values, 19).offsets.cuda()
    items, large = 2 * 2 * 19, SORTED_FROM_ENTRIES
    fits = sm_count(offsets.device) // items
    identity = program_order(offsets, 2, fits, large)
    assert torch.equal(identity, torch.arange(items).int().cuda())
    assert program_order(offsets, 2, fits, large) is identity          # kept: the next eager call runs no op
    sorted_order = longest_first(offsets, 2)
    assert not torch.equal(sorted_order, torch.arange(items).int().cuda())
    assert torch.equal(program_order(offsets, 2, fits + 1, large), sorted_order)
    assert program_order(offsets, 2, fits + 1, large - 1) is identity
    traced = make_fx(lambda offsets: program_order(offsets, 2, fits, large - 1), tracing_mode="symbolic")(offsets)
    assert torch.equal(traced(offsets), sorted_order)


@gpu
def test_gpu_identity_order_is_built_not_kept_inside_a_cuda_graph_capture():
    """The identity order asked for first inside a capture is built there and not kept (the capture only records
    its fill); an eager call keeps its own, which later captures read."""
    from flexsparse.triton.block_sparse.bwd import identity_order
    like = torch.empty(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = identity_order(77, like)                             # a size no other test asks for
    graph.replay()
    eager = identity_order(77, like)
    assert captured is not eager and torch.equal(captured, torch.arange(77).int().cuda())
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert identity_order(77, like) is eager


@cpu_parent
def test_gluon_forward_kernels_compile_for_sm90():
    """The Gluon forward kernels, plain and with the linear branch mixed in, compile for sm_90 without a GPU
    (``benchmarks/gluon_sm90_report.py``): what their jitted code calls (a cached host helper cannot be) fails
    only when they compile."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join(ts.ROOT, "benchmarks", "gluon_sm90_report.py"), "--d", "64"],
                          capture_output=True, text=True, cwd=ts.ROOT, env=dict(env, PYTHONPATH=ts.ROOT), timeout=600)
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_sass_loop_mixes_count_each_loop_body_and_skip_retry_paths():
    """``benchmarks/triton_sm90_report.py --loops``: a predicated branch back is a loop, counted from its target to
    the branch by opcode; a retry path after the kernel's end that branches back (its span holds the EXIT) is not."""
    sys.path.insert(0, os.path.join(ts.ROOT, "benchmarks"))
    try:
        from triton_sm90_report import loop_mixes
    finally:
        sys.path.pop(0)
    listing = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x0000 */
        /*0010*/                   FADD R2, R2, R3 ;                      /* 0x0000 */
        /*0020*/                   MUFU.EX2 R4, R2 ;                      /* 0x0000 */
        /*0030*/                   FADD R5, R4, R2 ;                      /* 0x0000 */
        /*0040*/              @P0 BRA 0x10 ;                              /* 0x0000 */
        /*0050*/                   EXIT ;                                 /* 0x0000 */
        /*0060*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4] ;  /* 0x0000 */
        /*0070*/                   BRA 0x20 ;                             /* 0x0000 */
    """
    loops = loop_mixes(listing, least=1)
    assert [(start, end) for start, end, _ in loops] == [(0x10, 0x40)]
    assert dict(loops[0][2]) == {"FADD": 2, "MUFU.EX2": 1, "BRA": 1}
    assert loop_mixes(listing, least=5) == []


@cpu_parent
def test_dkv_blocks_repeat_each_row_per_query_tile():
    """The dK/dV kernel's index table: each block of several tiles becomes one row per tile, ragged tail cut."""
    from flexsparse.triton.block_sparse.bwd import dkv_blocks
    indices = torch.randint(0, 9, (2, 3, 3, 4), dtype=torch.int32)
    per_tile, block = dkv_blocks(indices, 32, 70, 16)              # 3 blocks of 32 rows, 70 tokens: 5 tiles of 16
    assert block == 16 and per_tile.shape == (2, 3, 5, 4) and per_tile.is_contiguous()
    assert torch.equal(per_tile, indices[:, :, [0, 0, 1, 1, 2]])
    for block_q, tile in ((16, 16), (16, 64), (48, 32)):           # one tile per block, or blocks of partial tiles
        same, block = dkv_blocks(indices, block_q, 70, tile)
        assert same is indices and block == block_q


@cpu_parent
def test_cpu_fallback_without_interpreter():
    """Without the interpreter the op bodies run the torch backend and its written-out backward."""
    q, k, v = make_qkv(1, 4, 2, 70, 61, 16)
    selection = random_selection(1, 4, 70, 61, 16, 8, 3)
    with ts.interpreter_env(False):
        got = grad_run(triton_branch, q, k, v, selection, 0.25)
    want = grad_run(torch_branch, q, k, v, selection, 0.25)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@cpu_parent
@pytest.mark.parametrize("method", ts.triton_methods("block"))
def test_cpu_fallback_of_methods(method):
    cfg = ts.example_config(method, block_size=16, topk=2, topk_ratio=0.3)
    q, k, v = make_qkv(1, 2, 2, 70, 70, 16)
    params = _method_params(cfg, 16, 2, 70)
    with ts.interpreter_env(False), ts.triton_ops_on_cpu():
        got = run(*[x.clone().requires_grad_() for x in (q, k, v)], cfg, params, "triton")
    want = run(*[x.clone().requires_grad_() for x in (q, k, v)], cfg, params, "torch")
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b)


@cpu_parent
def test_opcheck_cpu_fallback():
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16)
    selection = random_selection(1, 2, 40, 40, 16, 16, 2)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), selection.indices, 16, 16, 0.25, False)
    with ts.interpreter_env(False):
        torch.library.opcheck(block_op.block_attn.op, args)


@cpu_parent
def test_selection_that_does_not_fit_raises():
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16)
    selection = random_selection(1, 2, 48, 40, 16, 16, 2)
    with pytest.raises(ValueError, match="selection does not fit"):
        triton_branch(q, k, v, selection, 0.25)


@cpu_parent
@pytest.mark.parametrize("name", ts.triton_methods())
def test_auto_picks_triton_only_where_it_runs(name):
    method, cpu = METHODS[name], torch.device("cpu")
    with ts.interpreter_env(False):
        assert backends.resolve("auto", method, cpu, needs_grad=True).name == "torch"
        assert backends.resolve("auto", method, cpu, needs_grad=False).name == "flex"
    with ts.interpreter_env(True):
        assert backends.resolve("auto", method, cpu, needs_grad=True).name == "triton"


# ----------------------------------------------------------------------------------------------- GPU


def _gpu_case(n, heads, kv_heads, d, block_q, block_k, topk, dtype=torch.bfloat16):
    torch.manual_seed(0)
    q, k, v = make_qkv(1, heads, kv_heads, n, n, d, dtype, "cuda")
    return (q, k, v), random_selection(1, heads, n, n, block_q, block_k, topk, "cuda")


@gpu
@pytest.mark.parametrize("n,heads,kv_heads,d,block_q,block_k,topk,dtype", [
    (4096, 4, 2, 64, 64, 64, 8, torch.bfloat16), (4096, 2, 2, 128, 128, 64, 5, torch.bfloat16),
    (4000, 4, 1, 64, 64, 32, 12, torch.bfloat16), (16384, 4, 2, 64, 64, 64, 13, torch.bfloat16),
    (16000, 2, 2, 128, 64, 64, 13, torch.bfloat16), (4133, 2, 1, 96, 32, 128, 4, torch.bfloat16),
    (3000, 2, 1, 128, 64, 64, 6, torch.float32), (3000, 4, 2, 64, 64, 64, 6, torch.float16)])
def test_gpu_matches_torch_flex_and_reference(n, heads, kv_heads, d, block_q, block_k, topk, dtype):
    """bf16/fp16/fp32 kernels against the torch backend in fp32 on the same values, flex in the same dtype,
    and (N <= 4096) the dense fp64 reference."""
    (q, k, v), selection = _gpu_case(n, heads, kv_heads, d, block_q, block_k, topk, dtype)
    scale = d**-0.5
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    got = grad_run(triton_branch, q, k, v, selection, scale)
    want = grad_run(torch_branch, q.float(), k.float(), v.float(), selection, scale)
    for name, a, b in zip(NAMES, got, want):
        assert ts.rel_err(a, b) < tol, f"torch {name}"
    if d & (d - 1) == 0:  # flex wants power-of-two head dims
        other = grad_run(flex_branch, q, k, v, selection, scale)
        for name, a, b in zip(NAMES, got, other):
            assert ts.rel_err(a, b) < 3e-2, f"flex {name}"
    if n <= 4096:
        ref = grad_run(block_sparse_dense, q.double(), k.double(), v.double(), selection, scale)
        for name, a, b in zip(NAMES, got, ref):
            assert ts.rel_err(a, b) < tol, f"reference {name}"


@gpu
@pytest.mark.parametrize("cfg", ts.GPU_METHODS, ids=lambda c: c["method"])
def test_gpu_methods_match_torch_backend(cfg):
    """bf16 on ``backend="triton"`` against fp32 on ``backend="torch"``, on inputs where the two backends' selections
    (Triton kernels, PyTorch) agree (``ts.draw_selecting_alike``)."""
    n, d, heads = 4096, 64, 4
    params = _method_params(cfg, d, heads, n, "cuda")
    q, k, v = ts.draw_selecting_alike(lambda: make_qkv(1, heads, 2, n, n, d, torch.bfloat16, "cuda"), cfg, params,
                                      ("triton", ("torch", lambda *x: [t.float() for t in x])))
    got = run(*[x.clone().requires_grad_() for x in (q, k, v)], cfg, params, "triton")
    want = run(*[x.float().requires_grad_() for x in (q, k, v)], cfg, params, "torch")
    assert ts.rel_err(got[0], want[0]) < 2e-2
    assert ts.rel_err(got[1], want[1]) < 2e-2
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        assert (a is None) == (b is None), i                # no gradient dropped by either backend
        if a is not None:
            assert ts.rel_err(a, b) < 3e-2, i


@gpu
@pytest.mark.parametrize("cfg", [c for c in ts.GPU_METHODS if c["method"] != "vsa"], ids=lambda c: c["method"])
def test_gpu_compiled_training_no_recompiles(cfg):
    """fullgraph compile of forward + backward, 3 steps with new inputs (new selections): one graph, no
    breaks, no recompiles; matches eager."""
    n, d, heads = 4096, 64, 4
    params = _method_params(cfg, d, heads, n, "cuda")
    config = Config.from_dict(cfg)

    def step(q, k, v):
        o, lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True, params=params)
        return o.float().square().sum() + lse.sum()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(3):
            leaves = [x.requires_grad_() for x in make_qkv(1, heads, 2, n, n, d, torch.bfloat16, "cuda")]
            compiled(*leaves).backward()
            eager = [x.detach().clone().requires_grad_() for x in leaves]
            step(*eager).backward()
            for a, b in zip(leaves, eager):
                assert ts.rel_err(a.grad, b.grad) < 2e-2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def _fixes_length(cfg: dict) -> bool:
    """Whether the method's parameters are sized by the sequence length (SLA2's alpha per query block)."""
    config = Config.from_dict(cfg)
    try:
        METHODS[config.method].init_params(config, 64, 4, None)
    except ValueError:
        return True
    return False


@gpu
@pytest.mark.long
@pytest.mark.parametrize("cfg", [c for c in ts.GPU_METHODS + [ts.example_config(m) for m in ts.triton_methods("llsa")]
                                 if not _fixes_length(c)], ids=lambda c: c["method"])
def test_gpu_compiled_over_sequence_lengths(cfg):
    """A model that sees several resolutions: ``torch.compile(fullgraph=True)`` at three lengths (a ragged one;
    dynamo makes the length symbolic from the second), forward and backward against the same module run eagerly,
    and no failed write analysis on the way (``conftest``). Not methods whose parameters fix the length (SLA2: its
    per-query-block alphas)."""
    module = flexsparse.SparseAttention(cfg, head_dim=64, num_heads=4, backend="triton").cuda()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(module, fullgraph=True)
    for n in (4096, 6144, 5000):
        q, k, v = make_qkv(1, 4, 2, n, n, 64, torch.bfloat16, "cuda")
        grads = []
        for fn in (compiled, module):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = fn(*leaves)
            out.float().square().sum().backward()
            grads.append([out] + [x.grad for x in leaves])
        for a, b in zip(*grads):
            assert ts.rel_err(a, b) < 2e-2, n
    assert not torch._dynamo.utils.counters["graph_break"]


@gpu
def test_gpu_deterministic():
    (q, k, v), selection = _gpu_case(16384, 4, 2, 64, 64, 64, 13)
    first, second = (grad_run(triton_branch, q, k, v, selection, 0.125, deterministic=True)
                     for _ in range(2))
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


@gpu
@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("n", [8192, 32768])
def test_gpu_block_csc_is_transpose(det, n):
    """At N = 8192 the one small-table kernel runs (lists ascending either way), at 32768 the larger tables' path."""
    from flexsparse.triton.common import csc
    selection = random_selection(2, 4, n, n, 64, 64, 9, "cuda")
    indices = selection.indices.contiguous()
    assert csc.small([csc.Segment(indices.shape[2], 9, selection.num_k_blocks, 0, 0)], 8) == (n == 8192)
    offsets, rows = csc.block_csc(indices, selection.num_k_blocks, det)
    want = csr_to_csc(selection.indices, selection.num_k_blocks)
    assert torch.equal(offsets, want.offsets)
    if det or n == 8192:
        assert torch.equal(rows, want.rows)
    else:  # same members per key, any order
        keys = torch.repeat_interleave(torch.arange(selection.num_k_blocks, device="cuda"),
                                       (want.offsets[0, 0, 1:] - want.offsets[0, 0, :-1]).long())
        got = (keys * 10**6 + rows[0, 0].long()).sort().values
        assert torch.equal(got, keys * 10**6 + want.rows[0, 0].long())


@gpu
def test_gpu_opcheck():
    (q, k, v), selection = _gpu_case(1000, 2, 1, 64, 64, 64, 4)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), selection.indices, 64, 64, 0.125, False)
    torch.library.opcheck(block_op.block_attn.op, args)


def _ws_backward_case(n, heads, kv_heads, d, block_q, topk, deterministic):
    """Inputs of the Gluon backward tests (skipped off sm_90): contiguous q, k, v, a random dO, the index table
    (64-token key blocks), the forward's O and LSE and the table's CSC."""
    from flexsparse.triton.block_sparse import fwd as block_fwd
    from flexsparse.triton.common.csc import block_csc
    ts.skip_unless_sm90()
    (q, k, v), selection = _gpu_case(n, heads, kv_heads, d, block_q, 64, topk)
    q, k, v = (x.contiguous() for x in (q, k, v))
    do = torch.randn_like(q)
    indices = selection.indices.contiguous()
    o, lse = block_fwd.block_forward(q, k, v, indices, block_q, 64, d**-0.5)
    offsets, rows = block_csc(indices, selection.num_k_blocks, deterministic)
    return q, k, v, do, indices, o, lse, offsets, rows


@gpu
@pytest.mark.parametrize("n,heads,kv_heads,d,block_q,topk,dtype", [
    (4096, 4, 2, 128, 64, 9, torch.bfloat16), (4000, 2, 2, 128, 64, 1, torch.bfloat16),
    (1000, 4, 1, 64, 64, 5, torch.float16), (8192, 2, 2, 64, 128, 7, torch.bfloat16),
    (7777, 2, 1, 128, 256, 11, torch.bfloat16), (32760, 2, 2, 128, 64, 25, torch.bfloat16)])
def test_gpu_warp_specialized_forward_matches_triton_kernel(n, heads, kv_heads, d, block_q, topk, dtype):
    """The Gluon forward (``block_fwd_ws``; ragged tails, GQA, 64-, 128- and 256-row query blocks) against the
    Triton kernel on the same selection; they sum in the same order."""
    from flexsparse.triton.block_sparse import fwd as block_fwd
    from flexsparse.triton.block_sparse import fwd_ws as block_fwd_ws
    ts.skip_unless_sm90()
    (q, k, v), selection = _gpu_case(n, heads, kv_heads, d, block_q, 64, topk, dtype)
    q, k, v = (x.contiguous() for x in (q, k, v))
    indices = selection.indices.contiguous()
    assert block_fwd_ws.supported(q, k, v, indices, block_q, 64)
    o, lse = block_fwd_ws.ws_block_forward(q, k, v, indices, block_q, 64, d**-0.5)
    want_o, want_lse = block_fwd.block_forward(q, k, v, indices, block_q, 64, d**-0.5,
                                               tiles=block_fwd.forward_tiles(q.device, d, dtype))
    assert ts.rel_err(o, want_o) < 1e-3
    assert (lse - want_lse).abs().max().item() < 1e-4
    assert torch.isfinite(o).all()


@gpu
def test_gpu_compiled_warp_specialized_forward():
    """D=128 (the Gluon forward's head dim): fullgraph compile of forward + backward, no graph break, equal to
    eager."""
    n, d, heads = 4000, 128, 4
    config = Config.from_dict({"method": "topk", "block_size": 64, "topk": 6})

    def step(q, k, v):
        o, lse = flexsparse.attention(q, k, v, config, backend="triton", return_lse=True)
        return o.float().square().sum() + lse.sum()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    leaves = [x.requires_grad_() for x in make_qkv(1, heads, 2, n, n, d, torch.bfloat16, "cuda")]
    torch.compile(step, fullgraph=True)(*leaves).backward()
    eager = [x.detach().clone().requires_grad_() for x in leaves]
    step(*eager).backward()
    for a, b in zip(leaves, eager):
        assert ts.rel_err(a.grad, b.grad) < 2e-2
    assert not torch._dynamo.utils.counters["graph_break"]


@gpu
@pytest.mark.parametrize("n,heads,d,block_q,topk", [
    (4096, 2, 64, 64, 9), (4000, 2, 64, 128, 3), (1000, 3, 128, 64, 1), (7777, 2, 64, 256, 5)])
def test_gpu_warp_specialized_dkv_matches_triton_kernel(n, heads, d, block_q, topk):
    """The Gluon dK/dV (``block_bwd_ws``; ragged tails, key blocks nobody selected, 64- to 256-row query
    blocks) against the Triton kernel on the same CSC; with a deterministic CSC it is bitwise reproducible."""
    from flexsparse.triton.block_sparse import bwd as block_bwd
    from flexsparse.triton.block_sparse import bwd_ws as block_bwd_ws
    q, k, v, do, indices, o, lse, offsets, rows = _ws_backward_case(n, heads, heads, d, block_q, topk, True)
    if topk == 1:  # 16 query blocks picking one of 16 key blocks each: some key block has an empty list
        assert (offsets[..., 1:] == offsets[..., :-1]).any()
    tiles = block_bwd.backward_tiles(q.device, d, q.dtype)
    _, want_dk, want_dv = block_bwd.block_backward(do, None, q, k, v, indices, offsets, rows, o, lse, block_q, 64,
                                                   d**-0.5, tiles=tiles)
    delta = (o.float() * do.float()).sum(-1)
    order = block_bwd.longest_first(offsets, heads)
    got = [block_bwd_ws.ws_dkv(q, k, v, do, lse, delta, offsets, rows, order, block_q, d**-0.5) for _ in range(2)]
    assert ts.rel_err(got[0][0], want_dk) < 1e-2 and ts.rel_err(got[0][1], want_dv) < 1e-2
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@gpu
def test_gpu_warp_specialized_backward_end_to_end():
    """D=64 without GQA and lists of >= ``WS_DKV_MIN_STEPS`` tiles (the Gluon dK/dV's case), ragged N: the default
    Triton path against the torch backend."""
    (q, k, v), selection = _gpu_case(3001, 4, 4, 64, 64, 64, 20)
    got = grad_run(triton_branch, q, k, v, selection, 0.125)
    want = grad_run(torch_branch, q.float(), k.float(), v.float(), selection, 0.125)
    for name, a, b in zip(NAMES, got, want):
        assert ts.rel_err(a, b) < 2e-2, name


@gpu
@pytest.mark.parametrize("n,heads,kv_heads,d,block_q,topk,with_dlse", [
    (4096, 4, 2, 64, 64, 9, False), (4000, 2, 2, 128, 128, 3, True), (1000, 3, 1, 64, 64, 1, True),
    (7777, 2, 2, 128, 256, 5, False)])
def test_gpu_warp_specialized_dq_matches_triton_kernel(n, heads, kv_heads, d, block_q, topk, with_dlse):
    """The Gluon dQ and Delta (``block_bwd_ws.ws_dq``; ragged tails, GQA, a gradient on the LSE) against the
    Triton kernel's."""
    from flexsparse.triton.block_sparse import bwd as block_bwd
    from flexsparse.triton.block_sparse import bwd_ws as block_bwd_ws
    q, k, v, do, indices, o, lse, offsets, rows = _ws_backward_case(n, heads, kv_heads, d, block_q, topk, False)
    dlse = torch.randn_like(lse) if with_dlse else None
    tiles = block_bwd.backward_tiles(q.device, d, q.dtype)
    want, _, _ = block_bwd.block_backward(do, dlse, q, k, v, indices, offsets, rows, o, lse, block_q, 64, d**-0.5,
                                          tiles=tiles)
    dq, delta = block_bwd_ws.ws_dq(q, k, v, do, o, lse, dlse, indices, block_q, d**-0.5)
    want_delta = (o.float() * do.float()).sum(-1) - (0 if dlse is None else dlse)
    assert ts.rel_err(dq, want) < 1e-2
    assert torch.allclose(delta, want_delta, atol=1e-3, rtol=1e-3)
