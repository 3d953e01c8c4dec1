"""Input validation shared by the public entry points: clear errors that name the argument."""
from __future__ import annotations

import math
import numbers
import warnings

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q, k, v, *, self_attention: bool) -> None:
    """Check q ``(B, H, Nq, D)``, k, v ``(B, Hk, Nk, D)`` with ``H % Hk == 0``, one dtype and device."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, N, D) (4 dims), got {x.dim()} dims {tuple(x.shape)}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
        if x.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "meta":
        raise ValueError("q, k, v are on the meta device: the sparse methods select blocks from their values, which "
                         "meta tensors do not have; materialize them first (e.g. module.to_empty(device=...))")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head dim D, got {q.shape[3]} and {k.shape[3]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"the number of query heads ({q.shape[1]}) must be a multiple of the number of key/value heads "
            f"({k.shape[1]}) for grouped-query attention")
    if self_attention and q.shape[2] != k.shape[2]:
        raise ValueError(f"this method is self-attention: q and k must have the same length N, "
                         f"got {q.shape[2]} and {k.shape[2]}")


def resolve_scale(scale, head_dim: int) -> float:
    """``1/sqrt(D)`` when ``scale`` is None, else a positive finite float."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    return scale


def check_flag(name: str, value) -> None:
    """Raise unless ``value`` is a bool (``return_lse="no"`` must not read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_positive_int(name: str, value) -> None:
    """Raise unless ``value`` is an int >= 1 (bools excluded)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def clamp_topk(name: str, topk: int, available: int, what: str) -> int:
    """``min(topk, available)``: a top-K that covers every block there is selects them all, which is exact dense
    attention over them (a model trained long runs at a short length). Warns once per clamp (config key, K, blocks),
    in eager calls (a warning inside a compiled graph would break it)."""
    if topk <= available:
        return topk
    key = (name, topk, available, what)
    if key not in _CLAMPED and not torch.compiler.is_compiling():
        _CLAMPED.add(key)
        warnings.warn(f"config key {name!r}={topk} covers all {available} {what}: clamped to {available}, every one "
                      f"of them selected (exact dense attention over them)", stacklevel=2)
    return available


_CLAMPED: set[tuple] = set()
