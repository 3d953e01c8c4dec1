import dataclasses
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import flexsparse as fs
from flexsparse import _checks
from flexsparse.config import MAX_BLOCK

import triton_support as ts
from helpers import grads, qkv, rel_err

LLSA = {"method": "llsa", "block_size": 4, "topk": 2, "levels": 1}


def test_wrong_rank():
    q, k, v = qkv(n=32, d=8)
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, N, D\)"):
        fs.attention(q[0], k, v, LLSA)


def test_mismatched_shapes_dtypes_devices():
    q, k, v = qkv(n=32, d=8)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        fs.attention(q, k, v[..., :4], LLSA)
    with pytest.raises(ValueError, match="same head dim"):
        fs.attention(q[..., :4], k, v, LLSA)
    with pytest.raises(ValueError, match="same batch size"):
        fs.attention(q[:1], k, v, LLSA)
    with pytest.raises(TypeError, match="share one dtype"):
        fs.attention(q.float(), k, v, LLSA)
    with pytest.raises(TypeError, match="float16, bfloat16"):
        fs.attention(q.int(), k.int(), v.int(), LLSA)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fs.attention(q.numpy(), k, v, LLSA)
    with pytest.raises(ValueError, match="same length N"):
        fs.attention(q, k[:, :, :16], v[:, :, :16], LLSA)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            fs.attention(q.cuda(), k, v, LLSA)
    with pytest.raises(ValueError, match="meta device"):
        fs.attention(*(x.to("meta") for x in (q, k, v)), LLSA)


def test_non_divisible_heads():
    q, k, v = qkv(heads=3, kv_heads=2, n=32, d=8)
    with pytest.raises(ValueError, match=r"multiple of the number of key/value heads"):
        fs.attention(q, k, v, LLSA)


@pytest.mark.parametrize("config, clamped, match", [
    ({"method": "topk", "block_size": 8, "topk": 5}, {"topk": 4}, r"'topk'=5 covers all 4 key blocks: clamped to 4"),
    ({"method": "vsa", "block_size": 16, "topk": 3}, {"topk": 2}, r"'topk'=3 covers all 2 key blocks"),
    ({"method": "llsa", "block_size": 4, "topk": 3, "levels": 2}, {"topk": [3, 2]},
     r"'topk'=3 covers all 2 level-2 tokens at N=32"),
    ({"method": "llsa", "block_size": 4, "topk": [9, 2], "levels": 2}, {"topk": [8, 2]},
     r"'topk\[0\]'=9 covers all 8 level-1 candidates under 2 level-2 tokens"),
])
def test_topk_covering_every_block_selects_them_all_and_warns_once(config, clamped, match, monkeypatch):
    """A top-K over the blocks that exist runs as the top-K of all of them (for topk: dense attention), with one
    warning per clamp."""
    monkeypatch.setattr(_checks, "_CLAMPED", set())
    q, k, v = qkv(n=32, d=8)
    with pytest.warns(UserWarning, match=match):
        out = fs.attention(q, k, v, config, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = fs.attention(q, k, v, config, backend="torch")
        want = fs.attention(q, k, v, {**config, **clamped}, backend="torch")
    assert torch.equal(out, want) and torch.equal(again, want)
    if config["method"] == "topk":
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert rel_err(out, dense) < 1e-12


@pytest.mark.parametrize("name", sorted(fs.METHODS))
def test_every_method_runs_its_default_config_at_any_length(name):
    """``{"method": name}`` at N = 1, 2 and 17 (fewer tokens than one default block, top-K over every block):
    torch and reference backends agree (fp64), outputs finite, no error."""
    cfg = fs.Config.from_dict({"method": name})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)       # the clamps' warnings
        for n in (1, 2, 17):
            q, k, v = qkv(batch=1, heads=2, kv_heads=1, n=n, d=8)
            params = fs.METHODS[name].init_params(cfg, 8, 2, n)
            params = {key: value.double() for key, value in params.items()} or None
            out = fs.attention(q, k, v, cfg, backend="torch", params=params)
            ref = fs.attention(q, k, v, cfg, backend="reference", params=params)
            assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-12, (name, n)


# every method with blocks, its example config's K or ratio lowered to what one key block holds
ONE_BLOCK_CONFIGS = [ts.example_config(name, topk=1, topk_ratio=1.0) for name, method in fs.METHODS.items()
                     if {"block_q", "block_size"} & {f.name for f in dataclasses.fields(method.config)}]


