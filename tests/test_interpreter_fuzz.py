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
from helpers import config_fields, draw_level_topk  # noqa: E402
from test_triton_blocks import _method_params  # noqa: E402
from test_triton_llsa import _qkv as llsa_qkv  # noqa: E402

cpu_only, cpu_parent = ts.cpu_only, ts.cpu_parent
FUZZ = settings(max_examples=int(os.environ.get("FLEXSPARSE_FUZZ_EXAMPLES", "8")), deadline=None, database=None,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


pytestmark = pytest.mark.exhaustive   # the whole file is in the exhaustive tier
test_interpreter_suite_exhaustive = ts.interpreter_suites(__file__)[1]


# the options drawn where a method's config has them, with their choices
OPTIONS = {"gate": [False, True], "feature_map": ["softmax", "elu", "relu"], "linear": ["masked", "full"],
           "smooth_k": ["all", "router"], "deterministic": [False, True]}


@st.composite
def method_cases(draw):
    """(config, B, N, H, Hk, D): a method of the registry on ``backend="triton"`` with random blocks and sparsity
    (by its config's keys: hierarchical ``levels``, a block ``topk`` or a ``topk_ratio``) and options (``OPTIONS``)
    on up to 700 tokens."""
    method = draw(st.sampled_from(ts.triton_methods()))
    fields = config_fields(method)
    cfg = {"method": method}
    if "levels" in fields:
        n, block, levels = draw(st.integers(1, 700)), draw(st.sampled_from([4, 8, 16])), draw(st.integers(1, 3))
        cfg.update(block_size=block, levels=levels, topk=draw_level_topk(draw, n, block, levels, cap=12))
    else:
        n = draw(st.integers(1, 400))
        cfg.update(block_q=draw(st.sampled_from([16, 32, 64])), block_k=draw(st.sampled_from([16, 32, 64])))
        if "topk" in fields:
            cfg["topk"] = draw(st.integers(1, num_blocks(n, cfg["block_k"])))
        elif "topk_ratio" in fields:
            cfg["topk_ratio"] = draw(st.sampled_from([0.05, 0.2, 0.5, 1.0]))
    for key, choices in OPTIONS.items():
        if key in fields:
            cfg[key] = draw(st.sampled_from(choices))
    kv_heads = draw(st.sampled_from([1, 2]))
    return (cfg, draw(st.sampled_from([1, 2])), n, kv_heads * draw(st.sampled_from([1, 2])), kv_heads,
            draw(st.sampled_from([16, 32])))


@cpu_only
@FUZZ
@given(case=method_cases())
def test_methods_match_reference_on_random_configs(case):
    """``backend="triton"`` (interpreted kernels) against ``"reference"`` on the same fp32 inputs and parameters.
    The two backends select with different code (Triton kernels, PyTorch): LLSA's inputs are grid values (one
    batch) whose ragged tail repeats one row, on which both score exactly alike; the other methods' inputs are
    random, drawn again where a near-tie of two blocks' scores made the selections differ
    (``ts.draw_selecting_alike``: equal selections asserted)."""
    cfg, bsz, n, heads, kv_heads, d = case
    params = _method_params(cfg, d, heads, n)
    if "levels" in cfg:
        def draw():
            return llsa_qkv(n, heads, kv_heads, d, grid=True, pooled=(cfg["block_size"], cfg["levels"]))
    else:
        def draw():
            return ts.make_qkv(bsz, heads, kv_heads, n, n, d)
    leaves = [x.requires_grad_() for x in ts.draw_selecting_alike(draw, cfg, params, ("triton", "reference"))]
    got = run(*leaves, cfg, params, "triton")
    want = run(*leaves, cfg, params, "reference")
    ts.assert_runs_near(got, want, 1e-4, 1e-3)
