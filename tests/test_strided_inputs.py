"""q, k, v as strided views of one fused projection ``(B, N, 3, H, D)``, a DiT's usual layout.

The triton backend's kernels read contiguous ``(B, H, N, D)`` rows, so ``flexsparse.attention`` copies such views
once (op ``flexsparse::contiguous_rows``, kernel ``triton/common/rows.py``) before the method runs. LLSA's kernels read
them in place, forward and backward (except in compiled training, where the API copies them: ``api.attention``),
and its output lies in q's memory order. Before, every op made its own copy: LLSA's forward copied each of q, k, v
twice and its backward once more (2.15 instead of 1.00 ms at B2 H8 N65536 D64 on an H100). Values and gradients
are those of contiguous inputs. The other methods' ops copy a strided upstream gradient (through the model's
``out.transpose(1, 2).reshape(...)``) with the same row-copy kernel; LLSA's backward reads it in place.

CPU: the contract (contiguous rows reach the method on ``triton``, except LLSA's outside compiled training; views
pass through on ``torch``) and equal results; the copy kernel through the interpreter in a child pytest
(``test_interpreter_suite``), which also runs the methods' kernels on the views. GPU (``pytest -m gpu``): the copy
in bf16 and the methods bit for bit.
"""
from __future__ import annotations

import pytest
import torch

import flexsparse
import triton_support as ts
from flexsparse.methods import METHODS

# every method of the registry on backend="triton": its example on 16-token blocks with K = 3 or 25% of the key
# blocks, changed as listed here
CHANGES = {"llsa": {"topk": 2}, "sla2": {"block_q": 32, "block_k": 16}}
CONFIGS = [ts.example_config(name, **ts.merged({"block_size": 16, "topk": 3, "topk_ratio": 0.25},
                                                CHANGES.get(name, {})))
           for name in ts.triton_methods()]


@pytest.fixture(autouse=True)
def _triton_ops_on_cpu():
    """On CPU the triton backend's calls reach its ops' CPU kernels (``ts.triton_ops_on_cpu``)."""
    with ts.triton_ops_on_cpu():
        yield


def _fused_views(n: int, heads: int = 2, dim: int = 16, dtype=torch.float32, device="cpu"):
    """A leaf ``(1, n, 3, heads, dim)`` and its q, k, v ``(1, heads, n, dim)`` views (strided over n)."""
    qkv = torch.randn(1, n, 3, heads, dim, dtype=dtype, device=device, requires_grad=True)
    return qkv, qkv.permute(2, 0, 3, 1, 4).unbind(0)


def _triton_module(config: dict, n: int, heads: int, dim: int, dtype, device: str) -> flexsparse.SparseAttention:
    """The method on ``backend="triton"``, its parameters fp32 for bf16 inputs, else in the inputs' dtype."""
    module = flexsparse.SparseAttention(config, head_dim=dim, num_heads=heads, seq_len=n, backend="triton")
    return module.to(device=device, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)


def _on_views_and_copies(attend, leaf: torch.Tensor, views, grad: torch.Tensor):
    """``attend(q, k, v)`` on the views of ``leaf`` and on contiguous copies of them, with one upstream gradient:
    ``(out, d_leaf)`` and ``(out, [dq, dk, dv])``."""
    out = attend(*views)
    (d_leaf,) = torch.autograd.grad(out, leaf, grad)
    leaves = [x.detach().contiguous().requires_grad_() for x in views]
    want = attend(*leaves)
    return (out, d_leaf), (want, torch.autograd.grad(want, leaves, grad))


def _as_views_and_contiguous(config: dict, n: int, dtype, device: str, heads: int = 2, dim: int = 16):
    """``(out, d_qkv)`` on the views and ``(out, stacked grads)`` on contiguous copies, one module, one gradient."""
    qkv, views = _fused_views(n, heads, dim, dtype, device)
    grad = torch.randn(1, heads, n, dim, dtype=dtype, device=device)
    got, (want, want_grads) = _on_views_and_copies(_triton_module(config, n, heads, dim, dtype, device), qkv, views,
                                                   grad)
    return got, (want, torch.stack(want_grads).permute(1, 3, 0, 2, 4))


