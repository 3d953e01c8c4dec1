"""The ``triton`` backend: every step on the ``flexsparse::`` ops (``flexsparse.triton``): selection, pooling, the
block-sparse and LLSA branches, SLA's linear branch and the methods' combine fused into its kernels, the FP8 forward.

Kernels run on CUDA, or on CPU under the Triton interpreter; where an op's kernels cannot run (fp64, head dims the
linear kernels do not take) the op runs its PyTorch implementation, so results never depend on the path.
"""
from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import torch

from ..config import QuantConfig
from ..masks import BlockSelection, Levels, LLSASelection, PreparedOperands, accumulation_dtype, level_table, pack
from ..triton.block_sparse import op as block_op
from ..triton._runtime import tiles
from ..triton._runtime.sizes import MAX_GRID_YZ
from ..triton.common.inputs import contiguous_rows, use_kernels
from ..triton.linear import naive as linear_naive
from ..triton.linear import op as linear_op
from ..triton.llsa import op as llsa_op
from ..triton.pooling import op as pooling_op
from ..triton.selection import op as selection_op
from .base import Backend

HAS_TRITON = importlib.util.find_spec("triton") is not None   # read once: dynamo does not trace find_spec
# the quant config the FP8 kernel runs (flexsparse/triton/block_sparse/fwd_fp8.py), field by field
FP8_KERNEL_QUANT = {"qk_dtype": ("fp8_e4m3", "e4m3 Q and K"), "qk": ("per_block", "Q and K scales per block"),
                    "v": ("per_channel", "V scales per channel"), "p": ("static", "P quantized in the kernel")}


class PackedLLSA(NamedTuple):
    """LLSA's selection packed ``(B, H, sum_l T_l K_l)`` int32 with the pyramids of k and v it came with
    (``(B, Hk, T_1 + ... + T_L, D)`` in k's and v's dtype, no gradient: the attention's backward pools the
    gradients itself); ``selection`` unpacks it."""

    packed: torch.Tensor
    k_pyramid: torch.Tensor
    v_pyramid: torch.Tensor
    levels: Levels

    @property
    def selection(self) -> LLSASelection:
        return self.levels.unpack(self.packed)


