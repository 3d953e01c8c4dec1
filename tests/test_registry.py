"""``flexsparse.triton._runtime.registry``: plain eager calls run the op body directly (no dispatcher, plain launches),
through an ``autograd.Function`` of the registered formula (itself with plain launches) when they record gradients;
traced calls and tensor subclasses go through the registered op."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from flexsparse.triton._runtime import registry  # noqa: E402

CALLS = []


@registry.triton_op("flexsparse_test::scaled")
def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor``, recording whether kernels would launch directly."""
    CALLS.append(registry.launching_directly())
    return x * factor


BACKWARD_CALLS = []


def _backward(ctx, grad):
    BACKWARD_CALLS.append(registry.launching_directly())
    return grad * ctx.factor, None


def _setup(ctx, inputs, output):
    ctx.factor = inputs[1]


scaled.register_autograd(_backward, setup_context=_setup)


def _run(x, factor=3.0):
    CALLS.clear()
    out = scaled(x, factor)
    return out, list(CALLS)


def test_plain_eager_call_runs_the_body_directly():
    x = torch.randn(5)
    out, calls = _run(x)
    torch.testing.assert_close(out, x * 3.0)
    assert calls == [True] and not registry.launching_directly()


def test_eager_calls_recording_gradients_run_the_body_under_the_registered_formula():
    factor = float(torch.rand(()) + 0.5)
    for x in (torch.randn(5, requires_grad=True), torch.nn.Parameter(torch.randn(5))):
        out, calls = _run(x, factor)
        assert calls == [True] and type(out.grad_fn).__name__ == "scaledBackward"
        grad = torch.randn(5)
        out.backward(grad)
        torch.testing.assert_close(x.grad, grad * factor)
        with torch.no_grad():
            assert _run(x)[1] == [True]


def test_eager_backward_formula_launches_directly_and_traced_one_does_not():
    """The registered formula of an eager call runs with plain launches (a kernel it launches itself takes the fast
    path), the flag restored after it; under ``torch.compile`` it runs traced, without them."""
    x = torch.randn(6, requires_grad=True)
    factor = float(torch.rand(()) + 0.5)
    BACKWARD_CALLS.clear()
    grad = torch.randn(6)
    scaled(x, factor).backward(grad)
    torch.testing.assert_close(x.grad, grad * factor)
    assert BACKWARD_CALLS == [True] and not registry.launching_directly()
    BACKWARD_CALLS.clear()
    x.grad = None
    compiled = torch.compile(lambda x: scaled(x, factor), fullgraph=True, backend="aot_eager")
    compiled(x).backward(grad)
    torch.testing.assert_close(x.grad, grad * factor)
    assert BACKWARD_CALLS and True not in BACKWARD_CALLS


def test_subclassed_tensors_go_through_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.randn(5, requires_grad=True)
        out, calls = _run(x)
    assert calls == [False] and type(out.grad_fn).__name__ != "scaledBackward"


def test_traced_calls_go_through_the_op():
    compiled = torch.compile(lambda x: scaled(x, 2.0), fullgraph=True, backend="eager")
    CALLS.clear()
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), x * 2.0)
    assert True not in CALLS
    torch.library.opcheck(scaled.op, (x, 2.0))


def test_direct_flag_is_restored_after_an_error():
    with pytest.raises(TypeError):
        scaled(torch.randn(2), "not a number")
    assert not registry.launching_directly()


_CACHED_OP = '''
import torch
from torch.library import triton_op


@triton_op("flexsparse_stale::shifted", mutates_args=())
def shifted(x: torch.Tensor) -> torch.Tensor:
    return x + {shift}
'''

_COMPILE_IT = '''
import sys
import torch
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "tagged":
    from flexsparse.triton._runtime.compile_cache import tag_compile_caches
    tag_compile_caches(sys.argv[1], "shifted")
import shifted_op
print(torch.compile(lambda x: shifted_op.shifted(x) * 2, fullgraph=True)(torch.ones(3)).tolist())
'''


@pytest.mark.parametrize("tagged", [False, pytest.param(True, marks=pytest.mark.exhaustive)])
def test_compile_caches_miss_when_an_op_body_changes(tmp_path, tagged):
    """A ``triton_op`` whose body changes between two processes sharing torch.compile's on-disk caches: untagged, the
    second process gets the first one's compiled graph (torch's AOTAutograd cache keys on the op, not its traced
    body: the behaviour ``compile_cache`` guards against); tagged with the source digest, the new body's result."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # this checkout's flexsparse
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    (tmp_path / "run.py").write_text(_COMPILE_IT)
    results = []
    for shift in (1, 2):
        (tmp_path / "shifted_op.py").write_text(_CACHED_OP.format(shift=shift))
        done = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path), "tagged" if tagged else ""],
                              capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(done.stdout.strip().splitlines()[-1])
    assert results[0] == "[4.0, 4.0, 4.0]"
    assert results[1] == ("[6.0, 6.0, 6.0]" if tagged else "[4.0, 4.0, 4.0]")


def test_flexsparse_source_digest_is_in_the_compile_cache_key(tmp_path):
    """Importing the ops tags torch.compile's cache keys with the package's source digest, which changes with any
    file of it."""
    import shutil
    from flexsparse.triton._runtime import compile_cache
    tag = f"flexsparse-{compile_cache.source_digest(compile_cache.PACKAGE_ROOT)}"
    assert tag in torch.compiler.config.cache_key_tag.split("|")
    copy = tmp_path / "flexsparse"
    shutil.copytree(compile_cache.PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert compile_cache.source_digest(str(copy)) == compile_cache.source_digest(compile_cache.PACKAGE_ROOT)
    with open(copy / "triton" / "selection" / "hierarchy.py", "a") as f:
        f.write("\n")
    assert compile_cache.source_digest(str(copy)) != compile_cache.source_digest(compile_cache.PACKAGE_ROOT)
