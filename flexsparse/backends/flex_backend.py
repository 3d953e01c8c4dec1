"""The ``flex`` backend: the sparse branches through ``torch.nn.attention.flex_attention``.

Selection runs in PyTorch (``Backend``); the block-sparse and LLSA softmax branches run the module-level compiled
``FLEX_ATTENTION`` with a ``BlockMask`` built from the selection's index tables (``flexsparse.masks.block_mask``):
static graphs, one per call variant (shapes, dtype, blocks, ...); on CUDA past the first 16 variants of a process,
dynamic-shape graphs (``compiled.StaticThenDynamic``). SLA's masked linear branch runs as block-level matmuls,
compiled on CUDA (``KEEP_WEIGHTED_LINEAR``).

* CUDA: forward and backward; output in the input dtype, LSE (fp32, natural log) from the kernel.
  Blocks smaller than the default kernel tiles get forward tiles through ``kernel_options`` and
  backward tiles through ``SmallBlockChoices`` (installed once, at import, when CUDA is present).
* CPU: compiled forward only (``dynamic=False``), no LSE (returned as ``None``) and no backward:
  ``backend="auto"`` picks ``torch`` for those (see ``unsupported_reason``). Each new call variant compiles C++ for
  seconds; the first call of each logs so at INFO (``flexsparse.backends.flex_backend`` logger).
"""
from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from ..config import QuantConfig
from ..masks import (BlockSelection, LLSALayout, LLSASelection, block_selection_to_block_mask, level_span,
                     llsa_block_ids, llsa_layout)
from ..masks.block_mask import block_mask_from_ids
from ..triton.linear import naive as linear_naive
from ..triton.llsa import naive as llsa_naive
from .base import Backend
from .compiled import StaticThenDynamic, grad_flags

logger = logging.getLogger(__name__)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CUDA_BLOCK_MULTIPLE = 16  # smallest Triton tile: every CUDA block size must be a multiple of it
# torch 2.13's C++ FlexAttention template (CPU) is wrong (errors ~1, NaN) for these head dims with KV blocks
# of 8 mod 16 tokens, on any mask (measured against SDPA for head dims 4..128 and KV blocks 2..56).
CPU_WRONG_HEAD_DIMS = (8, 16)


def _flex_call(*args, **kwargs):
    return flex_attention(*args, **kwargs)


# Every flex call of the process goes through this compiled flex_attention: static graphs for the first 16 call
# variants on CUDA (``_variant_key``), dynamic-shape graphs after (``compiled``); always static on CPU (torch
# 2.13's C++ FlexAttention template does not compile with dynamic shapes: undeclared names in the generated
# code). Each (dtype, block size, head dim, score_mod, grad mode, ...) is a recompile; past dynamo's limit it
# would silently run the eager, dense O(N^2) FlexAttention, so the limit is raised to 4x the static budget
# (room for guards the key does not see) and hitting it is an error.
FLEX_ATTENTION = StaticThenDynamic(_flex_call, name="flexsparse.backends.flex_backend.FLEX_ATTENTION", budget=16,
                                   recompile_limit=64, fail_on_limit=True)
CPU_VARIANTS: set = set()   # the CPU call variants (``_variant_key``) whose compile was announced


def _variant_key(q, k, v, block_mask: BlockMask, score_mod, options: dict) -> tuple:
    """What a static graph of one flex call is specialised on, as far as flexsparse can tell: shapes, dtype,
    device, grad flags, the BlockMask's geometry, the score/mask functions and the kernel options."""
    return (q.shape, k.shape, v.shape, q.dtype, q.device, grad_flags(q, k, v), block_mask.BLOCK_SIZE,
            block_mask.kv_indices.shape, block_mask.seq_lengths, getattr(score_mod, "__code__", score_mod),
            getattr(block_mask.mask_mod, "__code__", block_mask.mask_mod), tuple(sorted(options.items())))


def announce_cpu_compile(q, k, v, block_mask: BlockMask, score_mod) -> None:
    """Log at INFO, once per call variant of the process, that a CPU flex call is about to compile (seconds of C++
    compilation per new shape; ``backend="auto"`` picks flex on CPU for calls without gradients). Nothing inside a
    user's compiled region, where the call is traced with the rest."""
    if torch.compiler.is_compiling():
        return
    key = _variant_key(q, k, v, block_mask, score_mod, {})
    if key in CPU_VARIANTS:
        return
    CPU_VARIANTS.add(key)
    logger.info("flex backend: compiling FlexAttention for CPU for a new call variant (q %s, k %s, %s, blocks %s); "
                "this can take seconds per new shape; backend='torch' runs without compiling", tuple(q.shape),
                tuple(k.shape), q.dtype, block_mask.BLOCK_SIZE)


