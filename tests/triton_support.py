"""Test support for the Triton backend: the interpreter subprocess and shared helpers.

The Triton interpreter must be on (``TRITON_INTERPRET=1``) before ``triton`` itself is imported,
which other test files may do first. So on a machine without CUDA the interpreter tests run in a
child pytest process started with the variable set (``run_interpreter_suite``); in the parent
process they are skipped and nothing else is affected. Tests that need the variable off for a
moment (the torch fallback) use ``interpreter_env(False)``: the op bodies read it at call time.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def triton_methods(branch: str | None = None) -> list[str]:
    """The methods of the registry that run on ``backend="triton"`` (with ``branch``: those whose sparse branch is
    ``"block"`` or ``"llsa"``), in registry order."""
    from flexsparse.methods import METHODS
    return [name for name, method in METHODS.items()
            if "triton" in method.backends and (branch is None or method.sparse_branch == branch)]


def fp8_methods() -> list[str]:
    """The methods of the registry whose quantized sparse branch the FP8 kernel runs: a ``quant`` config key, and the
    triton backend takes their branch with the default ``QuantConfig``."""
    import dataclasses
    from flexsparse.backends import BACKENDS
    from flexsparse.config import QuantConfig
    from flexsparse.methods import METHODS
    return [name for name in triton_methods()
            if "quant" in {field.name for field in dataclasses.fields(METHODS[name].config)}
            and BACKENDS["triton"].quant_unsupported(QuantConfig(), METHODS[name].sparse_branch) is None]


def example_config(method: str, **changes) -> dict:
    """The registry's example config of ``method`` with ``changes``: ``topk`` and ``topk_ratio`` apply only where the
    example has that key (a method has one or the other); ``block_size`` replaces every block key (``block_q`` and
    ``block_k`` given with it too), ``block_q`` / ``block_k`` replace the example's ``block_size``; other keys are
    set."""
    from flexsparse.methods import METHODS
    cfg = dict(METHODS[method].example)
    changes = {key: value for key, value in changes.items() if key not in ("topk", "topk_ratio") or key in cfg}
    if "block_size" in changes:
        cfg, changes = ({key: value for key, value in x.items() if key not in ("block_q", "block_k")}
                        for x in (cfg, changes))
    elif ("block_q" in changes or "block_k" in changes) and "block_size" in cfg:
        size = cfg.pop("block_size")
        cfg.update(block_q=size, block_k=size)
    return {**cfg, **changes}


BLOCK_KEYS = ("block_size", "block_q", "block_k")


def merged(defaults: dict, changes: dict) -> dict:
    """``defaults`` updated with ``changes``; block keys in ``changes`` replace every block key of ``defaults``."""
    if any(key in changes for key in BLOCK_KEYS):
        defaults = {key: value for key, value in defaults.items() if key not in BLOCK_KEYS}
    return {**defaults, **changes}


# the block-sparse methods of the GPU end-to-end tests (sparse branch on Triton): the registry's examples with 6 of
# the key blocks or 10% of them
GPU_METHODS = [example_config(name, topk=6, topk_ratio=0.1) for name in triton_methods("block")]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

cpu_only = pytest.mark.skipif(not INTERPRETED or HAS_CUDA,
                              reason="interpreter test: runs in the child process of test_interpreter_suite")
cpu_parent = pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="CPU test of the parent process")


def gpu(test):
    """``pytest -m gpu`` tests, skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(test))


def skip_unless_sm90() -> None:
    """Skip a GPU test of the Gluon kernels on GPUs other than sm_90 (Hopper)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for sm_90")


TIERS = {"default": "not gpu and not exhaustive", "exhaustive": "not gpu and exhaustive"}


def run_interpreter_suite(path: str, tier: str = "default", timeout: float = 5400) -> subprocess.CompletedProcess:
    """Run the non-GPU tests of ``path`` in ``tier`` (``TIERS``) in a child pytest with the interpreter on."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "pytest", path, "-q", "-m", TIERS[tier], "-p", "no:cacheprovider"]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def interpreter_unusable() -> str | None:
    """Why this Triton's interpreter cannot run the kernels here, or None. Triton 3.6's takes ``int()`` of the
    1-element array of a runtime loop bound (``tl.range(0, n)``), which numpy 2.4 refuses (a TypeError in every
    kernel with such a loop; triton 3.7 fixed it)."""
    import numpy as np
    import triton
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 7):
        return None
    try:
        int(np.zeros(1))
    except TypeError:
        return (f"triton {triton.__version__}'s interpreter cannot run runtime loop bounds under numpy {np.__version__}"
                ": run the interpreter suites with triton >= 3.7 (scripts/setup.sh pairs torch 2.13 with 3.7.1)")
    return None


