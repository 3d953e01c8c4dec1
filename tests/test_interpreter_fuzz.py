"""CPU (CI): random configs and shapes of every method through the Triton kernels under the interpreter (fp32),
drawn fresh on every run, against the dense reference: output, LSE and the gradients of q, k, v and of the
learned parameters.

The interpreter suites pin the shapes each kernel was written for; this draws the rest on CPU, as
``test_gpu_fuzz.py`` does on the GPU: ragged and tiny N, LLSA with one to three levels and any K a level can fill,
block pairs of 16 to 64, GQA, SLA's masked and full linear branches with every feature map, SLA2's smoothing
choices, VSA's gate, deterministic mode. ``FLEXSPARSE_FUZZ_EXAMPLES`` sets the cases (default 8, ~1 minute on
two cores); a failure prints its case as drawn.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import triton_support as ts

pytest.importorskip("triton")

from flexsparse.masks import num_blocks  # noqa: E402

from _sla_testing import run  # noqa: E402
from helpers import draw_level_topk  # noqa: E402
from test_triton_blocks import _method_params  # noqa: E402
from test_triton_llsa import _qkv as llsa_qkv  # noqa: E402

cpu_only, cpu_parent = ts.cpu_only, ts.cpu_parent
FUZZ = settings(max_examples=int(os.environ.get("FLEXSPARSE_FUZZ_EXAMPLES", "8")), deadline=None, database=None,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@cpu_parent
def test_interpreter_suite():
    ts.check_interpreter_suite(__file__)


@st.composite
def method_cases(draw):
    """(config, B, N, H, Hk, D): a method with random blocks and sparsity on up to 700 tokens."""
    method = draw(st.sampled_from(["topk", "vsa", "llsa", "sla", "sla2"]))
    if method == "llsa":
        n, block, levels = draw(st.integers(1, 700)), draw(st.sampled_from([4, 8, 16])), draw(st.integers(1, 3))
        cfg = {"method": "llsa", "block_size": block, "levels": levels,
               "topk": draw_level_topk(draw, n, block, levels, cap=12)}
    else:
        n = draw(st.integers(1, 400))
        cfg = {"method": method, "block_q": draw(st.sampled_from([16, 32, 64])),
               "block_k": draw(st.sampled_from([16, 32, 64]))}
        if method in ("topk", "vsa"):
            cfg["topk"] = draw(st.integers(1, num_blocks(n, cfg["block_k"])))
            if method == "vsa":
                cfg["gate"] = draw(st.booleans())
        else:
            cfg["topk_ratio"] = draw(st.sampled_from([0.05, 0.2, 0.5, 1.0]))
            cfg["feature_map"] = draw(st.sampled_from(["softmax", "elu", "relu"]))
            if method == "sla":
                cfg["linear"] = draw(st.sampled_from(["masked", "full"]))
            else:
                cfg["smooth_k"] = draw(st.sampled_from(["all", "router"]))
    cfg["deterministic"] = draw(st.booleans())
    kv_heads = draw(st.sampled_from([1, 2]))
    return (cfg, draw(st.sampled_from([1, 2])), n, kv_heads * draw(st.sampled_from([1, 2])), kv_heads,
            draw(st.sampled_from([16, 32])))


@cpu_only
@FUZZ
@given(case=method_cases())
def test_methods_match_reference_on_random_configs(case):
    """``backend="triton"`` (interpreted kernels) against ``"reference"`` on the same fp32 inputs and parameters.
    LLSA's two backends select with different code (Triton kernels, ``masks``), so its inputs are grid values
    (one batch) whose ragged tail repeats one row, on which both score exactly alike; the other methods share one
    selection."""
    cfg, bsz, n, heads, kv_heads, d = case
    if cfg["method"] == "llsa":
        tensors = llsa_qkv(n, heads, kv_heads, d, grid=True, pooled=(cfg["block_size"], cfg["levels"]))
    else:
        tensors = ts.make_qkv(bsz, heads, kv_heads, n, n, d)
    leaves = [x.requires_grad_() for x in tensors]
    params = _method_params(cfg, d, heads, n)
    got = run(*leaves, cfg, params, "triton")
    want = run(*leaves, cfg, params, "reference")
    ts.assert_runs_near(got, want, 1e-4, 1e-3)