test_interpreter_suite, test_interpreter_suite_exhaustive = ts.interpreter_suites(__file__)
DEFAULT_TIER_CASES = 1   # interpreter tests: the first case of each in the default tier (conftest)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["method"])
@pytest.mark.parametrize("backend, grad", [("triton", True), ("triton", False), ("torch", True)])
def test_triton_backend_gets_contiguous_rows_once(config, backend, grad, monkeypatch):
    """Copied once on ``triton``, except for methods whose kernels read the views in place (``keeps_views``: LLSA).
    Views pass through on ``torch``."""
    method = METHODS[config["method"]]
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append([x.is_contiguous() for x in (q, k, v)])
        return select(q, k, v, *args, **kwargs)

    select = method.select
    monkeypatch.setattr(method, "select", spy)
    _, (q, k, v) = _fused_views(200, dtype=torch.float64)
    assert not any(x.is_contiguous() for x in (q, k, v))
    with torch.set_grad_enabled(grad):
        flexsparse.SparseAttention(config, head_dim=16, num_heads=2, seq_len=200, backend=backend).double()(q, k, v)
    copied = backend == "triton" and not method.keeps_views
    assert seen == [[copied] * 3]


def _inference_on(q, k, v, block: int = 16):
    """No-grad LLSA on q, k, v as given and on contiguous copies of them: ``(out, want)``."""
    cfg = {"method": "llsa", "block_size": block, "topk": 2, "deterministic": True}
    with torch.no_grad():
        return (flexsparse.attention(q, k, v, cfg, backend="triton"),
                flexsparse.attention(q.contiguous(), k.contiguous(), v.contiguous(), cfg, backend="triton"))


@pytest.mark.skipif(ts.INTERPRETED, reason="compile does not trace the ops through the Triton interpreter")
@pytest.mark.parametrize("grad", [True, False])
def test_compiled_llsa_copies_views_only_for_training(grad, monkeypatch):
    """In a compiled graph LLSA gets contiguous copies where gradients are recorded (inductor fuses the copies into
    their producers; compiled DiT-S training measured faster so) and the views without; values as eager's."""
    method = METHODS["llsa"]
    seen, select = [], method.select

    def spy(q, k, v, *args, **kwargs):
        seen.append([x.is_contiguous() for x in (q, k, v)])
        return select(q, k, v, *args, **kwargs)

    monkeypatch.setattr(method, "select", spy)
    cfg = {"method": "llsa", "block_size": 16, "topk": 2, "deterministic": True}
    qkv, _ = _fused_views(256)

    def run(x):
        return flexsparse.attention(*x.permute(2, 0, 3, 1, 4).unbind(0), cfg, backend="triton")

    with torch.set_grad_enabled(grad):
        got, want = torch.compile(run, fullgraph=True)(qkv), run(qkv)
    assert seen == [[grad] * 3, [False] * 3]
    torch.testing.assert_close(got, want)


def _forbid_copies(monkeypatch):
    """Any copy of a tensor by the triton ops fails the test."""
    from flexsparse.triton.common import inputs

    def no_copy(t):
        raise AssertionError(f"copied a {tuple(t.shape)} view")

    monkeypatch.setattr(inputs, "_copied", no_copy)


@ts.cpu_only
@pytest.mark.parametrize("n, block", [(200, 16), (256, 16), (100, 8)])  # ragged, batched fine level, ragged kernels
def test_llsa_inference_on_views_reads_them_in_place(n, block, monkeypatch):
    """The kernels (interpreter) read the views without any copy of q, k or v; the output equals the contiguous
    inputs' and is laid out like q, ``(B, N, H, D)`` in memory, so the model's ``transpose(1, 2)`` is free."""
    _forbid_copies(monkeypatch)
    out, want = _inference_on(*_fused_views(n)[1], block=block)
    assert torch.equal(out, want) and out.transpose(1, 2).is_contiguous()


