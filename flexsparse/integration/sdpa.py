"""``SparseSDPA``: a flexsparse method behind ``F.scaled_dot_product_attention``'s signature, the
``RouteSDPA`` mode that sends a module's SDPA calls to it, and ``set_step`` for dense warm-up.

A ``SparseSDPA`` says on the ``flexsparse.integration.sdpa`` logger (a child of ``"flexsparse"``) when it runs dense
attention instead of its method, once per reason (its first such call): at DEBUG for the intended reasons (``INTENDED``:
a ``"full"`` config, a warm-up step), at WARNING for the others (``attn_mask``, ``is_causal``, cross-attention with a
self-attention-only method, and, for routed modules, a forward that made no SDPA call or joined text tokens on a side
flexsparse does not know). ``strict=True`` turns the unintended ones into ``DenseFallbackError``.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..config import Config, Joint
from ..masks import TokenOrder, morton_order_2d, tile_order_3d
from ..methods import METHODS
from ..module import SparseAttention
from ..parallel import ParallelConfig, ulysses_attention
from .joint import CallText

logger = logging.getLogger(__name__)
INTENDED = ("full config", "warm-up")   # dense by design: logged at DEBUG and allowed under strict


class DenseFallbackError(RuntimeError):
    """A patched module with ``strict=True`` was about to run dense attention for an unintended reason (``attn_mask``,
    ``is_causal``, cross-attention with a self-attention-only method, a forward that bypasses SDPA)."""


class SparseSDPA(nn.Module):
    """``forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False)`` on ``(B, H, N, D)`` tensors, like ``F.scaled_dot_product_attention``.

    Runs the method of ``config`` through a ``SparseAttention`` (child ``attention``, so learned
    parameters live in ``state_dict``), and dense SDPA instead when the config is ``"full"``, during
    the dense warm-up (see ``set_step``), when a mask or ``is_causal`` is given, or when the method is
    self-attention only and the call is cross-attention (``Nq != Nk``); it logs each reason once (module docstring).
    A joint call's bool key padding mask of its text tokens runs the method (``text_padding``).

    strict: raise ``DenseFallbackError`` instead of running dense for an unintended reason (any but a ``"full"``
    config and warm-up). name: the module's qualified name in its model (``patch`` passes it), for the log and errors.

    ``forward(..., joint=)``: a ``flexsparse.Joint`` when the call's sequence (under sequence parallelism the whole,
    exchanged one) holds text tokens at its start or end (``flexsparse.attention``: the method selects among the
    visual tokens, every query attends every text token); patched modules pass it for their joint text+visual calls
    (``flexsparse.integration.joint``). A ``"full"`` config, warm-up and the other dense runs attend the whole
    sequence, which is the same attention.
    ``forward(..., dense=(reason, detail))``: run this call dense for ``reason``, logged (or raised under
    ``strict``) as the reasons above are.

    token_grid: ``(h, w)`` or ``(t, h, w)`` of a raster-ordered token sequence: the sparse method then
    sees the tokens in Z-order (``morton_order_2d``) or tile order (``tile_order_3d``, 4x4x4 tiles), so
    that its blocks are compact regions, and the output is put back in raster order. Attention is
    equivariant to a permutation of its tokens (RoPE is applied before), so this changes only which
    tokens share a block. In a joint call the grid covers the visual tokens (``h * w`` or ``t * h * w`` of them),
    and the text tokens keep their places. Keys and values are permuted when they have the queries' length.

    parallel: a ``flexsparse.ParallelConfig`` when the module gets this rank's shards of the sequence: every call,
    dense ones included, runs on the whole sequence for this rank's heads (``ulysses_attention``), the token grid
    being the whole sequence's; masks and ``is_causal`` are rejected. ``forward(..., parallel=)`` overrides it for
    one call (diffusers' context parallelism, ``flexsparse.integration.context_parallel``). Ulysses only: a
    ``"ring"`` dim of size > 1 is an error (the dense fallbacks and the token grid need the whole sequence).
    """

    def __init__(self, config: "Mapping[str, Any] | Config", *, head_dim: int, num_heads: int,
                 seq_len: int | None = None, backend: str = "auto", dense_warmup_steps: int = 0,
                 token_grid: Sequence[int] | None = None, parallel: ParallelConfig | None = None,
                 strict: bool = False, name: str | None = None):
        super().__init__()
        self.config = Config.from_dict(config)
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool, got {strict!r}")
        self.strict, self.name = strict, name
        self._reported: set[str] = set()   # the dense reasons logged so far
        self.parallel = _ulysses_only(parallel)
        self._diffusers_parallel = None   # (diffusers ContextParallelConfig, ParallelConfig built from it)
        if isinstance(dense_warmup_steps, bool) or not isinstance(dense_warmup_steps, int) or dense_warmup_steps < 0:
            raise ValueError(f"dense_warmup_steps must be an int >= 0, got {dense_warmup_steps!r}")
        self.dense_warmup_steps = dense_warmup_steps
        self.dense = False
        full = self.config.method == "full"
        self.self_attention_only = not full and METHODS[self.config.method].self_attention
        self.attention = None if full else SparseAttention(self.config, head_dim=head_dim, num_heads=num_heads,
                                                           seq_len=seq_len, backend=backend)
        order = grid_order(token_grid)
        self.token_grid = None if order is None else tuple(token_grid)
        self.register_buffer("perm", None if order is None else order.perm, persistent=False)
        self.register_buffer("inverse", None if order is None else order.inverse, persistent=False)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False, *, parallel: ParallelConfig | None = None,
                joint: "Joint | Mapping[str, Any] | None" = None,
                dense: tuple[str, str] | None = None) -> torch.Tensor:
        if query.dim() == key.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
            raise ValueError(f"query has {query.shape[-3]} heads and key {key.shape[-3]}: as with "
                             "F.scaled_dot_product_attention, grouped-query attention needs enable_gqa=True")
        joint = Joint.from_value(joint)
        parallel = self.parallel if parallel is None else _ulysses_only(parallel)
        if parallel is None or not parallel.communicates:
            return self._attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, None, joint,
                                dense)
        if attn_mask is not None or is_causal:
            raise ValueError("sequence-parallel attention (parallel=...) gets sequence shards and cannot apply "
                             "attn_mask or is_causal; patch only modules that attend without them")

        def attend_heads(q, k, v, heads: slice):
            return self._attend(q, k, v, None, dropout_p, False, scale, q.shape[1] != k.shape[1], heads, joint,
                                dense), None
        return ulysses_attention(query, key, value, attend_heads, parallel)

    def _attend(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, heads: slice | None,
                joint: Joint | None, dense: tuple[str, str] | None):
        """The call in this process on the whole sequence; ``heads``: the slice of the query heads that q holds
        (sequence parallelism), ``None`` for all of them."""
        reason = self._dense_reason(query, key, attn_mask, is_causal, dense)
        if reason is not None and reason[0] == "attn_mask" and joint is not None:
            padding = text_padding(attn_mask, joint, query)
            if padding is not None:
                joint, attn_mask = Joint(joint.text, joint.length, padding), None
                reason = self._dense_reason(query, key, None, is_causal, dense)
        if reason is not None:
            self.fallback(*reason)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if dropout_p:
            raise ValueError(f"dropout_p={dropout_p} is not supported by sparse attention; set the attention "
                             "dropout of the patched module to 0 (or use model.eval())")

        def sparse(q, k, v):
            if heads is None:
                return self.attention(q, k, v, scale=scale, joint=joint)
            return self.attention.forward_heads(q, k, v, heads, scale=scale, joint=joint)
        if self.perm is None:
            return sparse(query, key, value)
        perm, inverse = self._order(query.shape[-2], joint)
        if key.shape[-2] == query.shape[-2]:
            key, value = key[..., perm, :], value[..., perm, :]
        return sparse(query[..., perm, :], key, value)[..., inverse, :]

    def _order(self, n: int, joint: Joint | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The token grid's permutation of a call's ``n`` tokens and its inverse: of the visual tokens of a joint
        call (its text tokens stay in place), else of them all."""
        n_grid, n_text = self.perm.numel(), 0 if joint is None else joint.length
        if n - n_text != n_grid:
            text = f", {n_text} of them text" if n_text else ""
            raise ValueError(f"token_grid={self.token_grid} has {n_grid} tokens but the attention got {n} "
                             f"queries{text}")
        if not n_text:
            return self.perm, self.inverse
        text, visual = (torch.arange(n, device=self.perm.device)[part] for part in joint.slices(n))
        return joint.join(text, visual[self.perm], dim=0), joint.join(text, visual[self.inverse], dim=0)

    def _dense_reason(self, query, key, attn_mask, is_causal, dense) -> tuple[str, str] | None:
        """``(reason, detail)`` when this call runs dense SDPA, None when the method runs it."""
        if self.attention is None:
            return "full config", "its config is 'full'"
        if self.dense:
            return "warm-up", f"a step below dense_warmup_steps={self.dense_warmup_steps} (flexsparse.set_step)"
        if attn_mask is not None:
            return "attn_mask", ("the call passes attn_mask, which sparse methods do not apply (but a joint call's "
                                 "bool key padding of its text tokens)")
        if is_causal:
            return "is_causal", "the call passes is_causal=True, which sparse methods do not apply"
        if dense is not None:
            return dense
        if self.self_attention_only and query.shape[-2] != key.shape[-2]:
            return "cross-attention", (f"{query.shape[-2]} queries attend {key.shape[-2]} keys and method "
                                       f"{self.config.method!r} is self-attention only")
        return None

    def fallback(self, reason: str, detail: str) -> None:
        """Say that this module runs dense attention for ``reason`` (``detail``: why, what to do): logged on its first
        occurrence only, at DEBUG if it is ``INTENDED``, else at WARNING, where ``strict`` raises
        ``DenseFallbackError`` instead. Inside a compiled region nothing is logged (dynamo does not trace logging:
        the eager calls log)."""
        intended = reason in INTENDED
        if self.strict and not intended:
            raise DenseFallbackError(f"{self.label} would run dense attention ({reason}): {detail}; "
                                     "strict=True makes this an error")
        if torch.compiler.is_compiling() or reason in self._reported:
            return
        self._reported.add(reason)
        logger.log(logging.DEBUG if intended else logging.WARNING, "%s runs dense attention (%s): %s", self.label,
                   reason, detail)

    @property
    def label(self) -> str:
        """How messages name this module: by its ``name`` when it has one."""
        return "a SparseSDPA" if self.name is None else f"module {self.name or '<root>'!r}"

    def extra_repr(self) -> str:
        return (f"config={self.config.to_dict()}, dense_warmup_steps={self.dense_warmup_steps}, "
                f"token_grid={self.token_grid}, strict={self.strict}")


def text_padding(attn_mask: torch.Tensor, joint: Joint, query: torch.Tensor) -> torch.Tensor | None:
    """The ``(B, n_text)`` text key mask (``Joint.mask``) of a joint call whose ``attn_mask`` is a bool key padding
    mask ``(B or 1, 1, 1, N)`` that keeps every visual token (HunyuanVideo's, padding its prompts), else None.
    Eagerly the visual part is checked on the host (``_keeps_visual``; a mask on visual tokens runs dense); in a
    compiled graph by ``torch._assert_async`` (no graph break; a mask on visual tokens fails the assert)."""
    n = query.shape[-2]
    if (attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or tuple(attn_mask.shape[1:3]) != (1, 1)
            or attn_mask.shape[3] != n or attn_mask.shape[0] not in (1, query.shape[0])):
        return None
    keys = attn_mask[:, 0, 0].expand(query.shape[0], n)
    text, visual = joint.slices(n)
    if torch.compiler.is_compiling():
        torch._assert_async(keys[:, visual].all(), "flexsparse: a joint call's attn_mask masks visual tokens, which "
                                                   "sparse methods cannot apply (it runs dense eagerly)")
    elif not _keeps_visual(attn_mask, keys, joint, visual):
        return None
    return keys[:, text]


_LAST_CHECKED: list = [None]   # (weak reference to an attn_mask, its tag, whether it keeps the visual tokens)


def _keeps_visual(attn_mask: torch.Tensor, keys: torch.Tensor, joint: Joint, visual: slice) -> bool:
    """Whether ``keys`` (``attn_mask``'s rows) keep every visual token: one host sync, remembered for the last mask
    checked, since a model passes one mask tensor to every block of a forward (HunyuanVideo's): a sync per forward,
    not per layer. Another mask, or the same changed in place (its version counter), is checked anew; inference
    tensors, which count no versions, every time."""
    tag = None if attn_mask.is_inference() else (attn_mask._version, tuple(attn_mask.shape), joint.text, joint.length)
    last = _LAST_CHECKED[0]
    if tag is not None and last is not None and last[0]() is attn_mask and last[1] == tag:
        return last[2]
    kept = bool(keys[:, visual].all())
    _LAST_CHECKED[0] = None if tag is None else (weakref.ref(attn_mask), tag, kept)
    return kept


def _ulysses_only(parallel) -> ParallelConfig | None:
    parallel = ParallelConfig.check(parallel)
    if parallel is not None and parallel.ring_degree > 1:
        raise ValueError(f"patched attention (SparseSDPA) runs Ulysses sequence parallelism only, got a 'ring' dim "
                         f"of size {parallel.ring_degree}: its dense fallbacks and token grid need the whole "
                         f"sequence on a rank; call flexsparse.attention or SparseAttention for ring attention")
    return parallel


def grid_order(token_grid: Sequence[int] | None) -> TokenOrder | None:
    """Z-order of an ``(h, w)`` grid, tile order of a ``(t, h, w)`` grid, or None."""
    if token_grid is None:
        return None
    if not isinstance(token_grid, (list, tuple)) or len(token_grid) not in (2, 3):
        raise ValueError(f"token_grid must be (h, w) or (t, h, w), got {token_grid!r}")
    try:
        return morton_order_2d(*token_grid) if len(token_grid) == 2 else tile_order_3d(*token_grid)
    except ValueError as err:
        raise ValueError(f"token_grid={token_grid!r}: {err}") from err


class RouteSDPA(TorchFunctionMode):
    """Inside ``with RouteSDPA(site):`` every ``F.scaled_dot_product_attention`` call goes to ``site``
    (a ``SparseSDPA``); other torch functions run unchanged. Traceable by ``torch.compile``. With ``parallel``, the
    calls run under that config; with ``text`` (the ``CallText`` of the module's call), a call over its joint
    sequence gets ``joint`` (or ``dense``: ``CallText.sdpa_arguments``), a ValueError for a sparse method under
    sequence parallelism where each rank joins its own text and visual shards (``CallText.per_rank``). ``calls``
    counts them."""

    def __init__(self, site: SparseSDPA, parallel: ParallelConfig | None = None, text: CallText | None = None):
        super().__init__()
        self.site = site
        self.parallel = parallel
        self.text = text
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.unflatten and not kwargs and len(args) == 3 and isinstance(args[1], int):
            # the aten op: dynamo (torch <= 2.13) cannot trace Tensor.unflatten's ``super().unflatten`` under a mode
            return torch.ops.aten.unflatten.int(*args)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        extra = {} if self.parallel is None else {"parallel": self.parallel}
        if self.text is not None:
            extra.update(self._text_arguments(args, kwargs))
        return self.site(*args, **kwargs, **extra)

    def _text_arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """``CallText.sdpa_arguments`` of the SDPA call ``(*args, **kwargs)``; a ValueError for a joint call joined
        per rank under sequence parallelism with a sparse method."""
        query, key = (args[i] if len(args) > i else kwargs[name] for i, name in enumerate(("query", "key")))
        found = self.text.sdpa_arguments(query.shape[-2], key.shape[-2])
        parallel = self.parallel if self.parallel is not None else self.site.parallel
        if ("joint" in found and self.text.per_rank and self.site.attention is not None and parallel is not None
                and parallel.communicates):
            raise ValueError(f"{self.site.label} got a joint text+visual sequence ({self.text.owner} joins its text) "
                             "under sequence parallelism: each rank joins its own text and visual shards, so the "
                             "exchanged sequence interleaves them and a sparse method cannot tell them apart; give "
                             "this module the 'full' config (overrides=)")
        return found


def set_step(model: nn.Module, step: int | None) -> None:
    """Tell the patched attention of ``model`` which diffusion step runs next (0 = the first): steps
    below a site's ``dense_warmup_steps`` run dense. ``None`` (the default state, for training) runs
    sparse at every call."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be an int >= 0 or None, got {step!r}")
    sites = [m for m in model.modules() if isinstance(m, SparseSDPA)]
    if not sites:
        raise ValueError("model has no flexsparse attention; call flexsparse.patch(model, config) first")
    for site in sites:
        site.dense = step is not None and step < site.dense_warmup_steps
