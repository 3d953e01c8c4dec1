"""FP8 quantization-aware training of a sparse softmax branch (SLA2 Sec. 5, SageAttention2 granularity).

Forward (the fake-quant spec; docs/methods.md "FP8 QAT"): K smoothed (``k - mean_N k``; ``smooth_keys``), Q and K
fake-quantized (e4m3, or int8 with ``qk_dtype="int8"``) per block of the method's query / key blocks
(or per (b, h) with ``qk="per_tensor"``), V per channel (or per (b, h)), and with ``p="static"`` the
softmax numerator ``P~ = exp(S - m)`` (m the row max over the attended keys) fake-quantized with the
static scale 448:
``O = q(P~) V^ / rowsum(P~)``, ``lse = m + log rowsum(P~) + scale * q^ . mean_N(k)``.
Backward (SLA2 Sec. 5, "backward(dO_s, O_s, Q, K, V)" in 16 bits): the branch's softmax backward on the
unquantized q, k, v evaluated at the quantized forward's ``O`` and LSE: ``P = exp(S - lse_q)`` over the attended
keys, ``dV = P^T dO``, ``dS = P (dO V^T - Delta)`` with ``Delta = rowsum(dO O_q) - dLSE``. No gradient is rounded
to FP8. A kernel runs it directly (the triton backend's ``flexsparse::block_attn_fp8``); ``qat_attention`` gets it
from the unquantized branch by autograd (``at_quantized_statistics``).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..config import QuantConfig
from ..masks import accumulation_dtype, kv_head_index
from .formats import P_SCALE, channel_scales, fake_quant, fake_quant_blocks, head_scales

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "QuantConfig | None"],
                  "tuple[torch.Tensor, torch.Tensor | None]"]


def quantize_qk(x: torch.Tensor, quant: QuantConfig, block: int) -> torch.Tensor:
    """Fake-quantized Q or (smoothed) K ``(B, H, N, D)`` in ``quant.qk_dtype``: per block of ``block``
    tokens or per (b, h)."""
    if quant.qk == "per_block":
        return fake_quant_blocks(x, block, quant.qk_dtype)
    return fake_quant(x, head_scales(x, quant.qk_dtype), quant.qk_dtype)


def quantize_v(v: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """Fake-quantized V ``(B, H, N, D)``: per channel over the tokens or per (b, h)."""
    return fake_quant(v, channel_scales(v) if quant.v == "per_channel" else head_scales(v))


def quantize_kv(k: torch.Tensor, v: torch.Tensor, quant: QuantConfig,
                block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake-quantized (smoothed) K per block of ``block_k`` tokens (or per (b, h)) and V (``quantize_v``)."""
    return quantize_qk(k, quant, block_k), quantize_v(v, quant)


def quantizes_p(quant: QuantConfig | None) -> bool:
    """Whether the softmax numerator is fake-quantized (``p="static"``)."""
    return quant is not None and quant.p == "static"


def quantized_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax weights with an FP8 numerator: ``q(exp(S - m)) / rowsum(exp(S - m))`` over the last dim.

    ``m`` is the row max (``-inf`` entries are keys that are not attended), q the e4m3 fake quantization
    with the static scale 448 (the numerator is in [0, 1]); the denominator is not quantized.
    Returns the weights (same shape) and the natural-log LSE ``m + log rowsum`` (last dim dropped).
    """
    m = logits.amax(dim=-1, keepdim=True)
    p = torch.exp(logits - m)
    total = p.sum(dim=-1, keepdim=True)
    return fake_quant(p, P_SCALE) / total, (m + total.log()).squeeze(-1)


def at_quantized_statistics(o: torch.Tensor, lse: torch.Tensor, o_q: torch.Tensor,
                            lse_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The values ``o_q (B, H, N, D)``, ``lse_q (B, H, N)`` of the quantized forward with the gradients of the
    softmax backward at them (module docstring), from the unquantized branch's differentiable ``o``, ``lse``.

    ``r = exp(lse - lse_q)`` is the row sum of ``P = exp(S - lse_q)`` and ``o r = P V``, so the gradients of
    ``<dO, o r> - <dO, O_q> r + dLSE r`` are ``dV = P^T dO`` and ``dS = P (dO V^T - rowsum(dO O_q) + dLSE)``.
    Every added term is 0 in value (``x - x.detach()``); a row without keys (``lse_q = -inf``) has ``r = 0``."""
    keys = torch.isfinite(lse_q)
    r = torch.where(keys, torch.exp(lse - torch.where(keys, lse_q, 0).detach()), 0)
    moved = (r - r.detach())[..., None]
    direct = o.to(r.dtype) * r[..., None]
    out = o_q.detach().to(r.dtype) * (1 - moved) + (direct - direct.detach())
    return out.to(o_q.dtype), lse_q.detach().to(lse.dtype) + (r - r.detach())


def qat_attention(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quant: QuantConfig | None, *,
                  block_q: int, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A softmax branch with an FP8 fake-quantized forward and the QAT gradient (module docstring;
    ``quant=None``: just ``attend(q, k, v, None)``).

    attend(q, k, v, quant) -> (o, lse): the branch on any backend; with a ``QuantConfig`` it
    fake-quantizes its own K and V (``quantize_qk``/``quantize_v`` with its key-block layout) and,
    with ``quant.p == "static"``, its P (``quantized_softmax``); with None it is the plain branch.
    q: ``(B, H, N, D)`` (quantized here per block of ``block_q`` tokens); k, v: ``(B, Hk, N, D)``.
    Returns o in q's dtype and the LSE (or None when ``attend`` gives none) of the quantized forward. When q, k
    or v need gradients the unquantized branch runs too (``at_quantized_statistics``); a branch without an LSE
    passes the unquantized branch's gradients straight through.
    """
    if quant is None:
        return attend(q, k, v, None)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    with torch.no_grad():
        o_q, lse_q = _quantized_forward(attend, q, k, v, quant, block_q, scale)
        o_q = o_q.to(q.dtype)
    if not needs_grad:
        return o_q, lse_q
    o, lse = attend(q, k, v, None)
    if lse is None or lse_q is None:
        return o_q + (o - o.detach()), None
    return at_quantized_statistics(o, lse, o_q, lse_q)


def _quantized_forward(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quant: QuantConfig,
                       block_q: int, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fake-quantized forward of ``qat_attention``: smooth K (``quant.smooth_keys``), quantize Q,
    ``attend(q^, k_s, v, quant)``, LSE shifted back to the unsmoothed logits."""
    acc = accumulation_dtype(q.dtype)
    q_hat = quantize_qk(q, quant, block_q)
    if not quant.smooth_keys:
        return attend(q_hat, k.to(acc), v, quant)
    k_mean = k.mean(dim=2, keepdim=True, dtype=acc)       # the Triton pre-pass's up to fp32 rounding
    o_q, lse_q = attend(q_hat, k.to(acc) - k_mean, v, quant)
    if lse_q is not None:                   # smoothing shifted each row's logits by scale * q^ . mean(k)
        k_mean = k_mean[:, kv_head_index(q.shape[1], k.shape[1], q.device)]
        lse_q = lse_q + scale * (q_hat @ k_mean.transpose(-1, -2)).squeeze(-1).to(lse_q.dtype)
    return o_q, lse_q