class TritonBackend(Backend):
    """Every step on the Triton ops (module docstring)."""

    name = "triton"
    graphs_small_calls = True

    def capture_settings(self) -> tuple:
        return (os.environ.get(tiles.VARIABLE),)                # the tile overrides

    def unsupported(self, device, dtype, needs_grad, needs_lse, blocks, head_dim, batch_heads=1):
        if not HAS_TRITON:
            return "triton is not installed (pip install 'flexsparse[triton]')"
        if device.type == "cuda" and batch_heads > MAX_GRID_YZ:
            return (f"its kernels run a row of programs per (batch, head) of q on CUDA's grid y axis, at most "
                    f"{MAX_GRID_YZ} rows: q has B * H = {batch_heads}; split the batch")
        if device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
            return None
        return (f"the Triton kernels run on CUDA (or on CPU with TRITON_INTERPRET=1 set before import), got device "
                f"{device.type!r}")

    def quant_unsupported(self, quant: QuantConfig | None, branch: str | None) -> str | None:
        if quant is None:
            return None
        if branch != "block":
            return ("the FP8 Triton kernel runs the block-sparse branch (topk, sla, sla2), not llsa's levels; "
                    "use backend='torch' or 'reference' for llsa with quant")
        for key, (value, what) in FP8_KERNEL_QUANT.items():
            if getattr(quant, key) != value:
                return (f"the FP8 Triton kernel runs quant {key}={value!r} only ({what}), got {getattr(quant, key)!r}; "
                        f"use backend='torch' or 'reference'" + (", or 'flex' for p='none'" if key == "p" else ""))
        return None

    def prepare_inputs(self, q, k, v, *, keep_views: bool, needs_grad: bool):
        """Strided views copied once here, not by every op (and again in the backward). A method whose kernels read
        views themselves (``keep_views``) keeps them, except in a compiled graph that records gradients, where
        inductor fuses the copies into their producers (compiled DiT-S training at N=65536 ran 4% faster so).
        Compiled graphs copy with ``.contiguous()``, which inductor may fuse into the op that made the view;
        eager calls with the row-copy op (``flexsparse::contiguous_rows``). Differentiable."""
        if keep_views and not (needs_grad and torch.compiler.is_compiling()):
            return q, k, v
        return tuple(x if x.is_contiguous() else x.contiguous() if torch.compiler.is_compiling() else contiguous_rows(x)
                     for x in (q, k, v))

    def block_topk(self, q_pooled, k_pooled, topk: int, bottomk: int = 0):
        tk = k_pooled.shape[2]
        if topk < 1 or bottomk < 0 or topk + bottomk > tk:
            raise ValueError(f"block_topk: topk={topk} (>= 1) plus bottomk={bottomk} (>= 0) must fit in the {tk} key "
                             "blocks of k_pooled")
        top, bottom = selection_op.block_topk(q_pooled, k_pooled, topk, bottomk)
        return top, (bottom if bottomk else None)

    def router_projections(self, q_bar, k_bar, proj_q, proj_k):
        """One op (``selection.op.router_projections``: one launch) in eager calls that record no gradient."""
        if torch.compiler.is_compiling() or _grad_needed(q_bar, k_bar, proj_q, proj_k):
            return super().router_projections(q_bar, k_bar, proj_q, proj_k)
        return selection_op.router_projections(q_bar, k_bar, proj_q, proj_k)

    def block_pooling(self, q, k, block_q: int, block_k: int):
        """One op in eager calls (``pooling.op.block_means_pair``: one launch where the call is small)."""
        if torch.compiler.is_compiling():
            return super().block_pooling(q, k, block_q, block_k)
        return pooling_op.block_means_pair(q, k, block_q, block_k)

    def quantizing_pooling(self, q, k, v, block_q: int, block_k: int, quant: QuantConfig | None):
        """With ``quant`` that the FP8 kernel runs, the pass that pools q quantizes Q per block, and for unsmoothed
        keys the one that pools k quantizes K with V's amax (``flexsparse::pool_quantize_queries``,
        ``flexsparse::pool_quantize``), so that the FP8 branch reads them from the selection instead of a pre-pass
        over Q (and K); on q, k, v of one dtype (the FP8 op's inputs as they come), else ``block_pooling``."""
        if (quant is None or self.quant_unsupported(quant, "block") is not None
                or not q.dtype == k.dtype == v.dtype):
            return super().quantizing_pooling(q, k, v, block_q, block_k, quant)
        with torch.no_grad():
            if quant.smooth_keys:
                outputs = block_op.pool_quantize_queries(q, k, block_q, block_k)
            else:
                outputs = block_op.pool_quantize(q, k, v, block_q, block_k)
        return outputs[:3], PreparedOperands((q, k, v), list(outputs[3:]))

    def coarse_pooling(self, q, k, v, block_q: int, block_k: int):
        """One op in eager calls (``pooling.op.coarse_means``: one launch where the call is small)."""
        if torch.compiler.is_compiling():
            return super().coarse_pooling(q, k, v, block_q, block_k)
        return pooling_op.coarse_means(q, k, v, block_q, block_k)

    def center(self, x, mean):
        if torch.compiler.is_compiling():
            return super().center(x, mean)
        return pooling_op.center_tokens(x, mean)

    def llsa_select(self, q, k, v, block: int, topk: tuple[int, ...]) -> PackedLLSA:
        """Pyramids of q, k and v from one pass (q's and k's in fp32 for the scores; k's and v's means in their
        dtype, which the attention reads), then the hierarchical selection."""
        if not use_kernels(q):   # the PyTorch path reads contiguous rows, so the bits do not depend on the layout
            q, k, v = (x.contiguous() for x in (q, k, v))
        with torch.no_grad():
            q_pyr, k_scores, k_pyr, v_pyr = pooling_op.llsa_pool_qkv(q.detach(), k.detach(), v.detach(), block,
                                                                     len(topk))
            packed = selection_op.llsa_select(q_pyr, k_scores, q.shape[2], block, list(topk))
        return PackedLLSA(packed, k_pyr, v_pyr, level_table(q.shape[2], block, topk))

    def llsa_attention(self, q, k, v, pooled: PackedLLSA, scale: float, *, deterministic: bool = False,
                       quant: QuantConfig | None = None):
        """Gradients of k and v include the paths through the pyramids (``fuse_pool``)."""
        if quant is not None:
            raise ValueError(f"backend 'triton' cannot run config key 'quant': {self.quant_unsupported(quant, 'llsa')}")
        if not use_kernels(q):
            q, k, v = (x.contiguous() for x in (q, k, v))
        levels = pooled.levels
        return llsa_op.llsa_attn(q, k, v, pooled.k_pyramid, pooled.v_pyramid, pooled.packed, levels.block,
                                 list(levels.topk), scale, True, deterministic)

    def block_sparse_attention(self, q, k, v, selection: BlockSelection, scale: float, *, deterministic: bool = False,
                               quant: QuantConfig | None = None):
        """With ``quant`` the quantized forward is one FP8 kernel (``flexsparse::block_attn_fp8``), its gradients
        the bf16 backward kernels' at its O and LSE."""
        if quant is None:
            return self.sparse_softmax(q, k, v, selection, scale, deterministic=deterministic)
        reason = self.quant_unsupported(quant, "block")
        if reason is not None:
            raise ValueError(f"backend 'triton' cannot run config key 'quant': {reason}")
        return fp8_block_sparse_attention(q, k, v, selection, scale, deterministic, quant.smooth_keys)

    def sparse_softmax(self, q, k, v, selection: BlockSelection, scale: float, *, deterministic: bool = False,
                       quantize_p: bool = False):
        indices = checked_indices(q, k, selection)
        return block_op.block_attn(q, k.to(q.dtype), v.to(q.dtype), indices, selection.block_q, selection.block_k,
                                   scale, deterministic)

    def llsa_softmax(self, q, k_levels, v_levels, selection: LLSASelection, scale: float, *,
                     quantize_p: bool = False):
        """LLSA's softmax over given levels, each with its own gradient (``fuse_pool`` off): comparisons with the
        other backends on identical levels and selections."""
        acc = accumulation_dtype(q.dtype)
        k_pyr = torch.cat([x.to(acc) for x in k_levels[1:]], dim=2)
        v_pyr = torch.cat([x.to(acc) for x in v_levels[1:]], dim=2)
        topk = [s.shape[-1] for s in selection.indices]
        return llsa_op.llsa_attn(q, k_levels[0], v_levels[0], k_pyr, v_pyr, pack(selection), selection.block, topk,
                                 scale, False, False)

    def masked_linear_attention(self, q, k, v, selection: BlockSelection, *, feature_map: str, eps: float):
        """No token gather: per key block ``[h_j | z_j]``, per query block the global sums minus its skipped blocks,
        or with many skipped blocks the kept blocks' sums as tensor-core block matmuls. Exactly 0 when every block
        is skipped. The subtraction loses relative precision when the remaining keys carry a tiny fraction of the
        global mass (fp32: ~1e-7 / fraction)."""
        skipped = linear_naive.skipped_blocks(selection)
        if skipped.shape[-1] == selection.num_k_blocks:
            return q.new_zeros(q.shape)
        out, _, _ = linear_op.masked_linear(q, k, v, skipped, selection.block_q, selection.block_k, feature_map, eps)
        return out

    def mixed_linear_output(self, q, k, v, selection: BlockSelection, o_s, *, feature_map: str, eps: float,
                            weight=None, bias=None, alpha_logit=None):
        """SLA's ``o_s + O_l W^T + b`` or SLA2's ``O_l + alpha (o_s - O_l)`` (``alpha = sigmoid(alpha_logit)``, in
        the kernel) mixed in the linear branch's output kernel (one pass instead of O_l, a projection and a sum);
        ``None`` where the linear kernels do not run on q or every block is skipped (O_l = 0)."""
        skipped = _kernel_skips(q, selection)
        if skipped is None:
            return None
        out, _, _, _ = linear_op.masked_linear_mix(q, k, v, skipped, o_s, weight, bias, alpha_logit,
                                                   selection.block_q, selection.block_k, feature_map, eps,
                                                   _grad_needed(q, k, v, o_s, weight, bias, alpha_logit))
        return out

    def sparse_linear_output(self, q, k, v, selection: BlockSelection, scale: float, *, deterministic: bool,
                             quant: QuantConfig | None, feature_map: str, eps: float, weight=None, bias=None,
                             alpha_logit=None):
        """The sparse branch and ``mixed_linear_output`` in one op (``flexsparse::sparse_linear_mix``: same values,
        gradients with one rounding of the summed dq, dk, dv); with ``quant`` the sparse branch is the FP8 forward
        (``block_sparse_attention``'s, and its QAT gradients). ``None`` where ``mixed_linear_output`` is, or for a
        ``quant`` config the FP8 kernel does not run (``block_sparse_attention`` says why)."""
        if quant is not None and self.quant_unsupported(quant, "block") is not None:
            return None
        skipped = _kernel_skips(q, selection)
        if skipped is None:
            return None
        out, lse, _, _, _, _ = linear_op.sparse_linear_mix(q, k.to(q.dtype), v.to(q.dtype),
                                                           checked_indices(q, k, selection), skipped, weight, bias,
                                                           alpha_logit, selection.block_q, selection.block_k, scale,
                                                           deterministic, feature_map, eps,
                                                           _grad_needed(q, k, v, weight, bias, alpha_logit),
                                                           quant is not None, selection.key_mean,
                                                           quant is None or quant.smooth_keys,
                                                           *prepared_tensors(q, k, v, selection))
        return out, lse