def unsupported_reason(device: torch.device, dtype: torch.dtype, needs_grad: bool, needs_lse: bool,
                       blocks: tuple[int, ...], head_dim: int | None = None) -> str | None:
    """Why the flex backend cannot run a call, or ``None`` when it can (``head_dim``: D of q, if known)."""
    if device.type not in ("cpu", "cuda"):
        return f"flex runs on CPU and CUDA, got device {device.type!r}"
    if dtype not in DTYPES:
        return f"flex supports float16, bfloat16 and float32 inputs, got {dtype}; use backend='torch'"
    if device.type == "cpu" and needs_grad:
        return ("FlexAttention has no backward on CPU; use backend='torch' (or 'auto', which picks it) "
                "for training on CPU, or run under torch.no_grad()")
    if device.type == "cpu" and needs_lse:
        return "compiled FlexAttention on CPU returns no LSE; use backend='torch' (or 'auto') with return_lse=True"
    wrong = [b for b in blocks if b % 16 == 8]
    if device.type == "cpu" and head_dim in CPU_WRONG_HEAD_DIMS and wrong:
        return (f"torch's compiled CPU FlexAttention gives wrong results for head dim {head_dim} with blocks of "
                f"{sorted(set(wrong))} tokens (block % 16 == 8; even on a dense mask); use backend='torch' (or 'auto')")
    bad = [b for b in blocks if b % CUDA_BLOCK_MULTIPLE]
    if device.type == "cuda" and bad:
        return f"flex on CUDA needs block sizes that are multiples of {CUDA_BLOCK_MULTIPLE}, got {sorted(set(bad))}"
    return None


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return any(grad_flags(*tensors))


def _check(q: torch.Tensor, blocks: tuple[int, ...], needs_grad: bool) -> None:
    reason = unsupported_reason(q.device, q.dtype, needs_grad, False, blocks, q.shape[-1])
    if reason is not None:
        raise RuntimeError(f"backend 'flex': {reason}")


def tile_options(block_q: int, block_kv: int, dtype: torch.dtype, head_dim: int) -> dict[str, int | bool]:
    """Forward kernel tiles for CUDA: the largest powers of two dividing the sparse blocks, capped
    by the sm90 default tiles of ``(dtype, head_dim)`` (smaller for fp32), 4 warps for small tiles.

    Key tiles stay at 64 for bf16 / fp16: torch 2.11's 128 x 128 forward tile (its sm90 default at D = 64)
    needed 240 KB of shared memory on an H200 at N = 65536 (limit 227 KB) and failed to compile; 128 x 64 ran
    the 128 x 128-block case in 4.06 / 10.9 ms fwd / fwd+bwd (B=2 H=8 D=64, 5 %), 2 stages of 128 x 128 4.53 /
    11.3 (2026-11-26).

    Also forces the main kernel (``FORCE_USE_FLEX_ATTENTION``): for fewer than 128 queries inductor takes its
    decoding kernel, which found no config for 16-token key blocks (``NoValidChoicesError``, torch 2.11, H100:
    N=73, fp16, D=32)."""
    if dtype == torch.float32:
        cap_m, cap_n = (128, 32) if head_dim <= 64 else (32, 32)
    else:
        cap_m, cap_n = (128, 64) if head_dim <= 128 else (64, 32)
    tile_m, tile_n = min(block_q & -block_q, cap_m), min(block_kv & -block_kv, cap_n)
    options = {"fwd_BLOCK_M": tile_m, "fwd_BLOCK_N": tile_n, "FORCE_USE_FLEX_ATTENTION": True}
    if tile_m * tile_n <= 64 * 64:
        options["fwd_num_warps"] = 4
    return options


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, score_mod,
           scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One compiled flex_attention call: ``o (B, H, Nq, D)`` and ``lse (B, H, Nq)`` (None on CPU)."""
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu":  # the C++ kernel misreads inputs that are views of 2-D buffers: copy
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        announce_cpu_compile(q, k, v, block_mask, score_mod)
        out = FLEX_ATTENTION(None, q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
        return out, None
    block_q, block_kv = block_mask.BLOCK_SIZE
    options = tile_options(block_q, block_kv, q.dtype, q.shape[-1])
    out, aux = FLEX_ATTENTION(_variant_key(q, k, v, block_mask, score_mod, options), q, k, v, score_mod=score_mod,
                              block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=options,
                              return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _check_no_p_quant(quantize_p: bool) -> None:
    if quantize_p:
        raise ValueError("backend 'flex' cannot quantize P (score_mod acts before the softmax); "
                         "use quant p='none' or backend='torch'")


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection,
                           scale: float, *, quantize_p: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of each query block over its selected key blocks (``BlockMask`` of the selection).

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``; selection.indices ``(B, H, Tq, K)``.
    ``quantize_p=True`` is an error (flex cannot quantize P).
    Returns ``o (B, H, Nq, D)`` in q's dtype and ``lse (B, H, Nq)`` fp32 (``None`` on CPU).
    """
    _check_no_p_quant(quantize_p)
    needs_grad = _needs_grad(q, k, v)
    _check(q, (selection.block_q, selection.block_k), needs_grad)
    return attend(q, k, v, block_selection_to_block_mask(selection, needs_grad), None, scale)


