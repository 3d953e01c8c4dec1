"""The masked linear branch of SLA / SLA2 through the ``flexsparse::masked_linear`` op (fused Triton kernels).

Same contract as ``torch_linear.masked_linear_attention``; no token gather: per key block ``[h_j | z_j]``, per
query block the global sums minus its skipped blocks (O(N (K + Kx) D^2) gathers) or, with many skipped blocks,
the kept blocks' sums as tensor-core block matmuls (``flexsparse.triton.linear_dense``). ``mixed_output``: the
branch with SLA's or SLA2's combine done in its output kernel; ``sparse_linear_output``: both branches and the
combine in one op, whose backward adds the linear branch's gradients to the sparse branch's inside its kernels.
"""
from __future__ import annotations

import torch

from ..masks import BlockSelection
from ..triton import sla_ops
from .torch_linear import skipped_blocks
from .triton_sparse import checked_indices


def masked_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, *,
                            feature_map: str, eps: float) -> torch.Tensor:
    """Linear attention of each query block over the key blocks that are neither selected nor excluded.

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``. Returns ``(B, H, Nq, D)`` in q's dtype (exactly 0 when
    every block is skipped). Differentiable w.r.t. q, k, v. The subtraction loses relative precision when
    the remaining keys carry a tiny fraction of the global mass (fp32: ~1e-7 / fraction).
    """
    skipped = skipped_blocks(selection)
    if skipped.shape[-1] == selection.num_k_blocks:
        return q.new_zeros(q.shape)
    out, _, _ = sla_ops.masked_linear(q, k, v, skipped, selection.block_q, selection.block_k, feature_map, eps)
    return out


def mixed_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, o_s: torch.Tensor, *,
                 feature_map: str, eps: float, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 alpha: torch.Tensor | None = None) -> torch.Tensor | None:
    """SLA's ``o_s + O_l W^T + b`` (``weight (D, D)``, ``bias (D,)``) or SLA2's ``O_l + alpha (o_s - O_l)``
    (``alpha (1 or H, Tq)``) with the masked linear branch O_l, mixed in the branch's output kernel (one pass
    instead of O_l, a projection and a sum). ``(B, H, Nq, D)`` in q's dtype, differentiable w.r.t. q, k, v, o_s,
    weight, bias and alpha; ``None`` when the kernels do not run on q (``sla_ops.linear_kernels``) or every
    block is skipped (O_l = 0): the caller combines in PyTorch then."""
    skipped = _kernel_skips(q, selection)
    if skipped is None:
        return None
    out, _, _, _ = sla_ops.masked_linear_mix(q, k, v, skipped, o_s, weight, bias, alpha, selection.block_q,
                                          selection.block_k, feature_map, eps,
                                          _grad_needed(q, k, v, o_s, weight, bias, alpha))
    return out


def sparse_linear_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, scale: float, *,
                         deterministic: bool, feature_map: str, eps: float, weight: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, alpha: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, lse)``: the sparse branch over ``selection.indices`` (``triton_sparse.block_sparse_attention``) mixed
    with the masked linear branch as in ``mixed_output``, in one op (``flexsparse::sparse_linear_mix``; same
    values, gradients with one rounding of the summed dq, dk, dv). ``None`` where ``mixed_output`` is: the caller
    runs the branches separately then."""
    skipped = _kernel_skips(q, selection)
    if skipped is None:
        return None
    out, lse, _, _, _, _ = sla_ops.sparse_linear_mix(q, k.to(q.dtype), v.to(q.dtype), checked_indices(q, k, selection),
                                                     skipped, weight, bias, alpha, selection.block_q,
                                                     selection.block_k, scale, deterministic, feature_map, eps,
                                                     _grad_needed(q, k, v, weight, bias, alpha))
    return out, lse


def _kernel_skips(q: torch.Tensor, selection: BlockSelection) -> torch.Tensor | None:
    """The selection's skipped key blocks per query block, or ``None`` when the linear kernels do not run on q
    (``sla_ops.linear_kernels``) or every block is skipped (O_l = 0)."""
    skipped = skipped_blocks(selection)
    if not sla_ops.linear_kernels(q) or skipped.shape[-1] == selection.num_k_blocks:
        return None
    return skipped


def _grad_needed(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a gradient through any of ``tensors`` (the branch then stores O_l and its states)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
