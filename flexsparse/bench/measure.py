"""Run benchmark cases in this process: build each case's call, then time it or check it against the reference.

A case is a JSON-able dict (``cases.Case.to_dict``): ``kind`` (``"method"``, ``"sdpa"`` or ``"flex_dense"``),
``label``, ``config`` (method cases), ``backend``, ``batch``, ``heads``, ``n``, ``dim``, ``dtype`` (a torch dtype
name such as ``"bfloat16"``), ``mode`` (``"fwd"``, ``"fwd+bwd"`` or ``"check"``), ``device`` and ``graph``.
Only flexsparse's public API is used (``flexsparse.SparseAttention``), so this measures whichever flexsparse is
importable, older layouts included (``worker.py`` runs it against another tree).
"""
from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F
from tqdm import tqdm

if __package__:
    from .timing import summary, time_call
else:  # loaded by worker.py, run as a script outside the package
    from timing import summary, time_call

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
_compiled_flex = None


def random_qkv(batch: int, heads: int, n: int, dim: int, dtype: torch.dtype, device, requires_grad: bool,
               seed: int) -> list[torch.Tensor]:
    """Standard normal q, k, v ``(B, H, N, D)`` drawn on the CPU from ``seed`` (the same values on every
    device and in every tree), cast to ``dtype`` on ``device``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(batch, heads, n, dim, generator=gen).to(device, dtype).requires_grad_(requires_grad)
            for _ in range(3)]


def build_module(config: dict, backend: str, dim: int, heads: int, n: int, device):
    """``flexsparse.SparseAttention`` for ``config`` on ``backend`` with its parameters (if any) moved away from
    their initial values by a fixed small perturbation, so that zero-initialised branches do work."""
    import flexsparse

    module = flexsparse.SparseAttention(config, head_dim=dim, num_heads=heads, seq_len=n, backend=backend)
    module = module.to(device)
    with torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(0)
        for p in module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
    return module


def dense_flex():
    """``torch.compile(flex_attention)`` (static shapes), compiled once per process."""
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def attend_of(case: dict):
    """The attention call ``attend(q, k, v) -> o`` of a case."""
    if case["kind"] == "sdpa":
        return F.scaled_dot_product_attention
    if case["kind"] == "flex_dense":
        return dense_flex()
    return build_module(case["config"], case["backend"], case["dim"], case["heads"], case["n"], case["device"])


def forward_backward(attend, q, k, v, grad_out) -> tuple[torch.Tensor, ...]:
    """Forward and backward of ``attend(q, k, v)`` with the upstream gradient ``grad_out``: the gradients of
    q, k, v, returned by ``torch.autograd.grad`` (nothing accumulates in any ``.grad``)."""
    return torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)


def timed_call(case: dict):
    """The zero-argument function that a timing case times: the forward under ``torch.no_grad()`` (``"fwd"``)
    or ``forward_backward`` with a fixed upstream gradient (``"fwd+bwd"``)."""
    attend = attend_of(case)
    backward = case["mode"] == "fwd+bwd"
    dtype = DTYPES[case["dtype"]]
    q, k, v = random_qkv(case["batch"], case["heads"], case["n"], case["dim"], dtype, case["device"], backward,
                         seed=case["n"])
    if backward:
        gen = torch.Generator(device="cpu").manual_seed(case["n"] + 1)
        grad_out = torch.randn(q.shape, generator=gen).to(q.device, dtype)
        return lambda: forward_backward(attend, q, k, v, grad_out)

    def forward():
        with torch.no_grad():
            return attend(q, k, v)
    return forward


def max_error(case: dict) -> float:
    """Max |o - o_ref| of a method case at its (small) N against the fp64 ``backend="reference"`` with the same
    parameters, both fed the same inputs rounded to the case's dtype (so rounding cannot flip a selection)."""
    dtype, device = DTYPES[case["dtype"]], case["device"]
    q, k, v = (x.to(dtype).double() for x in random_qkv(case["batch"], case["heads"], case["n"], case["dim"],
                                                         torch.float64, device, False, seed=case["n"]))
    reference = build_module(case["config"], "reference", case["dim"], case["heads"], case["n"], device).double()
    test = build_module(case["config"], case["backend"], case["dim"], case["heads"], case["n"], device)
    test.load_state_dict(reference.state_dict())
    with torch.no_grad():
        want = reference(q, k, v)
        got = test(q.to(dtype), k.to(dtype), v.to(dtype))
    return (got.double() - want).abs().max().item()


def run_case(case: dict) -> dict:
    """The result of one case: ``status`` ``"ok"`` with ``times_ms`` (every sample) and their ``min_ms``,
    ``median_ms``, ``max_ms`` (a ``"check"`` case: ``max_error``); ``"skipped"`` when the case raised a
    ``ValueError`` (its config does not fit the shape); ``"failed"`` for any other error; ``reason`` says why."""
    try:
        if case["mode"] == "check":
            return {"status": "ok", "max_error": max_error(case)}
        times = time_call(timed_call(case), case["device"], graph=case.get("graph", False))
        return {"status": "ok", "times_ms": times, **summary(times)}
    except ValueError as exc:
        return {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one failing case (e.g. out of memory) must not lose the others
        return {"status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[:500]}",
                "traceback": traceback.format_exc()}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_cases(cases: list[dict], prefix: str = "") -> list[dict]:
    """``run_case`` of every case in order, each result next to its case (``{"case": ..., **result}``); a tqdm
    bar names the case running, and every skipped or failed case is reported as it happens."""
    results = []
    bar = tqdm(cases, unit="case", dynamic_ncols=True)
    for case in bar:
        bar.set_description(f"{prefix}{case['label']}")
        result = run_case(case)
        if result["status"] != "ok":
            bar.write(f"{prefix}{result['status']} {case['label']}: {result['reason']}")
        results.append({"case": case, **result})
    return results