def llsa_score_mod(layout: LLSALayout):
    """score_mod adding ``ln(count)`` of the extended-KV token ``kv_idx`` (``-inf`` on padding), computed
    from ``kv_idx`` with integer arithmetic over the layout's segments (no captured buffer). One
    factory, so one ``__code__`` for every call; the layout's ints are guarded constants."""
    starts = [layout.start_block(level) * layout.block for level in range(layout.levels + 1)]
    spans = [level_span(layout.n, layout.block, level) for level in range(layout.levels + 1)]
    tokens = [layout.real_tokens(level) for level in range(layout.levels + 1)]

    def add_log_count(score, b, h, q_idx, kv_idx):
        log_count = torch.zeros_like(score)
        for start, span, n in zip(starts, spans, tokens):
            count = torch.clamp(n - (kv_idx - start) * span, min=0, max=span)
            log_count = torch.where(kv_idx >= start, torch.log(count.to(score.dtype)), log_count)
        return score + log_count

    return add_log_count


def llsa_attention(q: torch.Tensor, k_levels: list[torch.Tensor], v_levels: list[torch.Tensor],
                   selection: LLSASelection, scale: float, *,
                   quantize_p: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LLSA attention over the enriched multi-level KV, one softmax (semantics of
    ``flexsparse.triton.llsa.naive.llsa_attention``): one flex call over the concatenated pyramid, the ``ln(count)``
    weights (``-inf`` on padding) added by a score_mod.

    q: ``(B, H, N, D)``; k_levels[l], v_levels[l]: ``(B, Hk, T_l, D)`` for l = 0..L (any float dtype,
    cast to q's). ``quantize_p=True`` is an error (flex cannot quantize P).
    Returns ``o (B, H, N, D)`` in q's dtype and ``lse (B, H, N)`` fp32 (``None`` on CPU).
    """
    _check_no_p_quant(quantize_p)
    layout = llsa_layout(selection.n, selection.block, selection.levels)
    return llsa_extended_attention(q, k_levels, v_levels, llsa_block_ids(selection, layout), layout, scale)


def llsa_extended_attention(q: torch.Tensor, k_levels: list[torch.Tensor], v_levels: list[torch.Tensor],
                            ids: torch.Tensor, layout: LLSALayout,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each query block of q ``(B, H, Nq, D)`` over the blocks ``ids (B, H, ceil(Nq / b), K)`` of the extended KV
    ``[level 0 | ... | level L]`` of ``layout`` (semantics of ``flexsparse.triton.llsa.naive.extended_attention``):
    one flex call, the ``ln(count)`` weights added by a score_mod. Returns ``o`` in q's dtype, ``lse`` fp32
    (``None`` on CPU)."""
    needs_grad = _needs_grad(q, *k_levels, *v_levels)
    _check(q, (layout.block,), needs_grad)
    block_mask = block_mask_from_ids(ids, layout.num_blocks, layout.block, layout.block, (q.shape[2], layout.length),
                                     needs_grad)
    k, v = (llsa_naive.extended_kv(x, layout, q.dtype) for x in (k_levels, v_levels))
    return attend(q, k, v, block_mask, llsa_score_mod(layout), scale)


# On CUDA the block-level form runs compiled: inductor fuses the feature maps, casts, normaliser and their
# gradients (a dozen elementwise passes over (N, D) tensors in eager mode). Selections are tensors, so a new
# selection never recompiles. Static graphs for the first 16 call variants (shape, dtype, grad flags, ...) of
# the process, dynamic-shape ones after: torch's default, dynamic from the second shape on, is slower
# (up to 1.2x, H100), and a static graph per variant without a bound runs
# out of dynamo's recompile limit in one CLI run (12 variants: sla and sla2, three lengths, with and without grad).
KEEP_WEIGHTED_LINEAR = StaticThenDynamic(
    linear_naive.keep_weighted_linear, name="flexsparse.backends.flex_backend.KEEP_WEIGHTED_LINEAR", budget=16,
    recompile_limit=64)


def masked_linear_attention_dense_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                         selection: BlockSelection, *, feature_map: str, eps: float) -> torch.Tensor:
    """Same result as ``linear_naive.masked_linear_attention`` through block-level matmuls: ``H_i = (1 - M_i) @ h``
    with the ``(B, H, Tq, Tk)`` block map M of the skipped blocks. O(Tq * Tk * D^2) work on tensor-friendly
    matmuls instead of O(N * skipped * block_k) gathers, and no cancellation; used by the ``flex``
    backend on GPUs (the ``torch`` backend keeps the gather form: no ``(N/b)^2`` tensor). Compiled on CUDA
    (inside a user's ``torch.compile`` region it is traced with the rest)."""
    skipped = linear_naive.skipped_blocks(selection)
    if skipped.shape[-1] == selection.num_k_blocks:
        return q.new_zeros(q.shape)
    args = (q, k, v, skipped, selection.num_k_blocks, selection.block_q, selection.block_k, feature_map, eps)
    if not q.is_cuda:
        return linear_naive.keep_weighted_linear(*args)
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, grad_flags(q, k, v), skipped.shape, *args[4:])
    return KEEP_WEIGHTED_LINEAR(key, *args)