@ts.cpu_only
@pytest.mark.parametrize("grad_layout", ["model", "contiguous"])
def test_llsa_training_on_views_copies_nothing(grad_layout, monkeypatch):
    """Forward and backward read the views, the output and the upstream gradient in place, whether the gradient
    comes through the model's ``out.transpose(1, 2).reshape(B, N, H * D)`` or contiguous; dq, dk, dv come out
    contiguous. Output and gradients equal, bit for bit (deterministic), those of contiguous copies."""
    _forbid_copies(monkeypatch)
    qkv, views = _fused_views(256)
    cfg = {"method": "llsa", "block_size": 16, "topk": 2, "deterministic": True}
    out = flexsparse.attention(*views, cfg, backend="triton")
    assert out.transpose(1, 2).is_contiguous()
    grad = torch.randn(out.shape)
    if grad_layout == "model":
        merged = out.transpose(1, 2).reshape(1, 256, -1)
        (d_qkv,) = torch.autograd.grad(merged, qkv, grad.transpose(1, 2).reshape(merged.shape))
    else:
        (d_qkv,) = torch.autograd.grad(out, qkv, grad)
    leaves = [x.detach().contiguous().requires_grad_() for x in views]
    want = flexsparse.attention(*leaves, cfg, backend="triton")
    want_grads = torch.autograd.grad(want, leaves, grad)
    assert torch.equal(out, want)
    assert torch.equal(d_qkv, torch.stack(want_grads).permute(1, 3, 0, 2, 4))     # (1, n, 3, heads, dim)


def _gqa_views(layout: str, n: int = 200, heads: int = 4, kv_heads: int = 2, dim: int = 16):
    """A leaf ``(1, n, H + 2 Hk, D)`` projection and its q, k, v views (k, v with 2 of 4 heads); with
    ``v_contiguous`` v is a contiguous copy (k and v then differ in strides)."""
    proj = torch.randn(1, n, heads + 2 * kv_heads, dim, requires_grad=True)
    q, k, v = proj.transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    if layout == "v_contiguous":
        v = v.contiguous()
    assert not q.is_contiguous() and not k.is_contiguous()
    return proj, (q, k, v)


@ts.cpu_only
@pytest.mark.parametrize("n", [200, 256])  # the ragged and the batched kernels
@pytest.mark.parametrize("layout", ["gqa_fused", "v_contiguous"])
def test_llsa_inference_on_other_views(layout, n, monkeypatch):
    """GQA views of one projection, and k, v with different strides (a view and a contiguous tensor, as in a model
    whose k passes through a norm and RoPE): read in place, no copy."""
    _forbid_copies(monkeypatch)
    out, want = _inference_on(*_gqa_views(layout, n)[1])
    assert torch.equal(out, want)


@ts.cpu_only
@pytest.mark.parametrize("n", [200, 256])  # the ragged and the batched kernels
@pytest.mark.parametrize("layout", ["gqa_fused", "v_contiguous"])
def test_llsa_training_on_other_views(layout, n, monkeypatch):
    """The same views with gradients, read in place: output and the projection's gradient (GQA: the query heads' dK,
    dV summed into their KV head) equal those of contiguous copies, bit for bit (deterministic mode)."""
    cfg = {"method": "llsa", "block_size": 16, "topk": 2, "deterministic": True}
    proj, views = _gqa_views(layout, n)
    _forbid_copies(monkeypatch)  # the contiguous copies' run makes none either

    def attend(q, k, v):
        return flexsparse.attention(q, k, v, cfg, backend="triton")

    (out, got), (want, grads) = _on_views_and_copies(attend, proj, views, torch.randn(1, 4, n, 16))
    assert torch.equal(out, want)
    assert torch.equal(got, torch.cat(grads, dim=1).transpose(1, 2))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["method"])
