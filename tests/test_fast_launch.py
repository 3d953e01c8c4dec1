"""The eager launch path (``flexsparse.triton._runtime.fast_launch``): its launch key refines Triton's
specialization (CPU, Triton's own binder for an sm_90 target), and on a GPU it launches the kernel Triton's own path
picks for every specialization (alignment, ``== 1``, divisibility by 16, integer width), with the same results."""
from __future__ import annotations

import collections
import inspect

import pytest
import torch
import triton
import triton.language as tl

import triton_support as ts
from flexsparse.triton._runtime import fast_launch
from flexsparse.triton._runtime.fast_launch import FastLaunch


def _one_argument(x):
    pass


_one_argument_kernel = triton.jit(_one_argument)


def _stub_driver(monkeypatch):
    """A driver stand-in for the keys on CPU (device 0)."""
    from types import SimpleNamespace
    monkeypatch.setattr(fast_launch, "driver", SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0)))


@ts.cpu_parent
def test_launch_key_refines_triton_specialization(monkeypatch):
    """Arguments of one launch key get one specialization from Triton's binder (the other way round need not hold:
    a key may split what Triton keeps together)."""
    base = torch.empty(64, dtype=torch.float32)
    draws = torch.randint(-2**40, 2**40, (40,)).tolist()
    values = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1, 2**32, 2**63 - 1,
              2**63, 2**63 + 16, 2**64 - 1, *draws, *(16 * x for x in draws), True, False, None, 0.5, 3.0, -2.0,
              base, base[1:], base[2:], base[4:], base[5:], torch.empty(8, dtype=torch.bfloat16),
              torch.empty(9, dtype=torch.bfloat16)[1:], torch.empty(8, dtype=torch.float16),
              torch.empty(3, dtype=torch.int32), torch.empty(3, dtype=torch.int64)[1:]]
    groups = _specializations(values, monkeypatch)
    assert not {key: specs for key, specs in groups.items() if len(specs) > 1}
    assert len(groups) >= 12


