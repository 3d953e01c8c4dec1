"""Memory follows the input, not the config: calls run in a child process (this file as a script) under an
address-space limit (``RLIMIT_AS``) of the process's size plus ``memory_bound`` of their input, set after the
imports and a warm-up call per backend, so that a call asking for more fails at once instead of taking the machine.

Default tier: the calls that once asked for gigabytes to terabytes (LLSA with a block of the whole sequence and
levels past it; blocks of 65536 and 2**20 tokens at N=64) on the backends that run on CPU (the Triton kernels
interpreted; flex's cases are exhaustive: its compile takes ~15 s cold), and sizes past the config bounds, which are
a ``ValueError`` naming the key. Exhaustive tier: random configs of every method (blocks longer than N and of any
size, deep LLSA levels, odd N, GQA) against the fp64 reference, each backend call under the bound.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys

import pytest

from helpers import config_fields

MIB = 2**20
BASE_BYTES = 384 * MIB   # allocator and autograd slack, the Triton interpreter's buffers
INPUT_FACTOR = 64        # copies of q, k, v (accumulation dtype, gathers, gradients)
DENSE_FACTOR = 16        # (B, H, N, N) score matrices: the dense reference, or a config that selects every block
MAX_BLOCK, MAX_LEVELS = 2**31 - 1, 32
FUZZ_CASES = int(os.environ.get("FLEXSPARSE_MEMORY_FUZZ_CASES", "96"))
INTERPRETED_N = 64       # longest sequence of the fuzz's interpreted cases (one in eight)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux only")


def memory_bound(shape, itemsize: int) -> int:
    """Bytes a call on ``shape = (B, H, Hk, N, D)`` inputs of ``itemsize`` may add: a constant, a multiple of the
    inputs and a multiple of one dense ``(B, H, N, N)`` score matrix, whatever the config's blocks and levels."""
    bsz, heads, kv_heads, n, d = shape
    inputs = bsz * (heads + 2 * kv_heads) * n * d * itemsize
    return BASE_BYTES + INPUT_FACTOR * inputs + DENSE_FACTOR * bsz * heads * n * n * itemsize


def run_cases(cases: list[dict], timeout: int) -> list[dict]:
    """Each case in the child (``_child``), in order: ``{"ok": True, "errors": ..., "rss_mib": ...}`` or
    ``{"error": type name, "message": ...}``. The child runs the Triton kernels interpreted."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__, json.dumps(cases)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(results) == len(cases), done.stdout[-4000:] + done.stderr[-4000:]
    return results


def case(config: dict, backend: str, shape=(1, 1, 1, 64, 64), dtype="float32", grad=False, seed=0,
         compare=False) -> dict:
    return dict(config=config, backend=backend, shape=list(shape), dtype=dtype, grad=grad, seed=seed, compare=compare)


LLSA_PAST_N = {"method": "llsa", "block_size": 64, "levels": 4, "topk": 1}
PAST_N = [LLSA_PAST_N, {"method": "topk", "block_size": 65536, "topk": 1},
          {"method": "topk", "block_size": 2**20, "topk": 1}]
SIZES_PAST_BOUNDS = [
    ({"method": "llsa", "block_size": 64, "levels": 100, "topk": 1}, "'levels' must be <= 32, got 100"),
    ({"method": "llsa", "block_size": 64, "levels": 10**9, "topk": 1}, "'levels' must be <= 32, got 1000000000"),
    ({"method": "topk", "block_size": 2**62, "topk": 1}, f"'block_size' must be <= {MAX_BLOCK}, got {2**62}"),
]


def past_n_cases(backend: str) -> list[dict]:
    """The configs of ``PAST_N`` on ``backend``: q, k, v ``(1, 1, 64, 64)`` fp32 and ``(1, 2, 277, 16)`` fp64, with
    gradients where the backend has them (flex on CPU: fp32, no gradients)."""
    flex = backend == "flex"
    return [case(config, backend, shape=shape, dtype="float32" if flex else dtype, grad=not flex) for config in PAST_N
            for shape, dtype in (((1, 1, 1, 64, 64), "float32"), ((1, 2, 2, 277, 16), "float64"))]


@pytest.fixture(scope="module")
def default_tier_results():
    """One child for the default tier's cases: ``PAST_N`` on the reference, torch and (interpreted) triton backends,
    then ``SIZES_PAST_BOUNDS``."""
    cases = [spec for backend in ("reference", "torch", "triton") for spec in past_n_cases(backend)]
    results = run_cases(cases + [case(config, "torch") for config, _ in SIZES_PAST_BOUNDS], timeout=300)
    return cases, results[:len(cases)], results[len(cases):]


def test_blocks_and_levels_past_the_sequence_stay_within_the_input_bound(default_tier_results):
    """A block longer than N runs as one block of the sequence and LLSA's levels past it have one token each: every
    call of ``PAST_N`` (forward and backward) stays within its input's bound on the CPU backends."""
    cases, results, _ = default_tier_results
    failed = [(spec, result) for spec, result in zip(cases, results) if not result.get("ok")]
    assert not failed, failed