@pytest.mark.parametrize("cfg", ONE_BLOCK_CONFIGS, ids=lambda c: c["method"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_a_block_longer_than_the_sequence_is_one_block_of_it(cfg, backend):
    """Blocks of 65536 tokens and of MAX_BLOCK at N=37 give what blocks of exactly N give (one block covers the
    sequence): outputs, LSE and gradients, GQA, learned parameters included."""
    n, d, heads = 37, 8, 4
    leaves = qkv(batch=2, heads=heads, kv_heads=2, n=n, d=d, requires_grad=True)
    params = fs.METHODS[cfg["method"]].init_params(fs.Config.from_dict(cfg), d, heads, n)
    runs = []
    for block in (n, 65536, MAX_BLOCK):
        keys = ("block_size",) if "block_size" in cfg else ("block_q", "block_k")
        out, lse = fs.attention(*leaves, {**cfg, **dict.fromkeys(keys, block)}, backend=backend, return_lse=True,
                                params=params)
        runs.append([out, lse, *grads([out, lse], leaves)])
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            assert rel_err(got, want) < 1e-12


def test_bad_backend_and_scale():
    q, k, v = qkv(n=32, d=8)
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'.*valid backends"):
        fs.attention(q, k, v, LLSA, backend="cuda")
    with pytest.raises(ValueError, match="scale must be a positive"):
        fs.attention(q, k, v, LLSA, scale=-1.0)
    with pytest.raises(TypeError, match="scale must be a real number"):
        fs.attention(q, k, v, LLSA, scale="0.1")


def test_unavailable_backend_is_a_clear_error():
    q, k, v = qkv(n=32, d=8)
    refused = []
    for name, method in fs.METHODS.items():
        for backend in fs.backends.NAMES:
            if backend not in (*method.backends, "auto"):
                with pytest.raises(ValueError, match=f"backend '{backend}' is not available for method '{name}'"):
                    fs.attention(q, k, v, method.example, backend=backend)
                refused.append((name, backend))
    assert refused, "some method lacks some backend"


def test_triton_on_cpu_without_the_interpreter_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv(n=32, d=8)
    with pytest.raises(ValueError, match="backend 'triton' cannot run this call.*TRITON_INTERPRET=1"):
        fs.attention(q, k, v, LLSA, backend="triton")
    assert fs.attention(q, k, v, LLSA).shape == q.shape     # "auto" takes a backend that runs


def test_triton_refuses_more_batch_heads_than_a_cuda_grid_row_count():
    """Every Triton kernel puts q's B * H (or B * Hk) on CUDA's grid y axis: past 65535 the triton backend says so,
    on the CUDA device only (the interpreter has no such bound), and "auto" takes another backend."""
    topk, cuda = fs.METHODS["topk"], torch.device("cuda")
    triton = fs.backends.BACKENDS["triton"]
    for batch_heads in (1, 65535):
        assert triton.unsupported(cuda, torch.bfloat16, True, False, (64,), 64, batch_heads) is None
        assert fs.backends.resolve("auto", topk, cuda, True, batch_heads=batch_heads).name == "triton"
    with pytest.raises(ValueError, match=r"backend 'triton' cannot run this call.*q has B \* H = 65536; split"):
        fs.backends.resolve("triton", topk, cuda, True, batch_heads=65536)
    assert not fs.backends.runs_on("triton", cuda, True, batch_heads=65536)
    assert fs.backends.resolve("auto", topk, cuda, True, batch_heads=65536).name != "triton"
    with ts.interpreter_env(True):
        assert fs.backends.runs_on("triton", torch.device("cpu"), True, batch_heads=65536)


def test_module_checks_heads_and_dim():
    attn = fs.SparseAttention(LLSA, head_dim=8, num_heads=2)
    q, k, v = qkv(heads=4, n=32, d=8)
    with pytest.raises(ValueError, match="num_heads=2"):
        attn(q, k, v)
    q, k, v = qkv(heads=2, n=32, d=4)
    with pytest.raises(ValueError, match="head_dim=8"):
        attn(q, k, v)


@pytest.mark.parametrize("method", [name for name, m in fs.METHODS.items()
                                    if "quant" not in {f.name for f in dataclasses.fields(m.config)}])
def test_quant_is_refused_by_methods_without_it(method):
    with pytest.raises(ValueError, match=f"'quant'.*not supported by method '{method}'"):
        fs.attention(*qkv(n=64, d=8), {"method": method, "quant": {"dtype": "fp8_e4m3"}}, backend="torch")

def test_a_config_object_must_be_a_registered_methods():
    with pytest.raises(TypeError, match="no registered method"):
        fs.attention(*qkv(n=32, d=8), fs.Config())
    cfg = fs.Config.from_dict(LLSA)
    assert fs.Config.from_dict(cfg) is cfg


def test_scale_of_any_real_type_and_return_lse_a_bool():
    np = pytest.importorskip("numpy")
    q, k, v = qkv(n=32, d=8)
    want = fs.attention(q, k, v, LLSA, scale=0.25, backend="torch")
    for scale in (np.float32(0.25), np.float64(0.25), np.float16(0.25)):
        assert torch.equal(fs.attention(q, k, v, LLSA, scale=scale, backend="torch"), want)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        fs.attention(q, k, v, LLSA, return_lse="no")


@pytest.mark.parametrize("method", ["topk", "vsa", "full"])
def test_params_given_to_a_config_without_learnable_parameters_are_an_error(method):
    q, k, v = qkv(n=64, d=8)
    cfg = {"method": method, "block_size": 16, "topk": 2} if method != "full" else {"method": "full"}
    with pytest.raises(ValueError, match=f"method '{method}' with this config has no learnable parameters"):
        fs.attention(q, k, v, cfg, params={"gate_weight": torch.zeros(2, 8)})


@pytest.mark.parametrize("kwargs, error, match", [
    ({"head_dim": 0, "num_heads": 2}, ValueError, "head_dim must be a positive int, got 0"),
    ({"head_dim": "x", "num_heads": 2}, ValueError, "head_dim must be a positive int, got 'x'"),
    ({"head_dim": 8, "num_heads": 0}, ValueError, "num_heads must be a positive int, got 0"),
    ({"head_dim": 8, "num_heads": True}, ValueError, "num_heads must be a positive int, got True"),
    ({"head_dim": 8, "num_heads": 2, "backend": "bogus"}, ValueError, "backend 'bogus' is not available"),
])
def test_module_arguments_are_checked_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        fs.SparseAttention(LLSA, **kwargs)


def test_patched_sdpa_honours_enable_gqa():
    from flexsparse.integration import SparseSDPA
    sdpa = SparseSDPA(LLSA, head_dim=8, num_heads=4)
    q, k, v = qkv(heads=4, kv_heads=2, n=32, d=8)
    with pytest.raises(ValueError, match="grouped-query attention needs enable_gqa=True"):
        sdpa(q, k, v)
    torch.testing.assert_close(sdpa(q, k, v, enable_gqa=True), fs.attention(q, k, v, LLSA))


@pytest.mark.parametrize("table, match", [
    ('{"block_fwd": {"BMM": 32}}', "kind 'block_fwd' has no key 'BMM'; its keys: BM, BN, KB, stages, warps"),
    ('{"blockfwd": {"BM": 32}}', "FLEXSPARSE_TRITON_TILES has no kind 'blockfwd'; the kinds: fwd, bwd"),
    ('{"block_fwd": {"BM": 32}', "FLEXSPARSE_TRITON_TILES is not JSON"),
    ('{"block_fwd": 32}', "FLEXSPARSE_TRITON_TILES must map kinds"),
])
def test_tile_overrides_that_no_tile_choice_reads_are_errors(table, match, monkeypatch):
    """A misspelt kind or key of ``FLEXSPARSE_TRITON_TILES`` (``python -m flexsparse --tiles``) would change nothing;
    a call's first tile choice raises (the block top-K's here, before the forward's)."""
    from flexsparse.triton.block_sparse.fwd import forward_tiles
    from flexsparse.triton.selection.block_topk import topk_tiles
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", table)
    with pytest.raises(ValueError, match=re.escape(match)):
        topk_tiles(64)
        forward_tiles(torch.device("cpu"), 16, torch.float32)


def test_tile_overrides_take_the_keys_a_kernel_reads_where_set(monkeypatch):
    from flexsparse.triton.linear.fwd import linear_tiles
    from flexsparse.triton.selection.hierarchy import SELECT_TILES
    from flexsparse.triton._runtime.tiles import with_overrides
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", '{"linear": {"dq_maxnreg": 96, "TQ": 32}, "select": {"parents": 2}}')
    tiles = linear_tiles(torch.device("cpu"), 64, torch.float32)                # the CPU tiles have no caps
    assert tiles["dq_maxnreg"] == 96 and tiles["TQ"] == 32
    assert with_overrides("select", {}, SELECT_TILES) == {"parents": 2}


def test_eager_graphs_switch_takes_0_or_1(monkeypatch):
    from flexsparse import eager_graphs
    q = torch.zeros(1, 1, 16, 8)
    for value, on in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("FLEXSPARSE_EAGER_GRAPHS", value)
        assert eager_graphs.enabled() is on and not eager_graphs.applies(q, [q])      # CPU calls stay eager
    monkeypatch.setenv("FLEXSPARSE_EAGER_GRAPHS", "false")
    with pytest.raises(ValueError, match="FLEXSPARSE_EAGER_GRAPHS must be 0 or 1, got 'false'"):
        eager_graphs.applies(q, [q])


def test_launch_switch_takes_fast_or_triton():
    """``FLEXSPARSE_TRITON_LAUNCH`` is read at import: a misspelt value stops the import with an error naming it."""
    code = "import flexsparse.triton._runtime.fast_launch"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "FLEXSPARSE_TRITON_LAUNCH": "trition"})
    assert run.returncode != 0 and "FLEXSPARSE_TRITON_LAUNCH must be 'fast' or 'triton', got 'trition'" in run.stderr
