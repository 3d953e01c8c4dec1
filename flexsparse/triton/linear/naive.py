"""Linear-attention branches of SLA / SLA2 in plain PyTorch (gather-based, autograd).

``O_l = phi(Q) H / (eps + phi(Q) . Z)`` with ``H = sum_j phi(K_j)^T V_j`` and ``Z = sum_j colsum phi(K_j)``
over the keys the branch sees. phi acts on the head dim. Computations in fp32 (fp64 for fp64 inputs),
outputs in the input dtype. Padded keys have ``phi = 0`` and padded queries are dropped, so padding
never contributes. GQA: K/V heads divide Q heads.
"""
from __future__ import annotations

import torch

import torch.nn.functional as F

from ...masks import BlockSelection, accumulation_dtype, keep_map, kv_head_index
from ..common.gather import gather_blocks, pad_tokens

Tensor = torch.Tensor


def apply_feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """phi over the last dim in the accumulation dtype: ``softmax``, ``elu`` (elu + 1) or ``relu`` (softmax
    converts inside its kernel: no accumulation-dtype copy of x)."""
    if name == "softmax":
        return torch.softmax(x, dim=-1, dtype=accumulation_dtype(x.dtype))
    x = x.to(accumulation_dtype(x.dtype))
    if name == "elu":
        return F.elu(x) + 1
    if name == "relu":
        return torch.relu(x)
    raise ValueError(f"unknown feature map {name!r}; valid: ['softmax', 'elu', 'relu']")


def feature_map_backward(x: torch.Tensor, phi: torch.Tensor, grad: torch.Tensor, name: str) -> torch.Tensor:
    """Gradient w.r.t. ``x`` of ``phi = apply_feature_map(x, name)`` given ``grad = dL/dphi`` (same shapes),
    in phi's dtype: softmax ``phi * (grad - rowsum(grad * phi))``, elu ``grad * (x > 0 ? 1 : phi)``,
    relu ``grad * (x > 0)``."""
    if name == "softmax":
        return phi * (grad - (grad * phi).sum(-1, keepdim=True))
    positive = x > 0
    if name == "elu":
        return grad * torch.where(positive, 1.0, phi)
    if name == "relu":
        return grad * positive
    raise ValueError(f"unknown feature map {name!r}; valid: ['softmax', 'elu', 'relu']")


def skipped_blocks(selection: BlockSelection) -> torch.Tensor:
    """Key blocks the masked linear branch leaves out per query block: the selected ones, then the
    excluded ones: ``(B, H, Tq, K + Kx)`` int32."""
    if selection.excluded is None:
        return selection.indices
    return torch.cat([selection.indices, selection.excluded], dim=-1)


