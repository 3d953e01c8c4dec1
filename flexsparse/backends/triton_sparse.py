"""The ``triton`` backend: LLSA and block-sparse attention through the ``flexsparse::`` ops.

``block_sparse_attention`` has the contract of ``torch_sparse.block_sparse_attention`` (the sparse
branch of ``topk``, ``vsa``, ``sla`` and ``sla2``); ``fp8_block_sparse_attention`` is its FP8 forward
(``quant``, the fused kernel; no gradient).
``llsa`` is the whole method (pool, select, attend; gradients of k and v include the pooling).
``llsa_attention`` has the signature of ``torch_sparse.llsa_attention`` (pooled levels as their own
inputs, with their own gradients), for comparisons on identical selections.
"""
from __future__ import annotations

import torch

from ..masks import BlockSelection, LLSASelection
from ..masks.pooling import accumulation_dtype
from ..triton import block_ops, ops
from ..triton.layout import pack


def contiguous_inputs(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors as contiguous ``(B, H, N, D)`` (the rows the kernels read), each strided view (e.g. q, k, v of one
    fused projection) copied once, by ``ops.contiguous_rows`` (compiled graphs copy with ``.contiguous()``, which
    inductor may fuse into the op that produced the view). Differentiable."""
    return [x if x.is_contiguous() else x.contiguous() if torch.compiler.is_compiling() else ops.contiguous_rows(x)
            for x in tensors]


def llsa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, topk: tuple[int, ...], scale: float,
         deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """LLSA with ``L = len(topk)`` levels: ``o (B, H, N, D)`` in q's dtype, LSE ``(B, H, N)`` fp32.

    Selection scores use fp32 pyramids; the attended pooled K/V are those means in q's dtype (what
    the tensor cores read anyway). The kernels read strided q, k, v (views of one fused projection) in place;
    where the ops fall back to PyTorch (CPU without the interpreter) they get contiguous copies, so that the bits
    do not depend on the layout there either."""
    if not ops.use_kernels(q):
        q, k, v = (x.contiguous() for x in (q, k, v))
    n, levels = q.shape[2], len(topk)
    with torch.no_grad():
        q_pyr, k_scores, k_pyr, v_pyr = ops.llsa_pool_qkv(q.detach(), k.detach(), v.detach(), block, levels)
        sel = ops.llsa_select(q_pyr, k_scores, n, block, list(topk))
    return ops.llsa_attn(q, k, v, k_pyr, v_pyr, sel, block, list(topk), scale, True, deterministic)


def llsa_attention(q: torch.Tensor, k_levels: list[torch.Tensor], v_levels: list[torch.Tensor],
                   selection: LLSASelection, scale: float,
                   deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """LLSA attention over given levels, as ``torch_sparse.llsa_attention``: k_levels[l], v_levels[l]
    ``(B, Hk, T_l, D)`` for l = 0..L, each with its own gradient. Returns ``o``, ``lse``."""
    acc = accumulation_dtype(q.dtype)
    k_pyr = torch.cat([x.to(acc) for x in k_levels[1:]], dim=2)
    v_pyr = torch.cat([x.to(acc) for x in v_levels[1:]], dim=2)
    topk = [s.shape[-1] for s in selection.indices]
    return ops.llsa_attn(q, k_levels[0], v_levels[0], k_pyr, v_pyr, pack(selection), selection.block, topk, scale,
                         False, deterministic)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, scale: float,
                           deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query block over its selected key blocks (``torch_sparse``'s contract).

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` (cast to q's dtype); selection.indices ``(B, H, Tq, K)``
    int32, ascending, distinct. Returns ``o (B, H, Nq, D)`` in q's dtype and ``lse (B, H, Nq)`` fp32
    (fp64 for fp64 inputs). ``deterministic``: bitwise-reproducible dK/dV.
    """
    indices = checked_indices(q, k, selection)
    return block_ops.block_attn(q, k.to(q.dtype), v.to(q.dtype), indices, selection.block_q, selection.block_k, scale,
                                deterministic)


def fp8_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward of ``block_sparse_attention`` (``flexsparse::block_attn_fp8``: K smoothed, e4m3 Q and K
    per block, V per channel, P static; docs/methods.md "FP8 QAT"). Same arguments; returns ``o`` in q's dtype
    and the LSE of the unsmoothed logits, without gradients (``flexsparse.quant.qat_attention`` adds them)."""
    indices = checked_indices(q, k, selection)
    return block_ops.block_attn_fp8(q, k.to(q.dtype), v.to(q.dtype), indices, selection.block_q, selection.block_k,
                                    scale)


def checked_indices(q: torch.Tensor, k: torch.Tensor, selection: BlockSelection) -> torch.Tensor:
    """The selection's index table as contiguous int32, after checking that it fits q and k."""
    bsz, heads, nq = q.shape[:3]
    expected = (bsz, heads, selection.num_q_blocks)
    if (selection.n_q, selection.n_k) != (nq, k.shape[2]) or tuple(selection.indices.shape[:3]) != expected:
        raise ValueError(f"selection does not fit q {tuple(q.shape)} and k {tuple(k.shape)}: it covers "
                         f"n_q={selection.n_q}, n_k={selection.n_k} with indices {tuple(selection.indices.shape)}; "
                         f"expected n_q={nq}, n_k={k.shape[2]} and indices (B, H, Tq, K) with (B, H, Tq) = {expected}")
    return selection.indices.to(torch.int32).contiguous()