def fp8_block_sparse_attention(q, k, v, selection: BlockSelection, scale: float, deterministic: bool = False,
                               smooth_keys: bool = True):
    """The FP8 forward of the block-sparse branch (``flexsparse::block_attn_fp8``: K smoothed with ``smooth_keys``,
    e4m3 Q and K per block, V per channel, P static; docs/methods.md "FP8 QAT"): ``o`` in q's dtype and the LSE of
    the unsmoothed logits, with the QAT gradients (the bf16 backward kernels at this o and LSE; ``deterministic`` as
    ``block_attn``'s). K is smoothed with the selection's ``key_mean`` where it has one; the selection's prepared
    operands of these q, k, v are used where it has them (``prepared_tensors``)."""
    indices = checked_indices(q, k, selection)
    return block_op.block_attn_fp8(q, k.to(q.dtype), v.to(q.dtype), indices, selection.block_q, selection.block_k,
                                   scale, deterministic, selection.key_mean, smooth_keys,
                                   *prepared_tensors(q, k, v, selection))


def prepared_tensors(q, k, v, selection: BlockSelection) -> list[torch.Tensor]:
    """The FP8 operands the selection's pooling pass made (``quantizing_pooling``) where they are of q, k, v, else
    ``[]``."""
    prepared = selection.prepared
    return prepared.tensors if prepared is not None and prepared.serves(q, k, v) else []


