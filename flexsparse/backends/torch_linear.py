"""Linear-attention branches of SLA / SLA2 in plain PyTorch (gather-based, autograd).

``O_l = phi(Q) H / (eps + phi(Q) . Z)`` with ``H = sum_j phi(K_j)^T V_j`` and ``Z = sum_j colsum phi(K_j)``
over the keys the branch sees. phi acts on the head dim. Computations in fp32 (fp64 for fp64 inputs),
outputs in the input dtype. Padded keys have ``phi = 0`` and padded queries are dropped, so padding
never contributes. GQA: K/V heads divide Q heads.
"""
from __future__ import annotations

import torch

from ..masks import BlockSelection, keep_map, kv_head_index
from ..masks.pooling import accumulation_dtype
from ..reference.sla import feature_map_dense
from .compiled import StaticThenDynamic, grad_flags
from .torch_sparse import _gather_blocks, _pad_tokens


def apply_feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """phi over the last dim in the accumulation dtype: ``softmax``, ``elu`` (elu + 1) or ``relu`` (softmax
    converts inside its kernel: no accumulation-dtype copy of x)."""
    if name == "softmax":
        return torch.softmax(x, dim=-1, dtype=accumulation_dtype(x.dtype))
    return feature_map_dense(x.to(accumulation_dtype(x.dtype)), name)


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
    phi_q = _pad_tokens(apply_feature_map(q, feature_map), tq * bq).unflatten(2, (tq, bq))
    phi_k = _pad_tokens(apply_feature_map(k, feature_map), tk * bk)
    values = _pad_tokens(v.to(acc), tk * bk)
    h, z = _global_state(phi_k, values, q.shape[1])
    a = phi_q @ _gather_blocks(phi_k, skipped, bk).transpose(-1, -2)            # (B, H, Tq, bq, S * bk)
    num = phi_q @ h.unsqueeze(2) - a @ _gather_blocks(values, skipped, bk)
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
    phi_q = _pad_tokens(apply_feature_map(q, feature_map), tq * block_q).unflatten(2, (tq, block_q))
    phi_k = _pad_tokens(apply_feature_map(k, feature_map), tk * block_k).unflatten(2, (tk, block_k))
    values = _pad_tokens(v.to(states), tk * block_k).unflatten(2, (tk, block_k))
    h = (phi_k.to(states).transpose(-1, -2) @ values).flatten(-2)              # (B, Hk, Tk, D*D)
    z = phi_k.sum(-2)                                                           # (B, Hk, Tk, D)
    w = weights.to(acc).unflatten(1, (kv_heads, heads // kv_heads))             # (B, Hk, G, Tq, Tk)
    h_rows = (w.to(states) @ h.unsqueeze(2)).unflatten(-1, (d, d)).flatten(1, 2)  # (B, H, Tq, D, D)
    z_rows = (w @ z.unsqueeze(2)).flatten(1, 2)                                 # (B, H, Tq, D)
    num = phi_q.to(states) @ h_rows                                             # promoted by the division
    den = (phi_q * z_rows.unsqueeze(-2)).sum(-1, keepdim=True)                  # a fused reduction when compiled
    out = num / (eps + den)
    return out.flatten(2, 3)[:, :, : q.shape[2]].to(q.dtype)


def _keep_weighted_linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skipped: torch.Tensor, num_k_blocks: int,
                          block_q: int, block_k: int, feature_map: str, eps: float) -> torch.Tensor:
    """``weighted_linear_attention`` with the 0/1 weights ``1 - M`` of the skipped blocks ``(B, H, Tq, S)``."""
    keep = keep_map(skipped, num_k_blocks, accumulation_dtype(q.dtype))
    return weighted_linear_attention(q, k, v, keep, block_q, block_k, feature_map=feature_map, eps=eps)


# On CUDA the block-level form runs compiled: inductor fuses the feature maps, casts, normaliser and their
# gradients (a dozen elementwise passes over (N, D) tensors in eager mode). Selections are tensors, so a new
# selection never recompiles. Static graphs for the first 16 call variants (shape, dtype, grad flags, ...) of
# the process, dynamic-shape ones after: torch's default, dynamic from the second shape on, was slower
# (docs/results_history.md, "flex after a second shape"), and a static graph per variant without a bound ran
# out of dynamo's recompile limit in one CLI run (12 variants: sla and sla2, three lengths, with and without grad).
KEEP_WEIGHTED_LINEAR = StaticThenDynamic(
    _keep_weighted_linear, name="flexsparse.backends.torch_linear.KEEP_WEIGHTED_LINEAR", budget=16, recompile_limit=64)


def masked_linear_attention_dense_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                         selection: BlockSelection, *, feature_map: str, eps: float) -> torch.Tensor:
    """Same result as ``masked_linear_attention`` through block-level matmuls: ``H_i = (1 - M_i) @ h``
    with the ``(B, H, Tq, Tk)`` block map M of the skipped blocks. O(Tq * Tk * D^2) work on tensor-friendly
    matmuls instead of O(N * skipped * block_k) gathers, and no cancellation; used by the ``flex``
    backend on GPUs (the ``torch`` backend keeps the gather form: no ``(N/b)^2`` tensor). Compiled on CUDA
    (inside a user's ``torch.compile`` region it is traced with the rest)."""
    skipped = skipped_blocks(selection)
    if skipped.shape[-1] == selection.num_k_blocks:
        return q.new_zeros(q.shape)
    args = (q, k, v, skipped, selection.num_k_blocks, selection.block_q, selection.block_k, feature_map, eps)
    if not q.is_cuda:
        return _keep_weighted_linear(*args)
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, grad_flags(q, k, v), skipped.shape, *args[4:])
    return KEEP_WEIGHTED_LINEAR(key, *args)


def masked_linear_for(backend: str):
    """The masked linear branch a backend uses: block-level matmuls with ``flex``, the fused Triton kernels
    with ``triton`` (``triton_linear``), gathers otherwise."""
    if backend == "triton":
        from .triton_linear import masked_linear_attention as triton_masked_linear_attention
        return triton_masked_linear_attention
    return masked_linear_attention_dense_blocks if backend == "flex" else masked_linear_attention