def test_strided_views_compute_as_contiguous_inputs(config):
    """fp32: the torch fallback in this process, the Triton kernels in the interpreter's child process."""
    (out, d_qkv), (want, want_grad) = _as_views_and_contiguous(config, 200, torch.float32, "cpu")
    assert torch.equal(out, want) and torch.equal(d_qkv, want_grad)


def _upstream_gradient_as_view_and_contiguous(config: dict, n: int, dtype, device: str, heads: int = 2, dim: int = 16):
    """Gradients of q, k, v for an upstream gradient through ``out.transpose(1, 2).reshape(1, n, H * D)`` (a strided
    ``(B, H, N, D)`` view) and for the same values contiguous."""
    leaves = [torch.randn(1, heads, n, dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3)]
    module = _triton_module(config, n, heads, dim, dtype, device)
    grad = torch.randn(1, n, heads * dim, dtype=dtype, device=device).view(1, n, heads, dim).transpose(1, 2)
    assert not grad.is_contiguous()
    return (torch.autograd.grad(module(*leaves), leaves, grad),
            torch.autograd.grad(module(*leaves), leaves, grad.contiguous()))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["method"])
def test_strided_upstream_gradient_as_contiguous(config):
    """fp32: the torch fallback here, the kernels (and the row copy of the gradient) in the interpreter's child."""
    got, want = _upstream_gradient_as_view_and_contiguous(config, 200, torch.float32, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@ts.cpu_only
@pytest.mark.parametrize("view", ["fused", "heads_last", "sliced"])
@pytest.mark.parametrize("n, dim", [(1, 16), (130, 24), (77, 64)])
def test_copy_rows_kernel_equals_contiguous(view, n, dim):
    from flexsparse.triton.common.inputs import contiguous_rows
    base = torch.randn(2, n, 3, 3, dim + 8)
    x = {"fused": base[..., :dim].permute(2, 0, 3, 1, 4)[1],          # (2, 3, n, dim): rows 3 (dim + 8) apart
         "heads_last": base[:, :, 0, :, :dim].transpose(1, 2),        # heads and tokens interleaved
         "sliced": base[:, :, :, 0, :dim].transpose(1, 2)}[view]      # a head axis of stride dim + 8
    assert x.stride(-1) == 1 and not x.is_contiguous()
    out = contiguous_rows(x)
    assert out.is_contiguous() and torch.equal(out, x)
    leaf = x.detach().requires_grad_()
    grad = torch.randn(out.shape)
    assert torch.equal(torch.autograd.grad(contiguous_rows(leaf), leaf, grad)[0], grad)


@ts.cpu_parent
def test_copy_rows_opcheck_cpu_fallback():
    from flexsparse.triton.common.inputs import contiguous_rows
    x = torch.randn(1, 40, 3, 2, 16).permute(2, 0, 3, 1, 4)[0].requires_grad_()
    with ts.interpreter_env(False):
        torch.library.opcheck(contiguous_rows.op, (x,))


@ts.gpu
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_copy_rows_bf16(dim):
    from flexsparse.triton.common.inputs import contiguous_rows
    _, (q, k, v) = _fused_views(4099, heads=4, dim=dim, dtype=torch.bfloat16, device="cuda")
    for x in (q, k, v):
        out = contiguous_rows(x)
        assert out.is_contiguous() and torch.equal(out, x)
    torch.library.opcheck(contiguous_rows.op, (q,))


@ts.gpu
@pytest.mark.parametrize("config", [c for c in CONFIGS if c["method"] != "vsa"], ids=lambda c: c["method"])
def test_gpu_strided_views_equal_contiguous_inputs(config):
    """Deterministic mode: the same kernels on the same values give the same bits. Not ``vsa``: its coarse branch
    runs SDPA, whose flash backward adds dQ with atomics."""
    cfg = {**config, "deterministic": True, **({"topk_ratio": 0.05} if "topk_ratio" in config else {})}
    (out, d_qkv), (want, want_grad) = _as_views_and_contiguous(cfg, 16384, torch.bfloat16, "cuda", heads=4, dim=64)
    assert torch.equal(out, want) and torch.equal(d_qkv, want_grad)


@ts.gpu
def test_gpu_llsa_inference_on_views_reads_them_in_place(monkeypatch):
    _forbid_copies(monkeypatch)
    out, want = _inference_on(*_fused_views(16384, 4, 64, torch.bfloat16, "cuda")[1])
    assert torch.equal(out, want) and out.transpose(1, 2).is_contiguous()


@ts.gpu
def test_gpu_compiled_llsa_inference_on_views_equals_eager():
    """Traced, the ops get the views too (no ``.contiguous()`` at the API); the fake output has q's memory order."""
    cfg = {"method": "llsa", "block_size": 16, "topk": 2}
    qkv, _ = _fused_views(4096, heads=4, dim=64, dtype=torch.bfloat16, device="cuda")

    def run(x):
        return flexsparse.attention(*x.permute(2, 0, 3, 1, 4).unbind(0), cfg, backend="triton")

    with torch.no_grad():
        got, want = torch.compile(run, fullgraph=True)(qkv), run(qkv)
    assert torch.equal(got, want) and got.stride() == want.stride()


@ts.gpu
def test_gpu_compiled_llsa_training_on_views_equals_eager():
    """Traced with gradients the API copies the views (``.contiguous()``, which inductor fuses into their producers);
    eagerly the ops read them in place. The output is equal bit for bit, the qkv gradient up to the order in which
    inductor's reductions add the dK/dV partials of the top levels (ATen's ``sum`` eagerly; a layout error would be
    O(1))."""
    cfg = {"method": "llsa", "block_size": 16, "topk": 2, "deterministic": True}
    qkv, _ = _fused_views(4096, heads=4, dim=64, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn(1, 4096, 4 * 64, dtype=torch.bfloat16, device="cuda")

    def run(x):
        out = flexsparse.attention(*x.permute(2, 0, 3, 1, 4).unbind(0), cfg, backend="triton")
        return out.transpose(1, 2).reshape(1, 4096, 4 * 64)

    got, want = torch.compile(run, fullgraph=True)(qkv), run(qkv)
    assert torch.equal(got, want)
    assert ts.rel_err(torch.autograd.grad(got, qkv, grad)[0], torch.autograd.grad(want, qkv, grad)[0]) < 1e-2


@ts.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["method"])
def test_gpu_strided_upstream_gradient_as_contiguous(config):
    """Same bits in deterministic mode; ``vsa`` to bf16 rounding: its coarse branch runs SDPA, whose flash backward
    adds dQ with atomics (a misread gradient layout would be O(1))."""
    cfg = {**config, "deterministic": True, **({"topk_ratio": 0.05} if "topk_ratio" in config else {})}
    got, want = _upstream_gradient_as_view_and_contiguous(cfg, 16384, torch.bfloat16, "cuda", heads=4, dim=64)
    if config["method"] == "vsa":
        assert all(ts.rel_err(a, b) < 1e-2 for a, b in zip(got, want))
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@ts.gpu
def test_gpu_compiled_on_strided_views_equals_eager():
    """Compiled graphs copy the views with ``.contiguous()`` (inductor's copy), eager with the op: same bits."""
    cfg = {"method": "topk", "block_size": 64, "topk": 4, "deterministic": True}
    qkv, views = _fused_views(4096, heads=4, dim=64, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn(1, 4, 4096, 64, dtype=torch.bfloat16, device="cuda")
    module = flexsparse.SparseAttention(cfg, head_dim=64, num_heads=4, seq_len=4096, backend="triton")
    compiled = torch.compile(lambda x: module(*x.permute(2, 0, 3, 1, 4).unbind(0)), fullgraph=True)
    out = compiled(qkv)
    want = module(*views)
    assert torch.equal(out, want)
    assert torch.equal(torch.autograd.grad(out, qkv, grad)[0], torch.autograd.grad(want, qkv, grad)[0])