def check_interpreter_suite(path: str, tier: str = "default") -> None:
    """Run ``path``'s interpreter tests of ``tier`` in a child pytest (``run_interpreter_suite``) and fail with its
    output; skipped where ``interpreter_unusable``. A file with no test in the tier passes (pytest's exit code 5)."""
    reason = interpreter_unusable()
    if reason:
        pytest.skip(reason)
    result = run_interpreter_suite(path, tier)
    assert result.returncode in (0, 5), result.stdout[-8000:] + result.stderr[-4000:]


def interpreter_suites(path: str):
    """The parent-process tests that run ``path``'s interpreter tests: ``test_interpreter_suite`` (default tier)
    and ``test_interpreter_suite_exhaustive``; a test file assigns both to names of its own so pytest collects
    them."""
    @cpu_parent
    def test_interpreter_suite():
        check_interpreter_suite(path)

    @cpu_parent
    @pytest.mark.exhaustive
    def test_interpreter_suite_exhaustive():
        check_interpreter_suite(path, "exhaustive")

    return test_interpreter_suite, test_interpreter_suite_exhaustive


def env_var(name: str, value: str | None):
    """``flexsparse.bench.env_var`` (imported at the call, as flexsparse is here: see the module docstring)."""
    from flexsparse.bench import env_var as package_env_var
    return package_env_var(name, value)


def interpreter_env(on: bool):
    """``TRITON_INTERPRET=1`` inside the block (unset with ``on=False``), restored after (``env_var``)."""
    return env_var("TRITON_INTERPRET", "1" if on else None)


@contextlib.contextmanager
def triton_ops_on_cpu():
    """``backend="triton"`` accepted on CPU inside the block: its ops run their CPU kernels (the PyTorch
    implementations registered for the CPU dispatch key). Users get an error there (``TritonBackend.unsupported``);
    these tests reach the ops' CPU kernels and the backend's orchestration through it."""
    from flexsparse.backends import BACKENDS
    backend = BACKENDS["triton"]
    checks = backend.unsupported
    backend.unsupported = lambda device, *args: None if device.type == "cpu" else checks(device, *args)
    try:
        yield
    finally:
        del backend.unsupported


