"""``SparseSDPA``: a flexsparse method behind ``F.scaled_dot_product_attention``'s signature, the
``RouteSDPA`` mode that sends a module's SDPA calls to it, and ``set_step`` for dense warm-up."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..config import Config
from ..masks import TokenOrder, morton_order_2d, tile_order_3d
from ..methods import METHODS
from ..module import SparseAttention
from ..parallel import ParallelConfig, ulysses_attention


class SparseSDPA(nn.Module):
    """``forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False)`` on ``(B, H, N, D)`` tensors, like ``F.scaled_dot_product_attention``.

    Runs the method of ``config`` through a ``SparseAttention`` (child ``attention``, so learned
    parameters live in ``state_dict``), and dense SDPA instead when the config is ``"full"``, during
    the dense warm-up (see ``set_step``), when a mask or ``is_causal`` is given, or when the method is
    self-attention only and the call is cross-attention (``Nq != Nk``).

    token_grid: ``(h, w)`` or ``(t, h, w)`` of a raster-ordered token sequence: the sparse method then
    sees the tokens in Z-order (``morton_order_2d``) or tile order (``tile_order_3d``, 4x4x4 tiles), so
    that its blocks are compact regions, and the output is put back in raster order. Attention is
    equivariant to a permutation of its tokens (RoPE is applied before), so this changes only which
    tokens share a block. Keys and values are permuted when they have the grid's length.

    parallel: a ``flexsparse.ParallelConfig`` when the module gets this rank's shards of the sequence: every call,
    dense ones included, runs on the whole sequence for this rank's heads (``ulysses_attention``), the token grid
    being the whole sequence's; masks and ``is_causal`` are rejected. ``forward(..., parallel=)`` overrides it for
    one call (diffusers' context parallelism, ``flexsparse.integration.context_parallel``). Ulysses only: a
    ``"ring"`` dim of size > 1 is an error (the dense fallbacks and the token grid need the whole sequence).
    """

    def __init__(self, config: "Mapping[str, Any] | Config", *, head_dim: int, num_heads: int,
                 seq_len: int | None = None, backend: str = "auto", dense_warmup_steps: int = 0,
                 token_grid: Sequence[int] | None = None, parallel: ParallelConfig | None = None):
        super().__init__()
        self.config = Config.from_dict(config)
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
                enable_gqa: bool = False, *, parallel: ParallelConfig | None = None) -> torch.Tensor:
        if query.dim() == key.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
            raise ValueError(f"query has {query.shape[-3]} heads and key {key.shape[-3]}: as with "
                             "F.scaled_dot_product_attention, grouped-query attention needs enable_gqa=True")
        parallel = self.parallel if parallel is None else _ulysses_only(parallel)
        if parallel is None or not parallel.communicates:
            return self._attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, None)
        if attn_mask is not None or is_causal:
            raise ValueError("sequence-parallel attention (parallel=...) gets sequence shards and cannot apply "
                             "attn_mask or is_causal; patch only modules that attend without them")

        def attend_heads(q, k, v, heads: slice):
            return self._attend(q, k, v, None, dropout_p, False, scale, q.shape[1] != k.shape[1], heads), None
        return ulysses_attention(query, key, value, attend_heads, parallel)

    def _attend(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, heads: slice | None):
        """The call in this process on the whole sequence; ``heads``: the slice of the query heads that q holds
        (sequence parallelism), ``None`` for all of them."""
        cross = query.shape[-2] != key.shape[-2]
        if (self.attention is None or self.dense or attn_mask is not None or is_causal
                or (cross and self.self_attention_only)):
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if dropout_p:
            raise ValueError(f"dropout_p={dropout_p} is not supported by sparse attention; set the attention "
                             "dropout of the patched module to 0 (or use model.eval())")

        def sparse(q, k, v):
            if heads is None:
                return self.attention(q, k, v, scale=scale)
            return self.attention.forward_heads(q, k, v, heads, scale=scale)
        if self.perm is None:
            return sparse(query, key, value)
        n = self.perm.numel()
        if query.shape[-2] != n:
            raise ValueError(f"token_grid={self.token_grid} has {n} tokens but the attention got "
                             f"{query.shape[-2]} queries")
        query = query[..., self.perm, :]
        if key.shape[-2] == n:
            key, value = key[..., self.perm, :], value[..., self.perm, :]
        return sparse(query, key, value)[..., self.inverse, :]

    def extra_repr(self) -> str:
        return (f"config={self.config.to_dict()}, dense_warmup_steps={self.dense_warmup_steps}, "
                f"token_grid={self.token_grid}")


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
    calls run under that config and ``calls`` counts them."""

    def __init__(self, site: SparseSDPA, parallel: ParallelConfig | None = None):
        super().__init__()
        self.site = site
        self.parallel = parallel
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if self.parallel is None:
                return self.site(*args, **kwargs)
            self.calls += 1
            return self.site(*args, parallel=self.parallel, **kwargs)
        return func(*args, **kwargs)


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
