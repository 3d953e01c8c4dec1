"""``flexsparse.patch``: swap the attention of an existing model for a flexsparse method, in place.

Each patched module gets a ``SparseSDPA`` (learned parameters included) registered as a submodule, so
``state_dict`` saves and loads it: a diffusers-style ``Attention`` with the stock processor gets a
``FlexSparseAttnProcessor`` (keys ``<name>.processor.flexsparse.*``); any other module keeps its code
and its ``F.scaled_dot_product_attention`` calls are routed to ``<name>.flexsparse`` (modules with a
timm-style ``fused_attn`` flag get ``fused_attn = True`` so that they call SDPA). ``unpatch`` undoes it.
Under diffusers' context parallelism, patched modules exchange the sequence shards themselves
(``flexsparse.integration.context_parallel``), whether ``patch`` runs before or after ``enable_parallelism``.
"""
from __future__ import annotations

import types
from typing import Any, Mapping

import torch
from torch import nn

from ..config import Config
from ..parallel import ParallelConfig
from .context_parallel import context_parallel_config, routed_call
from .processor import FlexSparseAttnProcessor
from .sdpa import SparseSDPA
from .sites import find_sites, head_geometry
from .spec import PatchSpec

SITE = "flexsparse"          # attribute of the SparseSDPA on a routed module
RECORD = "_flexsparse_patch"  # what patch changed on a module, for unpatch


def patch(model: nn.Module, config: "Mapping[str, Any] | Config", *, layers: "str | list[str] | None" = None,
          overrides: Mapping | None = None, dense_warmup_steps: int | None = None,
          token_grid: "tuple[int, ...] | None" = None, seq_len: int | None = None, head_dim: int | None = None,
          num_heads: int | None = None, backend: str = "auto",
          parallel: ParallelConfig | None = None) -> dict[str, Config]:
    """Swap the attention of ``model`` (in place) for the method of ``config``.

    config: a method config dict, optionally with the patch keys ``layers``, ``overrides``,
        ``dense_warmup_steps`` and ``token_grid`` (see ``flexsparse.integration.spec``), which may also
        be given as keywords.
    layers: module-name globs of the modules to patch; default: every diffusers-style self-attention
        and timm-style attention. Other modules that call ``F.scaled_dot_product_attention`` need a glob.
    overrides: ``{layer index or name glob: "full" | config dict}``, e.g. ``{0: "full", -1: "full"}``.
    dense_warmup_steps: inference steps run dense after ``flexsparse.set_step(model, step)``.
    token_grid: ``(h, w)`` or ``(t, h, w)`` when the model's tokens are a raster grid: the sparse
        method then sees them in Z-order / tile order (see ``SparseSDPA``).
    seq_len: the sequence length SLA2 stores its per-block alpha at (calls at other lengths interpolate it).
    head_dim, num_heads: the query geometry, when it cannot be read from the modules.
    parallel: a ``flexsparse.ParallelConfig`` when the model runs sequence parallel (each rank holds a shard of the
        tokens): the patched attention exchanges the shards (``SparseSDPA``). Not needed under diffusers'
        ``enable_parallelism`` (Ulysses), whose mesh is used; if given, it must be over the same group.
    Returns ``{module name: config}`` of the patched modules.
    """
    spec = PatchSpec.from_config(config, layers=layers, overrides=overrides, dense_warmup_steps=dense_warmup_steps,
                                 token_grid=token_grid)
    if any(hasattr(m, RECORD) for m in model.modules()):
        raise ValueError("model is already patched; call flexsparse.unpatch(model) first")
    sites = find_sites(model, spec.layers)
    configs = spec.configs([name for name, _, _ in sites])
    built = []
    for (name, module, kind), cfg in zip(sites, configs):
        options = dict(seq_len=seq_len, backend=backend, dense_warmup_steps=spec.dense_warmup_steps,
                       token_grid=spec.token_grid, parallel=parallel,
                       **head_geometry(name, module, kind, head_dim, num_heads))
        try:
            built.append((FlexSparseAttnProcessor if kind == "processor" else SparseSDPA)(cfg, **options))
        except (TypeError, ValueError) as err:
            raise type(err)(f"patching module {name!r}: {err}") from err
    inherited = getattr(model, "_parallel_config", None)   # diffusers' enable_parallelism ran before patch
    for (_, module, kind), new in zip(sites, built):
        if kind == "processor":
            if context_parallel_config(inherited) is not None:
                new._parallel_config = inherited
            _install_processor(module, new)
        else:
            _install_route(module, new)
    return dict(zip([name for name, _, _ in sites], configs))


def unpatch(model: nn.Module) -> list[str]:
    """Undo ``patch`` (the learned sparse parameters are dropped); returns the restored module names."""
    restored = []
    for name, module in list(model.named_modules()):
        record = module.__dict__.pop(RECORD, None)
        if record is None:
            continue
        if record["kind"] == "processor":
            module.set_processor(record["processor"])
        else:
            del module.forward
            if record["forward"] is not None:
                module.forward = record["forward"]
            delattr(module, SITE)
            if "fused_attn" in record:
                module.fused_attn = record["fused_attn"]
        restored.append(name)
    if not restored:
        raise ValueError("model is not patched")
    return restored


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters(), torch.empty(0)).device


def _install_processor(module: nn.Module, processor: FlexSparseAttnProcessor) -> None:
    record = {"kind": "processor", "processor": module.processor}
    module.set_processor(processor.to(_device_of(module)))
    module.__dict__[RECORD] = record


def _install_route(module: nn.Module, site: SparseSDPA) -> None:
    record = {"kind": "route", "forward": module.__dict__.get("forward")}   # e.g. an accelerate hook
    if isinstance(getattr(module, "fused_attn", None), bool):   # timm's switch between SDPA and its own math
        record["fused_attn"] = module.fused_attn
        module.fused_attn = True
    module.add_module(SITE, site.to(_device_of(module)))
    module.forward = types.MethodType(_routed_forward, module)
    module.__dict__[RECORD] = record


def _routed_forward(self: nn.Module, *args, **kwargs):
    """The module's forward (an instance-level one it had before patching, else its class's) with its
    SDPA calls sent to its ``SparseSDPA``."""
    previous = self.__dict__[RECORD]["forward"]

    def forward():
        if previous is None:
            return type(self).forward(self, *args, **kwargs)
        return previous(*args, **kwargs)
    return routed_call(self, getattr(self, SITE), forward, args, kwargs)
