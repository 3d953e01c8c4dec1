"""What a method is: select -> attend (-> combine), plus the dense reference of the same computation.

A method never names a backend: ``select`` and ``attend`` ask the ``Backend`` they are given for every step
(``flexsparse.backends.base``), so one selection feeds every backend and a method that yields a block selection runs
on all of them. ``reference`` is the method's dense O(N^2) spec on the selection ``select`` made; the ``reference``
backend runs it in place of ``attend``. A call runs ``fit``'s config: blocks longer than the sequence shrunk to it, so
that no step's memory grows with a block size past the input.
"""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from ..config import Config
from ..masks import fit_block

ALL_BACKENDS = ("reference", "torch", "flex", "triton")
BLOCK_SIDES = {"block_q": 0, "block_k": 1, "block_size": 0}   # block keys and what they tile: q's (0) or k's tokens


class SeqLenRequired(ValueError):
    """A method whose parameters are laid out along the sequence was given no ``seq_len``; callers that take
    ``seq_len`` themselves (``patch``) say how to pass it to them."""


class Method:
    """Base of the methods; one instance per method is registered in ``flexsparse.methods.METHODS``."""

    name: ClassVar[str]
    config: ClassVar[type[Config]]
    example: ClassVar[dict]                       # a config of the method, for the demo, benchmarks and tests
    backends: ClassVar[tuple[str, ...]] = ALL_BACKENDS
    self_attention: ClassVar[bool] = True         # q and k must have the same length
    keeps_views: ClassVar[bool] = False           # its triton kernels read strided q, k, v in place
    sparse_branch: ClassVar[str | None] = "block"  # what ``quant`` quantizes: "block", "llsa" or None
    ring: ClassVar[str | None] = None             # its ring strategy (``flexsparse.parallel.ring``), if any

    def fit(self, cfg, n_q: int, n_k: int) -> Config:
        """The config a call over ``n_q`` queries and ``n_k`` keys runs with: each block (``BLOCK_SIDES``) longer
        than its sequence replaced by ``flexsparse.masks.fit_block``'s, which covers the sequence alike (the same
        results); ``cfg`` itself when no block changes."""
        lengths, changes = (n_q, n_k), {}
        for key, side in BLOCK_SIDES.items():
            block = getattr(cfg, key, None)
            if block is not None and block > lengths[side] and fit_block(block, lengths[side]) != block:
                changes[key] = fit_block(block, lengths[side])
        return cfg.replace(**changes) if changes else cfg

    def init_params(self, cfg, head_dim: int, num_heads: int, seq_len: int | None) -> dict[str, torch.Tensor]:
        """Initial learnable parameters (fp32), by name; ``{}`` for methods without any."""
        return {}

    def frozen_params(self, cfg) -> tuple[str, ...]:
        """Names of the learnable parameters that this config passes no gradient to: ``SparseAttention`` registers
        them with ``requires_grad=False``, so that optimizers, DDP and ``torch.cuda.make_graphed_callables`` see
        only parameters that train."""
        return ()

    def head_params(self, cfg) -> tuple[str, ...]:
        """Names of the learnable parameters with one row per query head (leading dim H): sequence parallelism
        gives each rank the rows of its heads."""
        return ()

    def check_params(self, cfg, q: torch.Tensor, params: Mapping[str, torch.Tensor] | None) -> dict:
        """The parameters a call uses, after checking them against q ``(B, H, N, D)`` (clear errors); here, for
        configs without learnable parameters: none may be given."""
        if params:
            raise ValueError(f"method {self.name!r} with this config has no learnable parameters, got params "
                             f"{sorted(params)}")
        return {}

    def select(self, q, k, v, cfg, backend, params: dict) -> Any:
        """The selection (with whatever the attend step reuses, e.g. pooled tensors); no gradient through indices."""
        raise NotImplementedError

    def attend(self, q, k, v, selection, cfg, backend, *, scale: float, params: dict,
               need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``o (B, H, Nq, D)`` in q's dtype and the natural-log LSE ``(B, H, Nq)`` of the softmax branch (``None``
        where the backend gives none and ``need_lse`` is False)."""
        raise NotImplementedError

    def reference(self, q, k, v, selection, cfg, *, scale: float, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense spec of ``attend`` on the same selection: ``(o, lse)``."""
        raise NotImplementedError


def require_params(method: str, params: Mapping[str, torch.Tensor] | None,
                   shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``params`` restricted to ``shapes``' names, after checking names and shapes (clear errors)."""
    names = list(shapes)
    if not params:
        raise ValueError(
            f"method {method!r} has learnable parameters {names}; use flexsparse.SparseAttention(config, "
            f"head_dim=..., num_heads=...) or pass params=flexsparse.methods.METHODS[{method!r}].init_params(...)")
    missing = [name for name in names if name not in params]
    unknown = sorted(set(params) - set(names))
    if missing or unknown:
        raise ValueError(f"params for method {method!r} must have exactly the keys {names}; "
                         f"missing {missing}, unknown {unknown}")
    for name, shape in shapes.items():
        value = params[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"params[{name!r}] must be a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"params[{name!r}] must have shape {tuple(shape)}, got {tuple(value.shape)}")
    return {name: params[name] for name in names}
