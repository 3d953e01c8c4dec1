"""The ``torch`` backend: gather-based PyTorch with autograd on CPU and GPU (the steps of ``Backend`` as they are).

No N x N tensor is built; computations in fp32 (fp64 for fp64 inputs); padding never enters a softmax.
"""
from __future__ import annotations

from .base import Backend


class TorchBackend(Backend):
    """Every step in PyTorch: selection, the sparse branches by gathers, the linear branches, FP8 fake quantization
    with every ``quant`` setting."""

    name = "torch"