def _global_state(phi_k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``H = phi(K)^T V`` ``(B, H, D, D)`` and ``Z = colsum phi(K)`` ``(B, H, D)`` per query head."""
    idx = kv_head_index(heads, phi_k.shape[1], phi_k.device)
    return (phi_k.transpose(-1, -2) @ v)[:, idx], phi_k.sum(2)[:, idx]


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, feature_map: str,
                     eps: float) -> torch.Tensor:
    """Linear attention over all keys (SLA ``linear="full"``).

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``. Returns ``(B, H, Nq, D)`` in q's dtype.
    """
    acc = accumulation_dtype(q.dtype)
    phi_q = apply_feature_map(q, feature_map)
    h, z = _global_state(apply_feature_map(k, feature_map), v.to(acc), q.shape[1])
    out = (phi_q @ h) / (eps + (phi_q @ z.unsqueeze(-1)))
    return out.to(q.dtype)


def masked_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, *,
                            feature_map: str, eps: float) -> torch.Tensor:
    """Linear attention of each query block over the key blocks that are neither selected nor excluded.

    Computed as global sums minus the skipped blocks, gathered like the sparse branch:
    numerator ``phi(Q_i) H - sum_{j skipped} (phi(Q_i) phi(K_j)^T) V_j``, denominator
    ``phi(Q_i) . Z - rowsum(phi(Q_i) phi(K_j)^T)``; memory O(N * skipped * block_k). When the skipped
    blocks are every block the output is exactly 0. The subtraction loses relative precision when
    the remaining keys carry a tiny fraction of the global mass (fp32: ~1e-7 / fraction).
    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``. Returns ``(B, H, Nq, D)`` in q's dtype.
    """
    acc = accumulation_dtype(q.dtype)
    bq, bk = selection.block_q, selection.block_k
    tq, tk = selection.num_q_blocks, selection.num_k_blocks
    skipped = skipped_blocks(selection)
    if skipped.shape[-1] == tk:
        return q.new_zeros(q.shape)
    phi_q = pad_tokens(apply_feature_map(q, feature_map), tq * bq).unflatten(2, (tq, bq))
    phi_k = pad_tokens(apply_feature_map(k, feature_map), tk * bk)
    values = pad_tokens(v.to(acc), tk * bk)
    h, z = _global_state(phi_k, values, q.shape[1])
    a = phi_q @ gather_blocks(phi_k, skipped, bk).transpose(-1, -2)            # (B, H, Tq, bq, S * bk)
    num = phi_q @ h.unsqueeze(2) - a @ gather_blocks(values, skipped, bk)
    den = phi_q @ z[:, :, None, :, None] - a.sum(-1, keepdim=True)
    out = num / (eps + den)
    return out.flatten(2, 3)[:, :, : q.shape[2]].to(q.dtype)


def weighted_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weights: torch.Tensor,
                              block_q: int, block_k: int, *, feature_map: str, eps: float) -> torch.Tensor:
    """Linear attention with a weight per (query block, key block): ``H_i = sum_j w_ij h_j``.

    Dense over blocks (O(Tq * Tk * D^2) work, ``(B, H, Tq, D, D)`` memory): SLA2's stage-1 soft
    router, where ``w = 1 - M``. The normaliser in fp32 (fp64); for bf16 inputs the ``D x D`` state
    matmuls run in bf16 with fp32 accumulation (bf16 states, as the Triton kernels keep them), the
    others in fp32 (fp64). q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``;
    weights: ``(B, H, Tq, Tk)`` (differentiable). Returns ``(B, H, Nq, D)`` in q's dtype.
    """
    acc = accumulation_dtype(q.dtype)
    states = torch.bfloat16 if q.dtype == torch.bfloat16 else acc
    _, heads, tq, tk = weights.shape
    kv_heads, d = k.shape[1], q.shape[-1]
    phi_q = pad_tokens(apply_feature_map(q, feature_map), tq * block_q).unflatten(2, (tq, block_q))
    phi_k = pad_tokens(apply_feature_map(k, feature_map), tk * block_k).unflatten(2, (tk, block_k))
    values = pad_tokens(v.to(states), tk * block_k).unflatten(2, (tk, block_k))
    h = (phi_k.to(states).transpose(-1, -2) @ values).flatten(-2)              # (B, Hk, Tk, D*D)
    z = phi_k.sum(-2)                                                           # (B, Hk, Tk, D)
    w = weights.to(acc).unflatten(1, (kv_heads, heads // kv_heads))             # (B, Hk, G, Tq, Tk)
    h_rows = (w.to(states) @ h.unsqueeze(2)).unflatten(-1, (d, d)).flatten(1, 2)  # (B, H, Tq, D, D)
    z_rows = (w @ z.unsqueeze(2)).flatten(1, 2)                                 # (B, H, Tq, D)
    num = phi_q.to(states) @ h_rows                                             # promoted by the division
    den = (phi_q * z_rows.unsqueeze(-2)).sum(-1, keepdim=True)                  # a fused reduction when compiled
    out = num / (eps + den)
    return out.flatten(2, 3)[:, :, : q.shape[2]].to(q.dtype)


def keep_weighted_linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skipped: torch.Tensor, num_k_blocks: int,
                         block_q: int, block_k: int, feature_map: str, eps: float) -> torch.Tensor:
    """``weighted_linear_attention`` with the 0/1 weights ``1 - M`` of the skipped blocks ``(B, H, Tq, S)``: the
    masked linear branch through block-level matmuls (O(Tq * Tk * D^2) work, no cancellation)."""
    keep = keep_map(skipped, num_k_blocks, accumulation_dtype(q.dtype))
    return weighted_linear_attention(q, k, v, keep, block_q, block_k, feature_map=feature_map, eps=eps)


def pad_blocks(x: Tensor, blocks: int, size: int) -> Tensor:
    """``(B, H, N, C)`` -> ``(B, H, blocks, size, C)``, zero padded (a view when N fills the blocks)."""
    if blocks * size > x.shape[2]:
        x = F.pad(x, (0, 0, 0, blocks * size - x.shape[2]))
    return x.unflatten(2, (blocks, size))


def features(q: Tensor, k: Tensor, v: Tensor, tq: int, block_q: int, tk: int, block_k: int, feature_map: str):
    """``phi(Q)`` ``(B, H, Tq, bq, D)``, ``phi(K)`` ``(B, Hk, Tk, bk, D)`` and ``[V | 1]`` ``(B, Hk, Tk, bk, D + 1)``
    in the accumulation dtype; padded tokens are all zero."""
    acc = accumulation_dtype(q.dtype)
    phi_q = pad_blocks(apply_feature_map(q, feature_map).to(acc), tq, block_q)
    phi_k = pad_blocks(apply_feature_map(k, feature_map).to(acc), tk, block_k)
    v_aug = pad_blocks(F.pad(v.to(acc), (0, 1), value=1.0), tk, block_k)
    return phi_q, phi_k, v_aug


def group_sum(x: Tensor, kv_heads: int) -> Tensor:
    """Sum over the query heads of each KV head: ``(B, H, ...)`` -> ``(B, Hk, ...)``."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads)).sum(2)


def query_states(total: Tensor, states: Tensor, skipped: Tensor) -> Tensor:
    """``total[kv] - sum_{j in skipped[b, h, i]} states[b, kv, j]`` per query block by a gather: ``(B, H, Tq, M)``."""
    bsz, heads, tq, width = skipped.shape
    m = states.shape[-1]
    kv = kv_head_index(heads, states.shape[1], states.device)
    ids = skipped.long().flatten(2).unsqueeze(-1).expand(-1, -1, -1, m)
    picked = states[:, kv].gather(2, ids).view(bsz, heads, tq, width, m)
    return total[:, kv].unsqueeze(2) - picked.sum(3)


def key_states(total: Tensor, grads: Tensor, skipped: Tensor, tk: int) -> Tensor:
    """``total[b, kv] - sum_{h of kv} sum_{i: j in skipped[b, h, i]} grads[b, h, i]`` per key block by a
    scatter-add: ``(B, Hk, Tk, M)``."""
    bsz, heads, tq, width = skipped.shape
    m = total.shape[-1]
    ids = skipped.long().flatten(2).unsqueeze(-1).expand(-1, -1, -1, m)
    src = grads.unsqueeze(3).expand(-1, -1, -1, width, -1).flatten(2, 3)
    sums = grads.new_zeros(bsz, heads, tk, m).scatter_add_(2, ids, src)
    return total.unsqueeze(2) - group_sum(sums, total.shape[1])


def masked_linear_with_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skipped: torch.Tensor, block_q: int,
                              block_k: int, feature_map: str, eps: float):
    """``flexsparse::masked_linear``'s CPU branch: ``(o, H_i, Z_i)``, the masked linear branch from the key-block
    states ``[h_j | z_j]`` and its query-block states ``(B, H, Tq, D, D)``, ``(B, H, Tq, D)`` in the accumulation
    dtype. skipped ``(B, H, Tq, S)`` int32, S < Tk."""
    nq, d = q.shape[2], q.shape[3]
    tq, tk = skipped.shape[2], -(-k.shape[2] // block_k)
    phi_q, phi_k, v_aug = features(q, k, v, tq, block_q, tk, block_k, feature_map)
    states = (phi_k.transpose(-1, -2) @ v_aug).flatten(-2)                    # (B, Hk, Tk, D (D + 1))
    rows = query_states(states.sum(2), states, skipped)
    state_q = rows.unflatten(-1, (d, d + 1))                                    # (B, H, Tq, D, D + 1)
    out = (phi_q @ state_q[..., :d]) / (eps + phi_q @ state_q[..., d:])          # (B, H, Tq, bq, D)
    return out.flatten(2, 3)[:, :, :nq].to(q.dtype), state_q[..., :d].contiguous(), state_q[..., d].contiguous()


def masked_linear_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, skipped: Tensor, rows_h: Tensor,
                           rows_z: Tensor, block_q: int, block_k: int, feature_map: str, eps: float):
    """``flexsparse::masked_linear_bwd``'s CPU branch: ``(dq, dk, dv)`` of the masked linear branch from its
    query-block states (the op's docstring gives the math)."""
    nq, d = q.shape[2], q.shape[3]
    tq, tk = skipped.shape[2], -(-k.shape[2] // block_k)
    phi_q, phi_k, v_aug = features(q, k, v, tq, block_q, tk, block_k, feature_map)
    rows = torch.cat([rows_h, rows_z.unsqueeze(-1)], dim=-1).to(phi_q.dtype)   # (B, H, Tq, D, D + 1)
    y = phi_q @ rows
    den = eps + y[..., d:]
    out = y[..., :d] / den
    g = pad_blocks(do.to(out.dtype), tq, block_q)
    dy = torch.cat([g, -(g * out).sum(-1, keepdim=True)], dim=-1) / den      # (B, H, Tq, bq, D + 1)
    dphi_q = dy @ rows.transpose(-1, -2)
    d_rows = (phi_q.transpose(-1, -2) @ dy).flatten(-2)                         # (B, H, Tq, D (D + 1))
    kv_heads = k.shape[1]
    d_states = key_states(group_sum(d_rows.sum(2), kv_heads), d_rows, skipped, tk)
    d_states = d_states.unflatten(-1, (d, d + 1))                               # (B, Hk, Tk, D, D + 1)
    dphi_k = v_aug @ d_states.transpose(-1, -2)
    dv = (phi_k @ d_states)[..., :d]
    dq = feature_map_backward(q, phi_q.flatten(2, 3)[:, :, :nq], dphi_q.flatten(2, 3)[:, :, :nq], feature_map)
    nk = k.shape[2]
    dk = feature_map_backward(k, phi_k.flatten(2, 3)[:, :, :nk], dphi_k.flatten(2, 3)[:, :, :nk], feature_map)
    return dq.to(q.dtype), dk.to(k.dtype), dv.flatten(2, 3)[:, :, :nk].to(v.dtype)


def lerp_mix_backward(dout: torch.Tensor, o_s: torch.Tensor, o_l: torch.Tensor, alpha_logit: torch.Tensor,
                      block_q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of SLA2's combine ``out = O_l + alpha (o_s - O_l)``, ``alpha = sigmoid(alpha_logit)``: ``(d o_s,
    d O_l, partial (B, H, Tq))``, the partial of the logit's gradient fp32 per batch element and head
    (``flexsparse::lerp_mix_bwd``'s CPU branch; the op sums it). dout, o_s, o_l ``(B, H, Nq, D)``; alpha_logit
    ``(1 or H, Tq)``, any float dtype (alpha, its fp32 sigmoid, rounded to dout's: the forward's mixing value)."""
    bsz, heads, n, d = dout.shape
    tq = alpha_logit.shape[-1]
    alpha = torch.sigmoid(alpha_logit.float())
    a = alpha.to(dout.dtype)[:, torch.arange(n, device=dout.device) // block_q].unsqueeze(-1)
    a = a.to(accumulation_dtype(dout.dtype))
    d_os, d_ol = (dout * a).to(dout.dtype), (dout * (1 - a)).to(dout.dtype)
    diff = o_s - o_l
    if tq * block_q != n:                       # ragged last block: zero padded tokens
        dout, diff = (F.pad(x, (0, 0, 0, tq * block_q - n)) for x in (dout, diff))
    dots = torch.bmm(dout.reshape(-1, 1, block_q * d), diff.reshape(-1, block_q * d, 1))   # (B H Tq, 1, 1)
    return d_os, d_ol, dots.view(bsz, heads, tq).float() * (alpha * (1 - alpha)).unsqueeze(0)
