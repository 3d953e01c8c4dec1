"""Dense reference of LLSA (log-linear sparse attention), any L, any N, GQA."""
from __future__ import annotations

import torch

from ...config import QuantConfig
from ...masks import LLSASelection, level_span
from ...quant import qat_attention, quantize_kv, quantizes_p
from ..dense import expand_kv_heads, masked_softmax_attention, span_means


def llsa_select_bruteforce(q: torch.Tensor, k: torch.Tensor, topk: tuple[int, ...], block: int) -> LLSASelection:
    """LLSA selection by brute force: full raw-dot score matrices at every level, candidates
    restricted to the children of the parent's selection; ties -> smallest key id.
    q: ``(B, H, N, D)``, k: ``(B, Hk, N, D)``."""
    n, levels = q.shape[2], len(topk)
    k = expand_kv_heads(k, q.shape[1])
    qs = [span_means(q, level_span(n, block, l)) for l in range(levels + 1)]
    ks = [span_means(k, level_span(n, block, l)) for l in range(levels + 1)]
    selected: list[torch.Tensor] = [None] * (levels + 2)
    for level in range(levels, 0, -1):
        scores = qs[level] @ ks[level].transpose(-1, -2)                  # (B, H, T_l, T_l)
        if level < levels:
            parent = selected[level + 1]                                  # (B, H, T_{l+1}, K)
            allowed = torch.zeros(*parent.shape[:3], -(-scores.shape[-1] // block), dtype=torch.bool, device=q.device)
            allowed.scatter_(-1, parent.long(), True)
            rows = torch.arange(scores.shape[-2], device=q.device) // block
            cols = torch.arange(scores.shape[-1], device=q.device) // block
            scores = scores.masked_fill(~allowed[:, :, rows][:, :, :, cols], float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : topk[level - 1]]
        selected[level] = order.sort(-1).values.to(torch.int32)
    return LLSASelection(indices=tuple(selected[1:levels + 1]), block=block, n=n)


def llsa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: LLSASelection, scale: float,
               k_levels: list[torch.Tensor] | None = None, v_levels: list[torch.Tensor] | None = None,
               quant: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LLSA output and LSE by explicit masks over every level's tokens.

    Fine query n attends: at level l < L the level-l tokens t with ``t // b`` in
    ``S_{l+1}[n // b^{l+1}]``; at level L all tokens. A level-l token's logit gets
    ``+ ln(#real fine tokens under it)`` (a level whose span ``b^l`` reaches past N: one token of all N).
    Levels 1..L are direct means of the real fine tokens, or the given ``k_levels``/``v_levels``
    (``(B, Hk, T_l, D)``, l = 1..L) so that tests can make them independent leaves. ``quant``: FP8 fake-quantized
    forward (Q per block of b fine tokens, every level's K per block of b tokens of that level, V per channel per
    level), QAT backward.
    """
    if quant is not None and k_levels is not None:
        raise ValueError("llsa_dense: quant needs levels pooled from k, v (smoothing K shifts every level), "
                         "not given k_levels/v_levels")
    b, n, levels = selection.block, q.shape[2], selection.levels
    heads = q.shape[1]
    fine = torch.arange(n, device=q.device)
    masks, biases = [], []
    for level in range(levels + 1):
        span = level_span(n, b, level)
        t = -(-n // span)
        counts = torch.tensor([min(span, n - i * span) for i in range(t)], dtype=q.dtype, device=q.device)
        biases.append(counts.log())
        if level == levels:
            masks.append(None)
            continue
        parent = selection.indices[level].long()                          # S_{level+1}
        chosen = torch.zeros(*parent.shape[:3], -(-t // b), dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, parent, True)
        rows = fine // level_span(n, b, level + 1)
        cols = torch.arange(t, device=q.device) // b
        masks.append(chosen[:, :, rows][:, :, :, cols])

    def attend(q, k, v, quant):
        keys, values = [k], [v]
        for level in range(1, levels + 1):
            keys.append(k_levels[level - 1] if k_levels is not None else span_means(k, level_span(n, b, level)))
            values.append(v_levels[level - 1] if v_levels is not None else span_means(v, level_span(n, b, level)))
        if quant is not None:
            keys, values = map(list, zip(*(quantize_kv(x, y, quant, b) for x, y in zip(keys, values))))
        return masked_softmax_attention(q, [expand_kv_heads(x, heads) for x in keys],
                                        [expand_kv_heads(x, heads) for x in values], masks, biases, scale,
                                        quantize_p=quantizes_p(quant))

    return qat_attention(attend, q, k, v, quant, block_q=b, scale=scale)