@contextlib.contextmanager
def programs_reversed():
    """Interpreted launches run their programs last to first inside the block. The interpreter runs a grid's programs
    one at a time in order, so a result that depends on the order of atomic updates comes out the same every run;
    against a run in reversed order it does not (a determinism test compares the two)."""
    from triton.runtime.interpreter import InterpreterBuilder
    in_order = InterpreterBuilder.set_grid_idx

    def reversed_idx(builder, x, y, z):
        nx, ny, nz = builder.grid_dim
        in_order(builder, nx - 1 - x, ny - 1 - y, nz - 1 - z)

    InterpreterBuilder.set_grid_idx = reversed_idx
    try:
        yield
    finally:
        InterpreterBuilder.set_grid_idx = in_order


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def lse_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / (1 + |b|)`` in fp64: for log-sum-exps, whose values can sit near zero (a lone query's
    LSE, e.g. ``s + ln 2``), where ``rel_err`` would measure the cancellation, not the error."""
    a, b = a.double(), b.double()
    return ((a - b).abs() / (1 + b.abs())).max().item()


def assert_runs_near(got, want, tol: float, grad_tol: float, lse=lse_err) -> None:
    """Two ``(out, lse, grads)`` results (``_sla_testing.run``): outputs within ``tol`` relative L2 error, LSEs
    within ``tol`` by ``lse``, and every gradient present in both or in neither, within ``grad_tol``."""
    assert rel_err(got[0], want[0]) < tol
    assert lse(got[1], want[1]) < tol
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        assert (a is None) == (b is None), i
        if a is not None:
            assert rel_err(a, b) < grad_tol, i


def grid_values(*shape) -> torch.Tensor:
    """Random multiples of 1/4 in [-1, 1] (fp32): pooled means and raw dots are exact, so every
    summation order gives the same scores, and exact ties exercise the tie-break."""
    return torch.randint(-4, 5, shape) / 4


def random_selection(bsz, heads, nq, nk, block_q, block_k, topk, device="cpu"):
    """A ``BlockSelection`` of ``topk`` distinct random key blocks per query block, ascending, int32."""
    from flexsparse.masks import BlockSelection, num_blocks   # after the interpreter switch of the test module
    tq, tk = num_blocks(nq, block_q), num_blocks(nk, block_k)
    ids = torch.rand(bsz, heads, tq, tk, device=device).argsort(-1)[..., :topk].sort(-1).values
    return BlockSelection(ids.to(torch.int32).contiguous(), block_q, block_k, nq, nk)


def selection_tables(selection) -> list[torch.Tensor]:
    """The index tables of a method's selection (``Method.select``'s result on any backend: a ``BlockSelection``,
    LLSA's packed or pooled selection, a method's tuple around them), which decide the keys each query attends; the
    tensors that come with them (pooled means, smoothed keys, soft masks) are left out."""
    from flexsparse.masks import BlockSelection, LLSASelection
    if isinstance(selection, BlockSelection):
        return [selection.indices] + ([] if selection.excluded is None else [selection.excluded])
    if isinstance(selection, LLSASelection):
        return list(selection.indices)
    if hasattr(selection, "selection"):          # LLSA's selection with the pyramids it came with
        return selection_tables(selection.selection)
    if isinstance(selection, tuple):
        return [table for part in selection for table in selection_tables(part)]
    return []


def method_selection(backend: str, q, k, v, config, params=None):
    """The selection ``flexsparse.attention(q, k, v, config, backend=backend, params=params)`` makes (no gradient)."""
    from flexsparse.backends import BACKENDS
    from flexsparse.config import Config
    from flexsparse.methods import METHODS
    cfg = Config.from_dict(config)
    method, chosen = METHODS[cfg.method], BACKENDS[backend]
    cfg = method.fit(cfg, q.shape[2], k.shape[2])
    with torch.no_grad():
        q, k, v = chosen.prepare_inputs(*(x.detach() for x in (q, k, v)), keep_views=method.keeps_views,
                                        needs_grad=False)
        return method.select(q, k, v, cfg, chosen, method.check_params(cfg, q, params))


def same_selection(config, params, runs) -> bool:
    """Whether the method of ``config`` selects the same blocks in every run ``(backend, q, k, v)``."""
    tables = [selection_tables(method_selection(backend, q, k, v, config, params)) for backend, q, k, v in runs]
    return all(len(other) == len(tables[0]) and all(torch.equal(a, b) for a, b in zip(other, tables[0]))
               for other in tables[1:])


def draw_selecting_alike(draw, config, params=None, backends=("triton", "torch"), tries: int = 10):
    """``draw()`` -> ``(q, k, v)``, drawn again (at most ``tries`` times) until the method of ``config`` selects the
    same blocks on every backend of ``backends``: a name, or ``(name, cast)`` with ``cast(q, k, v)`` the inputs that
    backend gets. Only the triton backend selects with the Triton kernels (the others in PyTorch), and the two
    compute the scores in other orders: a near-tie between two blocks' scores can pick other blocks (rarely), and an
    end-to-end comparison of the backends would then measure that choice, not the arithmetic. Equal selections are
    asserted: every draw selecting differently is a failure."""
    runs = [(backend, None) if isinstance(backend, str) else backend for backend in backends]
    for _ in range(tries):
        q, k, v = draw()
        if same_selection(config, params, [(name, *((q, k, v) if cast is None else cast(q, k, v)))
                                           for name, cast in runs]):
            return q, k, v
    raise AssertionError(f"{tries} draws all selected differently on {[name for name, _ in runs]}: {config}")


def make_qkv(bsz, heads, kv_heads, nq, nk, d, dtype=torch.float32, device="cpu", key_offset=0.3):
    """Fresh random q ``(B, H, Nq, D)``, k and v ``(B, Hk, Nk, D)``; k with a per-head offset of scale
    ``key_offset``, as real keys (drawn on the CPU, then moved)."""
    q = torch.randn(bsz, heads, nq, d)
    k = torch.randn(bsz, kv_heads, nk, d) + key_offset * torch.randn(1, kv_heads, 1, d)
    v = torch.randn(bsz, kv_heads, nk, d)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]
