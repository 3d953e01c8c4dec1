"""Quantization formats of attention tensors: FP8 e4m3 (and INT8 for Q, K): scales at several
granularities, saturating casts, fake quantization (quantize, then dequantize).

Convention (torchao's): a scale ``s`` is the multiplier ``qmax / amax`` (fp32, ``amax`` clamped at
1e-12; ``qmax`` = 448 for e4m3 through torchao's ``amax_to_scale``, 127 for int8); the quantized value is
``e4m3(clamp(x * s, -448, 448))`` (torchao's ``to_fp8_saturated``: the clamp comes before the cast,
because torch 2.11 eager casts 500 to NaN instead of 448) or ``round_half_even(clamp(x * s, -127, 127))``,
and the dequantized value is the quantized one divided by ``s``. Products ``x * s`` are taken in the
accumulation dtype (fp32, fp64 for fp64 inputs) and fake-quantized values are returned in it.

Granularities over the token dim -2 of ``(B, H, N, D)`` tensors: per block of ``block`` tokens x D
(``block_scales``), per channel over all N tokens (``channel_scales``), per (batch, head) slice
(``head_scales``), and the static scale 448 of values in [0, 1] (``P_SCALE``).

torchao is optional (extra ``quant``); it is imported on first use, with a clear error when missing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import accumulation_dtype, num_blocks

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
INT8_MAX = 127.0
FORMATS = ("fp8_e4m3", "int8")
P_SCALE = E4M3_MAX
"""Static e4m3 scale of the softmax numerator ``exp(S - m)`` in [0, 1]: no amax needed."""


def _float8_utils():
    """``torchao.float8.float8_utils``, or an ImportError that says how to install it."""
    try:
        from torchao.float8 import float8_utils
    except ImportError as err:
        raise ImportError("FP8 quantization (config key 'quant', the DiT example's --fp8-linear) needs torchao: "
                          "pip install 'flexsparse[quant]' (torchao>=0.17,<0.19)") from err
    return float8_utils


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; valid: {list(FORMATS)}")


def _as(scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor | float:
    return scale.to(dtype) if isinstance(scale, torch.Tensor) else scale


def amax_to_scale(amax: torch.Tensor, fmt: str = "fp8_e4m3") -> torch.Tensor:
    """``qmax / max(amax, 1e-12)`` in fp32, same shape as ``amax`` (e4m3: torchao's ``amax_to_scale``)."""
    if fmt == "fp8_e4m3":
        return _float8_utils().amax_to_scale(amax, E4M3)
    _check_format(fmt)
    return (INT8_MAX / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)


def to_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Saturating cast ``e4m3(clamp(x * scale, -448, 448))`` (``scale`` broadcasts against ``x``)."""
    acc = accumulation_dtype(x.dtype)
    return _float8_utils().to_fp8_saturated(x.to(acc) * _as(scale, acc), E4M3)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "fp8_e4m3") -> torch.Tensor:
    """The grid values that ``x * scale`` rounds to (saturated), in the accumulation dtype: e4m3 values
    (``to_e4m3``) or the int8 integers (round half to even of the product clamped to +-127)."""
    acc = accumulation_dtype(x.dtype)
    if fmt == "fp8_e4m3":
        return to_e4m3(x, scale).to(acc)
    _check_format(fmt)
    return torch.round((x.to(acc) * _as(scale, acc)).clamp(-INT8_MAX, INT8_MAX))


def fake_quant(x: torch.Tensor, scale: torch.Tensor | float, fmt: str = "fp8_e4m3") -> torch.Tensor:
    """Quantize with ``scale`` and dequantize: ``quantize(x, scale, fmt) / scale`` in the accumulation dtype."""
    return quantize(x, scale, fmt) / _as(scale, accumulation_dtype(x.dtype))


def _token_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B, H, T, block, D)``, the ragged tail zero padded (zeros never raise an amax)."""
    t = num_blocks(x.shape[2], block)
    return F.pad(x, (0, 0, 0, t * block - x.shape[2])).unflatten(2, (t, block))


@torch.no_grad()
def block_scales(x: torch.Tensor, block: int, fmt: str = "fp8_e4m3") -> torch.Tensor:
    """One scale per block of ``block`` tokens x D per (b, h): ``(B, H, N, D)`` -> ``(B, H, ceil(N/block), 1)``."""
    return amax_to_scale(_token_blocks(x, block).abs().amax(dim=(-2, -1)), fmt).unsqueeze(-1)


@torch.no_grad()
def channel_scales(x: torch.Tensor, fmt: str = "fp8_e4m3") -> torch.Tensor:
    """One scale per channel over all tokens per (b, h): ``(B, H, N, D)`` -> ``(B, H, 1, D)``."""
    return amax_to_scale(torch.linalg.vector_norm(x, float("inf"), dim=2, keepdim=True), fmt)  # no |x| copy


@torch.no_grad()
def head_scales(x: torch.Tensor, fmt: str = "fp8_e4m3") -> torch.Tensor:
    """One scale per (b, h) slice of all tokens and channels: ``(B, H, N, D)`` -> ``(B, H, 1, 1)``."""
    return amax_to_scale(x.abs().amax(dim=(2, 3), keepdim=True), fmt)


def quantize_blocks(x: torch.Tensor, block: int, fmt: str = "fp8_e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """``x (B, H, N, D)`` quantized with one scale per block of ``block`` tokens (``block_scales``): the grid values
    ``(B, H, N, D)`` in the accumulation dtype (``quantize``) and the scales ``(B, H, T, 1)``."""
    scale = block_scales(x, block, fmt)
    values = quantize(_token_blocks(x, block), scale.unsqueeze(-1), fmt).flatten(2, 3)[:, :, : x.shape[2]]
    return values, scale


def fake_quant_blocks(x: torch.Tensor, block: int, fmt: str = "fp8_e4m3") -> torch.Tensor:
    """Fake-quantize ``x (B, H, N, D)`` with one scale per block of ``block`` tokens: ``quantize_blocks``' values
    divided by their block's scale, in the accumulation dtype."""
    values, scale = quantize_blocks(x, block, fmt)
    return (_token_blocks(values, block) / scale.unsqueeze(-1).to(values.dtype)).flatten(2, 3)[:, :, : x.shape[2]]