@pytest.mark.exhaustive
def test_blocks_and_levels_past_the_sequence_stay_within_the_input_bound_on_flex():
    cases = past_n_cases("flex")
    failed = [(spec, result) for spec, result in zip(cases, run_cases(cases, timeout=600)) if not result.get("ok")]
    assert not failed, failed


def test_sizes_past_the_config_bounds_are_a_value_error_naming_the_key(default_tier_results):
    for (config, match), result in zip(SIZES_PAST_BOUNDS, default_tier_results[2]):
        assert result.get("error") == "ValueError" and match in result["message"], (config, result)


# ---------------------------------------------------------------------------------------------- the fuzz campaign


def random_block(rng: random.Random, n: int, minimum: int = 1) -> int:
    """A block for N tokens: small of any size, a power of two, just past N (any size), or far past it."""
    kind = rng.random()
    if kind < 0.3:
        return rng.randint(minimum, max(minimum, min(n, 48)))
    if kind < 0.5:
        return max(minimum, rng.choice([4, 16, 32, 64, 128]))
    if kind < 0.85:
        return rng.randint(max(minimum, n + 1), 3 * n + 70)
    return rng.choice([65536, 2**20 + 3, MAX_BLOCK])


def level_topk(rng: random.Random, n: int, block: int, levels: int, cap: int = 6) -> list[int]:
    """LLSA's K per level, finest first, that the levels can fill (``helpers.draw_level_topk``, with spans that
    reach past N)."""
    def tokens(level):
        span = 1
        for _ in range(level):
            span = min(span * block, n)
        return -(-n // span)

    top = [0] * levels
    top[-1] = rng.randint(1, min(cap, tokens(levels)))
    for level in range(levels - 2, -1, -1):
        top[level] = rng.randint(1, min(cap, (top[level + 1] - 1) * block + 1, tokens(level + 1)))
    return top


def random_config(rng: random.Random, method: str, n: int, deepest: int = MAX_LEVELS) -> dict:
    """A config of ``method`` for N tokens over its keys: blocks (``random_block``), levels (up to ``deepest``), K or
    a ratio and every option."""
    fields, cfg = config_fields(method), {"method": method}
    if "levels" in fields:
        block = random_block(rng, n, minimum=2)
        levels = min(deepest, rng.choice([1, 2, 3, rng.randint(1, 8), MAX_LEVELS]))
        cfg.update(block_size=block, levels=levels, topk=level_topk(rng, n, block, levels))
    elif "block_q" in fields:
        cfg.update(block_q=random_block(rng, n), block_k=random_block(rng, n))
    if "topk" in fields and method != "llsa":
        cfg["topk"] = rng.randint(1, min(8, -(-n // cfg["block_k"])))
    if "topk_ratio" in fields:
        cfg["topk_ratio"] = rng.choice([0.05, 0.25, 0.5, 1.0])
    options = {"gate": [False, True], "feature_map": ["softmax", "elu", "relu"], "linear": ["masked", "full"],
               "smooth_k": ["all", "router"], "router": ["hard", "soft"], "alpha_per_head": [False, True]}
    cfg.update({key: rng.choice(choices) for key, choices in options.items() if key in fields})
    if cfg.get("linear") == "masked" and cfg["topk_ratio"] < 1.0:
        cfg["negligible_ratio"] = rng.choice([0.0, 0.2])
    return cfg


def random_cases(seed: int, count: int) -> list[dict]:
    """``count`` cases of every method of the registry, each with its own seed: N of 1 to 600 (mostly odd), GQA;
    fp64 on the torch and triton backends (the triton ops' PyTorch bodies) against the reference, and one in eight
    through the interpreted Triton kernels in fp32 (smaller: N <= ``INTERPRETED_N``, one batch entry, two query
    heads, at most 8 levels)."""
    from flexsparse.methods import METHODS
    rng, cases = random.Random(seed), []
    for i in range(count):
        method = sorted(METHODS)[i % len(METHODS)]
        backends = [name for name in ("torch", "triton") if name in METHODS[method].backends]
        interpreted = i % 8 == 7 and "triton" in backends
        n = rng.choice([rng.randrange(1, 601, 2), rng.randint(1, 600), rng.randint(1, 40)])
        kv_heads, d = rng.choice([1, 2]), rng.choice([4, 8, 16])
        if interpreted:
            n = min(n, INTERPRETED_N)
            spec = case(random_config(rng, method, n, deepest=8), "triton", shape=(1, 2, kv_heads, n, d))
        else:
            shape = (rng.choice([1, 2]), kv_heads * rng.choice([1, 2, 3]), kv_heads, n, d)
            spec = case(random_config(rng, method, n), rng.choice(backends), shape=shape, dtype="float64")
        cases.append(dict(spec, grad=True, seed=rng.getrandbits(32), compare=True))
    return cases


@pytest.mark.exhaustive
def test_random_configs_of_every_method_match_the_reference_within_the_input_bound(_fresh_seed):
    """``FLEXSPARSE_MEMORY_FUZZ_CASES`` cases (default 96, ~2 minutes on two cores) drawn from the test's seed
    (``FLEXSPARSE_TEST_SEED`` replays them); a failure lists its cases with their seeds."""
    pytest.importorskip("triton")
    cases = random_cases(_fresh_seed, FUZZ_CASES)
    failed = [(c, r) for c, r in zip(cases, run_cases(cases, timeout=600)) if not r.get("ok")]
    assert not failed, "\n".join(f"{c} -> {r}" for c, r in failed)


# -------------------------------------------------------------------------------------------------- the child


def _vm_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024


@contextlib.contextmanager
def address_space(extra: int):
    """The process's address space limited to its size now plus ``extra`` bytes inside the block."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _inputs(spec: dict, draw: int = 0):
    """q, k, v of the case's seed (and ``draw``, for draws after the first) in its dtype, from fp64 draws."""
    import torch
    bsz, heads, kv_heads, n, d = spec["shape"]
    gen = torch.Generator().manual_seed(spec["seed"] + draw * 2**32)
    q = torch.randn(bsz, heads, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(bsz, kv_heads, n, d, generator=gen, dtype=torch.float64) + 0.3 * torch.randn(
        1, kv_heads, 1, d, generator=gen, dtype=torch.float64)
    v = torch.randn(bsz, kv_heads, n, d, generator=gen, dtype=torch.float64)
    return [x.to(getattr(torch, spec["dtype"])) for x in (q, k, v)]


def _params(spec: dict, dtype) -> dict:
    from flexsparse.config import Config
    from flexsparse.methods import METHODS
    _, heads, _, n, d = spec["shape"]
    cfg = Config.from_dict(spec["config"])
    return {name: p.to(dtype).requires_grad_() for name, p in METHODS[cfg.method].init_params(cfg, d, heads, n).items()}


def _call(q, k, v, spec: dict, backend: str, params: dict):
    """Output, LSE and with ``grad`` the gradients of q, k, v of a fixed random loss (flex on CPU: the output)."""
    import torch
    import flexsparse
    leaves = [x.detach().requires_grad_(spec["grad"]) for x in (q, k, v)]
    if backend == "flex":
        with torch.no_grad():
            return [flexsparse.attention(*leaves, spec["config"], backend=backend, params=params)]
    out, lse = flexsparse.attention(*leaves, spec["config"], backend=backend, return_lse=True, params=params)
    if not spec["grad"]:
        return [out, lse]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.dtype)
    return [out, lse, *torch.autograd.grad((out * weight).sum() + lse.sum(), leaves)]


def _run(spec: dict) -> dict:
    """One case: its backend (and the reference with ``compare``) under the input's bound; fp32 comparisons on
    inputs drawn until the Triton kernels select as PyTorch does (``ts.draw_selecting_alike``)."""
    import itertools
    import resource
    import torch
    from helpers import rel_err
    results = []
    try:
        q, k, v = _inputs(spec)
        params = _params(spec, q.dtype)
        if spec["compare"] and spec["dtype"] == "float32":
            import triton_support as ts
            draws = itertools.count()
            q, k, v = ts.draw_selecting_alike(lambda: _inputs(spec, next(draws)), spec["config"], params,
                                              (spec["backend"], "reference"))
        bound = memory_bound(spec["shape"], q.element_size())
        for backend in (spec["backend"], "reference") if spec["compare"] else (spec["backend"],):
            with address_space(bound):
                results.append(_call(q, k, v, spec, backend, params))
        errors = [rel_err(a, b) for a, b in zip(*results)] if spec["compare"] else []
    except Exception as err:   # every failure, an allocation past the bound included, goes to the parent
        return {"error": type(err).__name__, "message": str(err)[:1000]}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - BASELINE_RSS
    tol = 1e-10 if q.dtype == torch.float64 else 1e-3
    return {"ok": all(e < tol for e in errors), "errors": errors, "rss_mib": rss / MIB, "bound_mib": bound / MIB}


def _warm_up() -> None:
    """One small call with gradients: the thread pools and the allocator's arenas come before any limit."""
    import torch
    import flexsparse
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    flexsparse.attention(q, q, q, {"method": "llsa", "block_size": 4, "topk": 2, "levels": 2},
                         backend="reference").sum().backward()


def _child(cases: list[dict]) -> None:
    import resource
    import torch
    torch.set_num_threads(2)
    _warm_up()
    global BASELINE_RSS
    BASELINE_RSS = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for spec in cases:
        print(json.dumps(_run(spec)), flush=True)


BASELINE_RSS = 0

if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
