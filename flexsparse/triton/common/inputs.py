"""Inputs of the Triton ops: where the kernels run (CUDA, or CPU under the interpreter; fp16 / bf16 / fp32) and the
layouts they read (contiguous tensors, or views whose last dim is contiguous), with the differentiable
``flexsparse::contiguous_rows`` copy that the triton backend makes of strided q, k, v once per call."""
from __future__ import annotations

import os

import torch
from torch import Tensor

from .._runtime.registry import triton_op

KERNEL_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))


def interpreting() -> bool:
    """Whether the Triton interpreter is on (it must be set before the kernel modules are imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_kernels(x: Tensor) -> bool:
    """Whether an op on ``x`` runs the Triton kernels (else the torch fallback): CUDA, or CPU with the
    interpreter; fp16/bf16/fp32 only."""
    if x.dtype not in KERNEL_DTYPES:
        return False
    return x.is_cuda or (x.device.type == "cpu" and interpreting())


def contiguous(*tensors: Tensor) -> list[Tensor]:
    """The tensors made contiguous (the kernels take strides of the leading dims only). A ``(B, H, N, D)`` view with
    contiguous rows, e.g. an upstream gradient through a model's ``out.transpose(1, 2).reshape(B, N, H * D)``, is
    copied by the row-copy kernel (``rows``), twice as fast as PyTorch's strided copy."""
    return [t if t.is_contiguous() else _copied(t) for t in tensors]


def row_views(*tensors: Tensor) -> list[Tensor]:
    """The tensors as they are where their last dim is contiguous (kernels that take the other strides read such
    views in place, e.g. q, k, v of one fused projection), else contiguous copies (``contiguous``)."""
    return [t if t.stride(-1) == 1 else _copied(t) for t in tensors]


def _copied(t: Tensor) -> Tensor:
    """A contiguous copy of the non-contiguous ``t`` (``contiguous``)."""
    if t.dim() == 4 and t.stride(-1) == 1 and use_kernels(t):
        from .rows import copy_rows
        return copy_rows(t)
    return t.contiguous()


@triton_op("flexsparse::contiguous_rows")
def contiguous_rows(x: Tensor) -> Tensor:
    """A new contiguous tensor with the values of ``x (B, H, N, D)``: kernel ``rows`` where x's last dim is contiguous
    (the speed of a contiguous clone), else PyTorch's copy (``contiguous``). The gradient passes through unchanged."""
    return x.clone() if x.is_contiguous() else _copied(x)


contiguous_rows.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)
