"""The primitives a method composes, and the PyTorch implementation every backend starts from.

A method selects (pooling, top-K), attends (a sparse branch, a linear branch) and combines; it asks its backend for
each step, so ``backend=`` decides where everything runs, selection included. ``Backend`` implements every step in
PyTorch (the op families' ``naive`` modules, the QAT wrapper of ``flexsparse.quant``); a subclass replaces the steps
it runs elsewhere (``FlexBackend``: the sparse branches on FlexAttention; ``TritonBackend``: everything on the
``flexsparse::`` ops) and says which calls it cannot run (``unsupported``, ``quant_unsupported``). Selections are
the ``flexsparse.masks`` tables, so every backend consumes the same ones.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config import QuantConfig
from ..masks import BlockSelection, LLSALayout, LLSASelection, PreparedOperands, accumulation_dtype, kv_head_index
from ..quant import qat_attention, quantize_kv, quantizes_p
from ..triton.block_sparse import naive as block_naive
from ..triton.linear import naive as linear_naive
from ..triton.llsa import naive as llsa_naive
from ..triton.pooling import naive as pooling
from ..triton.selection import naive as selection_naive


class PooledLLSA(NamedTuple):
    """LLSA's selection with the key pyramid it was scored on (levels 1..L, ``(B, Hk, T_l, D)`` in the accumulation
    dtype, differentiable), which the attention reads again."""

    selection: LLSASelection
    k_levels: list[torch.Tensor]


class Backend:
    """PyTorch implementations of every step (the ``torch`` backend as it is; see the module docstring)."""

    name = "torch"
    # True where the steps can be captured: small eager CUDA calls then replay graphs (flexsparse.eager_graphs)
    graphs_small_calls = False

    def capture_settings(self) -> tuple:
        """Process settings read at call time that change what a call launches (part of a captured call's key)."""
        return ()

    def attend(self, method, q, k, v, selection, cfg, **kwargs):
        """``method``'s attend (and combine) step on this backend; the reference backend runs its dense spec."""
        return method.attend(q, k, v, selection, cfg, self, **kwargs)

    def unsupported(self, device: torch.device, dtype: torch.dtype, needs_grad: bool, needs_lse: bool,
                    blocks: tuple[int, ...], head_dim: int | None, batch_heads: int = 1) -> str | None:
        """Why this backend cannot run a call (forward, backward if ``needs_grad``, LSE if ``needs_lse``, the
        config's block sizes ``blocks``, q's head dim, q's batch times query heads), or ``None`` when it can."""
        return None

    def quant_unsupported(self, quant: QuantConfig | None, branch: str | None) -> str | None:
        """Why this backend cannot quantize the sparse branch ``branch`` (``"block"``, ``"llsa"``) with ``quant``."""
        return None

    def prepare_inputs(self, q, k, v, *, keep_views: bool, needs_grad: bool):
        """q, k, v as the backend's kernels want them (``keep_views``: the method's kernels read strided views)."""
        return q, k, v

    # ---- pooling and selection (no gradient through selections)

    def block_sums(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """Sums of ``block`` tokens: ``(B, H, N, D)`` -> ``(B, H, ceil(N / block), D)`` in the accumulation dtype."""
        return pooling.block_sums(x, block)

    def pyramid_from_sums(self, sums: torch.Tensor, n: int, block: int, levels: int) -> list[torch.Tensor]:
        """Levels 1..L of the mean-pooling pyramid of ``n`` tokens from their ``block_sums`` ``(B, H, T_1, D)``."""
        return pooling.pyramid_from_sums(sums, n, block, levels)

    def mean_pool(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """Block means (true means on a ragged tail): ``(B, H, N, D)`` -> ``(B, H, ceil(N / block), D)``."""
        return pooling.mean_pool(x, block)

    def block_pooling(self, q: torch.Tensor, k: torch.Tensor, block_q: int,
                      block_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A block method's pooled q and k (``pooling.block_pooling``): q's and k's block means and k's block sums
        (the routers' key mean), differentiable."""
        return pooling.block_pooling(q, k, block_q, block_k)

    def quantizing_pooling(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int,
                           quant: QuantConfig | None) -> tuple[tuple[torch.Tensor, ...], PreparedOperands | None]:
        """``block_pooling(q, k, block_q, block_k)`` and the operands of the quantized branch with ``quant`` that this
        backend makes in the same pass (``BlockSelection.prepared``; None here: the branch quantizes its inputs)."""
        return self.block_pooling(q, k, block_q, block_k), None

    def coarse_pooling(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int):
        """VSA's pooled tiles (``pooling.coarse_pooling``): q's and k's block means in the accumulation dtype (the
        router's inputs) and the block means of q, k, v in their dtypes (the coarse branch's), differentiable."""
        return pooling.coarse_pooling(q, k, v, block_q, block_k)

    def key_mean(self, k: torch.Tensor, block: int, sums: torch.Tensor | None = None) -> torch.Tensor:
        """``mean_N k``: ``(B, Hk, N, D)`` -> ``(B, Hk, 1, D)`` in the accumulation dtype, from the sums of ``block``
        tokens (``sums``: ``block_sums(k, block)`` when the caller has them)."""
        return pooling.key_mean(k, block, sums)

    def router_inputs(self, q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int,
                      pooled: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block routers' inputs: block means of q ``(B, H, Tq, D)`` and of k ``(B, Hk, Tk, D)`` in the
        accumulation dtype. The papers pool the smoothed keys ``k - mean_N k``; a row's scores
        ``q_i . (k_j - mean k)`` all move by ``q_i . mean k`` (after any linear map of the keys too), which changes
        no top-K, softmax, standardized row or row-calibrated SoftTop-k, so the routers take k as it is (the mean
        and the difference cost three ops per call). ``pooled``: ``block_pooling(q, k, block_q, block_k)`` when
        the caller has it."""
        q_means, k_means, _ = self.block_pooling(q, k, block_q, block_k) if pooled is None else pooled
        return q_means, k_means

    def router_projections(self, q_bar: torch.Tensor, k_bar: torch.Tensor, proj_q: torch.Tensor,
                           proj_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """SLA2's projected router inputs ``(q_bar P_q^T, k_bar P_k^T)`` in q_bar's dtype (``router_inputs``' means,
        projections ``(D, D)``); differentiable."""
        return selection_naive.router_projections(q_bar, k_bar, proj_q, proj_k)

    def block_topk(self, q_pooled: torch.Tensor, k_pooled: torch.Tensor, topk: int,
                   bottomk: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Top-K (and bottom-K) key blocks per query block by raw-dot scores: ``(B, H, Tq, topk)`` and
        ``(B, H, Tq, bottomk)`` (or None) int32, ascending; ties to the smallest id."""
        return selection_naive.block_topk(q_pooled, k_pooled, topk, bottomk=bottomk)

    def center(self, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """``x - mean`` computed in mean's dtype and rounded once to x's (SLA2's smoothed keys and their gradient).
        Compiled, the PyTorch expression, which inductor fuses into one pass; two torch 2.11 bugs shape it:
        ``torch.sub(..., out=empty)`` gave zeros in a traced backward on CUDA, and a no-op ``.to(x.dtype)`` (fp32 x)
        made dynamo drop the gradient (``tests/test_sla2.py::test_smoothed_keys_compile_fullgraph_with_backward``)."""
        if torch.compiler.is_compiling():
            diff = x - mean
            return diff if diff.dtype == x.dtype else diff.to(x.dtype)
        return pooling.center(x, mean)

    def llsa_select(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int,
                    topk: tuple[int, ...]) -> PooledLLSA:
        """LLSA's hierarchical selection of q ``(B, H, N, D)`` against k (pooling pyramids in fp32, fp64 for fp64),
        with k's pyramid for the attention."""
        k_levels = pooling.pool_pyramid(k, block, len(topk))
        return PooledLLSA(selection_naive.llsa_topk(q, k, topk, block, k_levels=k_levels), k_levels)

    def llsa_select_levels(self, q_levels: list[torch.Tensor], k_levels: list[torch.Tensor], topk: tuple[int, ...],
                           block: int, n: int) -> LLSASelection:
        """LLSA's hierarchical selection from given pyramids (levels 1..L of q and k, a ring's all-gathered ones)."""
        return selection_naive.hierarchical_topk(q_levels, k_levels, topk, block, n)

    # ---- attention

    def dense_attention(self, q, k, v, scale: float, need_lse: bool, key_mask: torch.Tensor | None = None):
        """Dense softmax attention by SDPA, and only when ``need_lse`` a separate, differentiable, row-chunked
        natural-log LSE ``(B, H, Nq)`` (else ``None``). ``key_mask``: ``(B, Nk)`` bool, False for keys no query
        attends; a batch row without any key gives output 0 and LSE -inf (finite gradients)."""
        heads = q.shape[1]
        empty = None
        if key_mask is not None:
            empty = ~key_mask.any(-1, keepdim=True)                                               # (B, 1)
            key_mask = key_mask | empty       # an empty row attends every key, then its results are replaced
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if key_mask is None else key_mask[:, None, None],
                                             scale=scale, enable_gqa=heads != k.shape[1])
        lse = (_chunked_lse(q, k[:, kv_head_index(heads, k.shape[1], q.device)], scale, keys=key_mask)
               if need_lse else None)
        if empty is not None:
            out = torch.where(empty[:, :, None, None], 0, out)
            lse = None if lse is None else torch.where(empty[:, :, None], float("-inf"), lse)
        return out, lse

    def block_sparse_attention(self, q, k, v, selection: BlockSelection, scale: float, *, deterministic: bool = False,
                               quant: QuantConfig | None = None):
        """Softmax attention of each query block over its selected key blocks: ``o (B, H, Nq, D)`` in q's dtype and
        the natural-log LSE ``(B, H, Nq)`` (fp32, fp64 for fp64; ``None`` where the backend gives none). ``quant``:
        FP8 fake-quantized forward, QAT backward (``flexsparse.quant.qat_attention``).
        ``deterministic``: bitwise-reproducible gradients where the backend's are not already."""
        dtype = q.dtype

        def attend(q, k, v, quant):
            if quant is None:
                return self.sparse_softmax(q, k, v, selection, scale, deterministic=deterministic)
            k, v = quantize_kv(k, v, quant, selection.block_k)
            q, k, v = self.quantized_operands(dtype, q, k, v)
            return self.sparse_softmax(q, k, v, selection, scale, quantize_p=quantizes_p(quant))

        return qat_attention(attend, q, k, v, quant, block_q=selection.block_q, scale=scale)

    def sparse_softmax(self, q, k, v, selection: BlockSelection, scale: float, *, deterministic: bool = False,
                       quantize_p: bool = False):
        """The unquantized (or P-quantized) block-sparse branch: ``(o, lse)``."""
        return block_naive.block_sparse_attention(q, k, v, selection, scale, quantize_p=quantize_p)

    def quantized_operands(self, dtype: torch.dtype, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Fake-quantized operands as the backend computes on them (the accumulation dtype here)."""
        return tensors

    def llsa_attention(self, q, k, v, pooled: PooledLLSA, scale: float, *, deterministic: bool = False,
                       quant: QuantConfig | None = None):
        """LLSA attention over the selected fine blocks, the enriched coarse levels and the whole top level:
        ``o (B, H, N, D)``, ``lse (B, H, N)``. ``quant``: Q per block of b tokens, every level's K per block of b
        tokens of that level, V per channel per level, P static; QAT backward."""
        selection, b, dtype = pooled.selection, pooled.selection.block, q.dtype
        levels = selection.levels

        def attend(q, k, v, quant):
            if quant is None:
                return self.llsa_softmax(q, [k, *pooled.k_levels], [v, *pooling.pool_pyramid(v, b, levels)],
                                         selection, scale)
            keys, values = [k, *pooling.pool_pyramid(k, b, levels)], [v, *pooling.pool_pyramid(v, b, levels)]
            keys, values = map(list, zip(*(quantize_kv(x, y, quant, b) for x, y in zip(keys, values))))
            q, = self.quantized_operands(dtype, q)
            return self.llsa_softmax(q, keys, values, selection, scale, quantize_p=quantizes_p(quant))

        return qat_attention(attend, q, k, v, quant, block_q=b, scale=scale)

    def llsa_softmax(self, q, k_levels, v_levels, selection: LLSASelection, scale: float, *,
                     quantize_p: bool = False):
        """LLSA's softmax over given levels (k_levels[l], v_levels[l] ``(B, Hk, T_l, D)``, l = 0..L)."""
        return llsa_naive.llsa_attention(q, k_levels, v_levels, selection, scale, quantize_p=quantize_p)

    def llsa_extended_softmax(self, q, k_levels, v_levels, ids: torch.Tensor, layout: LLSALayout, scale: float):
        """LLSA's softmax of each query block over its listed blocks ``ids`` of an extended KV (``layout``; a ring
        rank's queries over its fetched fine blocks and the whole pyramid): ``(o, lse)``. The PyTorch gather form
        here (``flexsparse.triton.llsa.naive.extended_attention``), on the triton backend too: no Triton kernel
        reads a level 0 other than the sequence."""
        return llsa_naive.extended_attention(q, k_levels, v_levels, ids, layout, scale)

    def linear_attention(self, q, k, v, *, feature_map: str, eps: float) -> torch.Tensor:
        """Linear attention over every key (SLA ``linear="full"``): ``(B, H, Nq, D)`` in q's dtype."""
        return linear_naive.linear_attention(q, k, v, feature_map=feature_map, eps=eps)

    def masked_linear_attention(self, q, k, v, selection: BlockSelection, *, feature_map: str,
                                eps: float) -> torch.Tensor:
        """Linear attention of each query block over the key blocks neither selected nor excluded."""
        return linear_naive.masked_linear_attention(q, k, v, selection, feature_map=feature_map, eps=eps)

    def mixed_linear_output(self, q, k, v, selection: BlockSelection, o_s, *, feature_map: str, eps: float,
                            weight=None, bias=None, alpha_logit=None) -> torch.Tensor | None:
        """The masked linear branch with SLA's or SLA2's combine fused into it, or ``None`` where the backend has no
        such kernel (the method combines then)."""
        return None

    def sparse_linear_output(self, q, k, v, selection: BlockSelection, scale: float, *, deterministic: bool,
                             quant: QuantConfig | None, feature_map: str, eps: float, weight=None, bias=None,
                             alpha_logit=None):
        """Both branches and the combine in one op, ``(out, lse)``, or ``None`` where the backend has none."""
        return None

    def soft_block_attention(self, q, k, v, log_weights, block_q: int, block_k: int, scale: float):
        """Softmax over every key with a log weight per (query block, key block): SLA2's stage-1 router."""
        return block_naive.soft_block_attention(q, k, v, log_weights, block_q, block_k, scale)

    def weighted_linear_attention(self, q, k, v, weights, block_q: int, block_k: int, *, feature_map: str,
                                  eps: float) -> torch.Tensor:
        """Linear attention with a weight per (query block, key block): SLA2's stage-1 linear branch."""
        return linear_naive.weighted_linear_attention(q, k, v, weights, block_q, block_k, feature_map=feature_map,
                                                      eps=eps)


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """One softmax from two over disjoint key sets: outputs ``(B, H, N, D)`` and their natural-log LSEs ``(B, H, N)``
    -> ``(o, lse)``, computed in the accumulation dtype (fp32; fp64 for fp64), o in o1's dtype. Differentiable,
    gradients through both LSEs."""
    acc = accumulation_dtype(o1.dtype)
    lse1, lse2 = lse1.to(acc), lse2.to(acc)
    lse = torch.logaddexp(lse1, lse2)
    out = o1.to(acc) * (lse1 - lse).exp().unsqueeze(-1) + o2.to(acc) * (lse2 - lse).exp().unsqueeze(-1)
    return out.to(o1.dtype), lse


def _chunked_lse(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int = 1024,
                 keys: torch.Tensor | None = None) -> torch.Tensor:
    """Natural-log LSE of dense attention, computed in row chunks (no N x N tensor); ``keys``: ``(B, Nk)`` bool, the
    keys each batch row attends (at least one per row)."""
    acc = accumulation_dtype(q.dtype)
    parts = []
    for s in range(0, q.shape[2], rows):
        logits = (q[:, :, s:s + rows].to(acc) @ k.to(acc).transpose(-1, -2)) * scale
        if keys is not None:
            logits = logits.masked_fill(~keys[:, None, None, :], float("-inf"))
        parts.append(torch.logsumexp(logits, dim=-1))
    return torch.cat(parts, dim=-1)