def _specializations(values, monkeypatch) -> dict:
    """``{FastLaunch's key: {Triton's specialization}}`` of each value as the one argument of a kernel for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import KernelParam, create_function_from_signature
    signature = inspect.signature(_one_argument)
    params = [KernelParam(0, signature.parameters["x"], False, False)]
    binder = create_function_from_signature(signature, params, CUDABackend(GPUTarget("cuda", 90, 32)))
    _stub_driver(monkeypatch)
    fast = FastLaunch(_one_argument_kernel)
    groups = collections.defaultdict(set)
    for value in values:
        groups[fast._key((1,), (value,), {})[0]].add(repr(binder(value)[1]))
    return groups


@ts.cpu_parent
def test_launch_key_refines_triton_specialization_of_gluon_descriptors(monkeypatch):
    """Gluon TMA descriptors over tensors of other shapes, strides and base addresses share a launch key (and a
    specialization) when their dtype, block shape and layout agree; those that differ in any of them split."""
    gl = pytest.importorskip("triton.experimental.gluon.language")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    values = []
    for dtype, gl_dtype in ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16), (torch.float32, gl.float32)):
        for rows in (64, 128):
            for cols in (32, 64):
                layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl_dtype)
                for n in (128, 4096, 1000):
                    base = torch.empty(n + 8, 128, dtype=dtype)
                    for tensor in (base[:n], base[8:], base[:n, :cols], base[:n, 64:64 + cols]):
                        values.append(TensorDescriptor.from_tensor(tensor, [rows, cols], layout))
    groups = _specializations(values, monkeypatch)
    assert not {key: specs for key, specs in groups.items() if len(specs) > 1}
    assert len(groups) == 12


@ts.cpu_parent
def test_descriptor_equals_tritons_and_rejects_what_tma_cannot_read():
    """``fwd_ws.descriptor`` (no checks in Python beyond TMA's needs) builds the descriptor Triton's ``from_tensor``
    builds, and a misaligned address, a misaligned row stride or non-contiguous rows raise a ValueError."""
    pytest.importorskip("triton.experimental.gluon.language")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from flexsparse.triton.block_sparse import fwd_ws
    for dtype, gl_dtype in ((torch.bfloat16, fwd_ws.gl.bfloat16), (torch.float16, fwd_ws.gl.float16)):
        base = torch.randn(4096 + 8, 128).to(dtype)
        for tensor, block in ((base[:4096, :64], [64, 64]), (base[8:], [128, 128]), (base[:1000, 64:], [64, 64])):
            layout = fwd_ws.shared_layout(*block, gl_dtype)
            assert fwd_ws.descriptor(tensor, block, layout) == TensorDescriptor.from_tensor(tensor, block, layout)
        layout = fwd_ws.shared_layout(64, 64, gl_dtype)
        flat = base.view(-1)
        for bad in (flat[1:1 + 64 * 64].view(64, 64), flat[:64 * 68].view(64, 68)[:, :64], base[:64, :128:2],
                    flat[:64 * 66].view(64, 66)[:, :64]):
            with pytest.raises(ValueError, match="TMA descriptor"):
                fwd_ws.descriptor(bad, [64, 64], layout)


def _triton36_wrapper(launcher, tensordesc_indices, tensordesc_meta):
    """triton 3.6's ``wrap_handle_tensordesc`` around the C entry ``launcher`` (its ``inner``, as written there)."""
    from triton.backends.nvidia import driver as nvidia

    def inner(*args):
        final_args = list(args[:13])
        tensordesc_idx = 0
        for i, arg in enumerate(args[13:]):
            if i in tensordesc_indices:
                final_args.extend(nvidia.make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner


@ts.cpu_parent
def test_tma_launch_passes_the_c_entry_what_tritons_wrapper_passes(monkeypatch):
    """``TmaLaunch`` calls a triton 3.6 launcher's C entry with the arguments Triton's descriptor wrapper passes it
    (each descriptor expanded in place by ``make_tensordesc_arg`` with its own metadata), encoding a descriptor once
    per address, shape and strides; a launcher of another shape or one that needs scratch memory gets none."""
    pytest.importorskip("triton.experimental.gluon.language")
    from types import SimpleNamespace
    from triton.backends.nvidia import driver as nvidia
    from flexsparse.triton.block_sparse import fwd_ws
    encoded = []

    def encode(descriptor, meta):
        encoded.append(descriptor.base.data_ptr())
        return [("map", descriptor.base.data_ptr(), tuple(descriptor.shape), meta["swizzle"]), *descriptor.shape,
                *descriptor.strides]

    monkeypatch.setattr(nvidia, "make_tensordesc_arg", encode)
    calls = []
    meta = [{"swizzle": 128}, {"swizzle": 64}]
    run = SimpleNamespace(launch=_triton36_wrapper(lambda *args: calls.append(args), {1, 4}, meta),
                          global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
                          launch_pdl=True)
    compiled = SimpleNamespace(run=run, function=7, packed_metadata=("metadata",))
    assert fast_launch.TmaLaunch.of(compiled) is None                 # triton 3.7's driver: no such launcher
    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT_LEN", 13, raising=False)
    tma = fast_launch.TmaLaunch.of(compiled)
    layout = fwd_ws.shared_layout(64, 64, fwd_ws.gl.bfloat16)
    x, y = torch.randn(256, 64).bfloat16(), torch.randn(512, 64).bfloat16()

    def values(a, b):
        return [123, fwd_ws.descriptor(a, [64, 64], layout), 5, None, fwd_ws.descriptor(b, [64, 64], layout), 0.5]

    for a, b, new in [(x, y, 2), (x, y, 0), (x[:128], y, 1), (y, x, 2), (x, y, 0)]:
        before = len(encoded)
        tma((3, 2, 1), "stream", compiled, values(a, b))
        assert len(encoded) - before == new
        run.launch(3, 2, 1, "stream", 7, False, True, None, None, ("metadata",), None, None, None, *values(a, b))
        assert calls[-2] == calls[-1]
    assert calls[-1][13:] == (123, ("map", x.data_ptr(), (256, 64), 128), 256, 64, 64, 1, 5, None,
                              ("map", y.data_ptr(), (512, 64), 64), 512, 64, 64, 1, 0.5)
    run.global_scratch_size = 64
    assert fast_launch.TmaLaunch.of(compiled) is None
    run.global_scratch_size, run.launch = 0, lambda *args: None
    assert fast_launch.TmaLaunch.of(compiled) is None


@triton.jit
def _scaled_copy_kernel(X, OUT, n, stride, factor, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs * stride, mask=ok)
    y = x * factor
    if ADD_ONE:
        y += 1
    tl.store(OUT + offs, y, mask=ok)


@ts.cpu_parent
def test_launch_key_separates_types_values_and_tensor_specializations(monkeypatch):
    """The eager key: equal for equal arguments (tensors of one dtype and alignment at other addresses), apart for
    equal scalars of other types, other int values, misaligned tensors and other constexprs; tensors launch as
    their addresses."""
    _stub_driver(monkeypatch)
    fast = FastLaunch(_scaled_copy_kernel)
    x, out = torch.empty(64), torch.empty(64)

    def key(*args, **kwargs):
        return fast._key((1,), args, {"BLOCK": 128, "ADD_ONE": False, "num_warps": 4, **kwargs})

    base, values, _ = key(x, out, 16, 1, 0.5)
    assert values == [x.data_ptr(), out.data_ptr(), 16, 1, 0.5, 128, False]
    assert key(torch.empty(64), torch.empty(64), 16, 1, 0.5)[0] == base
    others = [key(x, out, 16, 1, 1)[0], key(x, out, 16, 1, 1.0)[0], key(x, out, 16, 1, True)[0],
              key(x, out, 16, True, 0.5)[0], key(x, out, 32, 1, 0.5)[0], key(x[1:], out, 16, 1, 0.5)[0],
              key(x.double(), out, 16, 1, 0.5)[0], key(x, out, 16, 1, 0.5, ADD_ONE=True)[0]]
    assert len({base, *others}) == 1 + len(others)
    assert key(x, out, 16, 1, object())[0] is None                     # a type it cannot key: Triton's path


@ts.gpu
@pytest.mark.parametrize("n", [1, 16, 17, 4099])
@pytest.mark.parametrize("offset", [0, 1, 4])
@pytest.mark.parametrize("stride", [1, 2, 16])
def test_gpu_fast_launch_runs_triton_kernel_of_each_specialization(n, offset, stride):
    """Each call launches what ``JITFunction.run`` would (the same compiled kernel) and gets the same result, for
    misaligned pointers, lengths and strides that are 1, multiples of 16 or neither, keyword arguments, and equal
    scalars of other types (``1``, ``1.0``, ``True``: other specializations); a CPU tensor where the kernel was
    compiled for CUDA ones gets Triton's error."""
    fast = FastLaunch(_scaled_copy_kernel)
    base = torch.randn(offset + n * stride + 8, device="cuda")
    x = base[offset:]
    out = torch.full((n,), float("nan"), device="cuda")
    grid = (triton.cdiv(n, 128),)
    for add_one in (False, True):
        for _ in range(2):                                    # a miss, then a hit
            compiled = fast[grid](x, out, n, stride, 0.5, BLOCK=128, ADD_ONE=add_one, num_warps=4)
            want = x[: n * stride: stride] * 0.5 + (1 if add_one else 0)
            torch.testing.assert_close(out, want, rtol=0, atol=0)
            out.fill_(float("nan"))
        assert compiled is _scaled_copy_kernel.run(x, out, n, stride, 0.5, BLOCK=128, ADD_ONE=add_one, num_warps=4,
                                                   grid=grid, warmup=True)
    assert len(fast.compiled) == 2
    by_factor = {}
    for factor in (1, 1.0, True, 1):                          # equal values of three types: three kernels
        by_factor[type(factor)] = fast[grid](x, out, n, stride, factor, BLOCK=128, ADD_ONE=False, num_warps=4)
        torch.testing.assert_close(out, x[: n * stride: stride], rtol=0, atol=0)
        out.fill_(float("nan"))
    assert len({id(compiled) for compiled in by_factor.values()}) == 3 and len(fast.compiled) == 5
    with pytest.raises(ValueError, match="cpu tensor"):    # a CPU tensor misses and gets Triton's pointer check
        fast[grid](x.cpu(), out, n, stride, 0.5, BLOCK=128, ADD_ONE=True, num_warps=4)


@ts.gpu
@pytest.mark.parametrize("method, d, n, changes", [
    ("topk", 128, 2048, {}),                                  # warp-specialized forward and dQ
    ("topk", 64, 2048, {"topk": 24}),                         # forward and dK/dV (long CSC lists)
    ("sla", 64, 4096, {}),                                    # both SLA branches in one kernel
])
def test_gpu_fast_launch_runs_gluon_kernels_as_triton_does(monkeypatch, method, d, n, changes):
    """The warp-specialized Gluon kernels launch through ``FastLaunch`` once compiled: the compiled kernels it keeps
    are Triton's own for those arguments; the output equals that of Triton's path bit for bit, the gradients within
    bf16 tolerance."""
    ts.skip_unless_sm90()
    import flexsparse
    from flexsparse.triton.block_sparse import bwd_ws, fwd_ws
    from flexsparse.triton.linear import mix_ws
    kernels = {"topk": [fwd_ws._ws_fwd_kernel, bwd_ws._ws_dq_kernel if d == 128 else bwd_ws._ws_dkv_kernel],
               "sla": [mix_ws._ws_mix_kernel]}[method]
    for kernel in kernels:
        kernel.__dict__.pop("_flexsparse_fast", None)
    module = flexsparse.SparseAttention(ts.example_config(method, **changes), head_dim=d, num_heads=2, seq_len=n,
                                        backend="triton").cuda()
    inputs = [torch.randn(2, 2, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    grad = torch.randn_like(inputs[0])

    def run():
        """Output and gradients of q, k, v at fresh copies of the inputs (new addresses: new TMA descriptors)."""
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        out = module(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    monkeypatch.setattr(fast_launch, "ENABLED", False)
    want = run()
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    for _ in range(3):                                        # a miss, then hits
        got = run()
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        for got_grad, want_grad in zip(got[1:], want[1:]):
            torch.testing.assert_close(got_grad, want_grad)
    for kernel in kernels:
        fast = kernel.__dict__.get("_flexsparse_fast")
        assert fast is not None and fast.compiled, kernel.fn.__name__
        triton_cache = kernel.device_caches[torch.cuda.current_device()][0]
        assert all(any(c is t for t in triton_cache.values()) for c, _ in fast.compiled.values())


@ts.gpu
def test_gpu_encoded_tma_descriptors_follow_address_shape_and_strides(monkeypatch):
    """A Gluon kernel's launch with its TMA descriptors encoded once (``TmaLaunch``, on triton 3.6) equals Triton's
    own launch bit for bit: the same tensors again (kept encodings), a shorter view at the same address (another
    shape: another encoding) and fresh tensors."""
    ts.skip_unless_sm90()
    from flexsparse.triton.block_sparse import fwd_ws
    kernel = fwd_ws._ws_fwd_kernel
    kernel.__dict__.pop("_flexsparse_fast", None)
    n, block, topk = 2048, 64, 4
    q, k, v = (torch.randn(1, 1, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tables = {m: torch.stack([torch.randperm(m // block, device="cuda")[:topk] for _ in range(m // block)])
              .sort(-1).values.int().view(1, 1, m // block, topk).contiguous() for m in (n, n // 2)}

    def forward(m, fresh=False):
        args = [x[:, :, :m].clone() if fresh else x[:, :, :m] for x in (q, k, v)]
        return fwd_ws.ws_block_forward(*args, tables[m], block, block, 0.125)

    monkeypatch.setattr(fast_launch, "ENABLED", False)
    want = {m: forward(m) for m in (n, n // 2)}
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    for m, fresh in [(n, False), (n, False), (n, False), (n // 2, False), (n // 2, False), (n, False), (n, True),
                     (n // 2, True)]:
        for got, expected in zip(forward(m, fresh), want[m]):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    entries = list(kernel.__dict__["_flexsparse_fast"].compiled.values())
    assert entries
    if getattr(fast_launch.driver.active, "launcher_cls", None) is not None and triton.__version__.startswith("3.6"):
        tma = [launch for _, launch in entries if launch is not None]
        assert tma and all(len(encoded) >= 2 for launch in tma for _, _, encoded in launch.slots)