class FlexBackend(Backend):
    """Selection and linear branches in PyTorch, the softmax branches on FlexAttention (module docstring)."""

    name = "flex"

    def unsupported(self, device, dtype, needs_grad, needs_lse, blocks, head_dim, batch_heads=1):
        return unsupported_reason(device, dtype, needs_grad, needs_lse, blocks, head_dim)

    def quant_unsupported(self, quant: QuantConfig | None, branch: str | None) -> str | None:
        if quant is not None and quant.p != "none":
            return ("FlexAttention applies score_mod before its softmax, so it cannot quantize P; use quant "
                    "p='none' (Q, K, V quantized, P in the input precision) or backend='torch'")
        return None

    def quantized_operands(self, dtype, *tensors):
        """flex computes in the input dtype: fake-quantized values rounded to it."""
        return tuple(x.to(dtype) for x in tensors)

    def sparse_softmax(self, q, k, v, selection, scale, *, deterministic=False, quantize_p=False):
        return block_sparse_attention(q, k, v, selection, scale, quantize_p=quantize_p)

    def llsa_softmax(self, q, k_levels, v_levels, selection, scale, *, quantize_p=False):
        return llsa_attention(q, k_levels, v_levels, selection, scale, quantize_p=quantize_p)

    def llsa_extended_softmax(self, q, k_levels, v_levels, ids, layout, scale):
        return llsa_extended_attention(q, k_levels, v_levels, ids, layout, scale)

    def masked_linear_attention(self, q, k, v, selection, *, feature_map, eps):
        return masked_linear_attention_dense_blocks(q, k, v, selection, feature_map=feature_map, eps=eps)


class SmallBlockChoices(InductorChoices):
    """Inductor choices that add FlexAttention backward tiles of 64, 32 and 16 (16-bit dtypes).

    On sm90 the default bf16 backward tiles are (64, 128, 128, 64); sparse blocks that they do not
    divide leave no valid config (``NoValidChoicesError``); fp32 defaults are already 16. When
    several configs are valid, inductor autotunes among them. A custom choices class can mix this
    in: ``class MyChoices(SmallBlockChoices, MyBase)``.
    """

    def get_flex_attention_bwd_configs(self, head_dim, dtype, device_type="cuda"):
        configs = list(super().get_flex_attention_bwd_configs(head_dim, dtype, device_type))
        if dtype == torch.float32:  # the fp32 default tiles are already 16
            return configs
        base = configs[-1]
        for tile in (64, 32, 16):
            extra = dataclasses.replace(base, block_m1=tile, block_n1=tile, block_m2=tile, block_n2=tile,
                                        num_stages=min(base.num_stages, 3), num_warps=4)
            if extra not in configs:
                configs.append(extra)
        return configs

    def uuid(self):
        return "flexsparse-small-block-bwd-v1"


def install_small_block_choices() -> None:
    """Make inductor use ``SmallBlockChoices``, unless the user set another choices class (warn then)."""
    current = inductor_config.inductor_choices_class
    if current is None:
        inductor_config.inductor_choices_class = SmallBlockChoices
    elif not (isinstance(current, type) and issubclass(current, SmallBlockChoices)):
        warnings.warn(
            f"flexsparse: torch._inductor.config.inductor_choices_class is already {current!r}; flex backward "
            "with blocks smaller than 128 may raise NoValidChoicesError on Hopper. Mix in "
            "flexsparse.backends.flex_backend.SmallBlockChoices to fix it.", stacklevel=2)


if torch.cuda.is_available():
    install_small_block_choices()