def checked_indices(q: torch.Tensor, k: torch.Tensor, selection: BlockSelection) -> torch.Tensor:
    """The selection's index table as contiguous int32, after checking that it fits q and k."""
    bsz, heads, nq = q.shape[:3]
    expected = (bsz, heads, selection.num_q_blocks)
    if (selection.n_q, selection.n_k) != (nq, k.shape[2]) or tuple(selection.indices.shape[:3]) != expected:
        raise ValueError(f"selection does not fit q {tuple(q.shape)} and k {tuple(k.shape)}: it covers "
                         f"n_q={selection.n_q}, n_k={selection.n_k} with indices {tuple(selection.indices.shape)}; "
                         f"expected n_q={nq}, n_k={k.shape[2]} and indices (B, H, Tq, K) with (B, H, Tq) = {expected}")
    return selection.indices.to(torch.int32).contiguous()


def _kernel_skips(q: torch.Tensor, selection: BlockSelection) -> torch.Tensor | None:
    """The selection's skipped key blocks per query block, or ``None`` when the linear kernels do not run on q
    (``linear_op.linear_kernels``) or every block is skipped (O_l = 0)."""
    skipped = linear_naive.skipped_blocks(selection)
    if not linear_op.linear_kernels(q) or skipped.shape[-1] == selection.num_k_blocks:
        return None
    return skipped


def _grad_needed(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a gradient through any of ``tensors`` (the branch then stores O_l and its states)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
