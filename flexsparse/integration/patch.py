"""``flexsparse.patch``: swap the attention of an existing model for a flexsparse method, in place.

Each patched module gets a ``SparseSDPA`` (learned parameters included) registered as a submodule, so
``state_dict`` saves and loads it: a diffusers-style ``Attention`` with the stock processor gets a
``FlexSparseAttnProcessor`` (keys ``<name>.processor.flexsparse.*``); any other module keeps its code
and its ``F.scaled_dot_product_attention`` calls are routed to ``<name>.flexsparse`` (modules with a
timm-style ``fused_attn`` flag get ``fused_attn = True`` so that they call SDPA). ``unpatch`` undoes it.
Routed modules attend their joint text+visual calls as such (``flexsparse.integration.joint``): the forward of the
block around a single-stream module is wrapped too, to hand it its call's text length. Under diffusers' context
parallelism, patched modules exchange the sequence shards themselves (``flexsparse.integration.context_parallel``),
whether ``patch`` runs before or after ``enable_parallelism``.

``patch`` logs a summary at INFO on the ``flexsparse.integration.patch`` logger (what it patched, with which
methods, and the attention-like modules it skipped and why) and returns it as a ``PatchReport``.
"""
from __future__ import annotations

import logging
import types
from collections import Counter
from typing import Any, Mapping

import torch
from torch import nn

from ..config import Config
from ..methods import SeqLenRequired
from ..parallel import ParallelConfig
from .context_parallel import context_parallel_config, routed_call
from .joint import (BLOCK_TEXT, SINGLE_STREAM_BLOCKS, call_text, is_single_stream, joined_text, prefix_tokens,
                    text_positions)
from .processor import FlexSparseAttnProcessor
from .sdpa import SparseSDPA
from .sites import block_of, find_sites, head_geometry, skipped_sites
from .spec import PatchSpec

logger = logging.getLogger(__name__)
SITE = "flexsparse"          # attribute of the SparseSDPA on a routed module
RECORD = "_flexsparse_patch"  # what patch changed on a module, for unpatch
LISTED = 4                   # module names listed per skip reason in the summary


class PatchReport(dict):
    """What ``patch`` returns: ``{module name: config}`` of the patched modules in patch order (a plain dict to
    every dict operation) and ``skipped``, ``{module name: reason}`` of the attention-like modules it left alone
    (``sites.skipped_sites``); ``summary()`` is the line that ``patch`` logs."""

    def __init__(self, patched: Mapping[str, Config], skipped: Mapping[str, str], dense_warmup_steps: int = 0):
        super().__init__(patched)
        self.skipped = dict(skipped)
        self.dense_warmup_steps = dense_warmup_steps

    def summary(self) -> str:
        methods = ", ".join(f"{method}: {count}" for method, count in Counter(c.method for c in self.values()).items())
        warmup = f", dense warm-up: {self.dense_warmup_steps} steps" if self.dense_warmup_steps else ""
        text = f"patched {_modules(len(self))} ({methods}{warmup}); skipped {_modules(len(self.skipped))}"
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.skipped.items():
            by_reason.setdefault(reason, []).append(name or "<root>")
        return "; ".join([text, *(f"{len(names)} {reason}: {_listed(names)}" for reason, names in by_reason.items())])


def _modules(count: int) -> str:
    return f"{count} attention module{'' if count == 1 else 's'}"


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more


def patch(model: nn.Module, config: "Mapping[str, Any] | Config", *, layers: "str | list[str] | None" = None,
          overrides: Mapping | None = None, dense_warmup_steps: int | None = None,
          token_grid: "tuple[int, ...] | None" = None, seq_len: int | None = None, head_dim: int | None = None,
          num_heads: int | None = None, backend: str = "auto", parallel: ParallelConfig | None = None,
          strict: bool = False) -> PatchReport:
    """Swap the attention of ``model`` (in place) for the method of ``config``.

    config: a method config dict, optionally with the patch keys ``layers``, ``overrides``,
        ``dense_warmup_steps`` and ``token_grid`` (see ``flexsparse.integration.spec``), which may also
        be given as keywords.
    layers: module-name globs of the modules to patch; default: every diffusers-style self-attention (single-stream
        ones, without ``to_out``, where their block's forward takes ``encoder_hidden_states``) and timm-style
        attention. Other modules that call ``F.scaled_dot_product_attention`` need a glob.
    overrides: ``{layer index or name glob: "full" | config dict}``, e.g. ``{0: "full", -1: "full"}``.
    dense_warmup_steps: inference steps run dense after ``flexsparse.set_step(model, step)``.
    token_grid: ``(h, w)`` or ``(t, h, w)`` when the model's tokens are a raster grid: the sparse
        method then sees them in Z-order / tile order (see ``SparseSDPA``). In joint text+visual calls it is the
        grid of the visual tokens.
    seq_len: the sequence length SLA2 stores its per-block alpha at (calls at other lengths interpolate it).
    head_dim, num_heads: the query geometry, when it cannot be read from the modules.
    parallel: a ``flexsparse.ParallelConfig`` when the model runs sequence parallel (each rank holds a shard of the
        tokens): the patched attention exchanges the shards (``SparseSDPA``). Not needed under diffusers'
        ``enable_parallelism`` (Ulysses), whose mesh is used; if given, it must be over the same group.
    strict: make every unintended dense run of a patched module an error (``DenseFallbackError`` naming the module
        and the reason: ``attn_mask``, ``is_causal``, cross-attention with a self-attention-only method, a routed
        forward that made no SDPA call, e.g. under a diffusers attention backend other than ``"native"``, a joint
        call whose text side is unknown); a ``"full"`` config and warm-up steps stay dense. Without it each reason
        is logged once per module (``SparseSDPA``).
    Joint text+visual calls of routed modules (diffusers' joint blocks: Flux, SD3, CogVideoX, HunyuanVideo; Flux's
    single-stream blocks; a ViT's class token) get ``joint=flexsparse.Joint(...)``: the method selects among the
    visual tokens and every query attends every text token (``flexsparse.integration.joint``).
    Returns a ``PatchReport``: ``{module name: config}`` of the patched modules, with the skipped ones in
    ``.skipped``; its summary is logged at INFO.
    """
    spec = PatchSpec.from_config(config, layers=layers, overrides=overrides, dense_warmup_steps=dense_warmup_steps,
                                 token_grid=token_grid)
    if any(hasattr(m, RECORD) for m in model.modules()):
        raise ValueError("model is already patched; call flexsparse.unpatch(model) first")
    sites = find_sites(model, spec.layers)
    names = [name for name, _, _ in sites]
    skipped = skipped_sites(model, names, spec.layers)
    configs = spec.configs(names)
    built = []
    for (name, module, kind), cfg in zip(sites, configs):
        options = dict(seq_len=seq_len, backend=backend, dense_warmup_steps=spec.dense_warmup_steps,
                       token_grid=spec.token_grid, parallel=parallel, strict=strict, name=name,
                       **head_geometry(name, module, kind, head_dim, num_heads))
        try:
            built.append((FlexSparseAttnProcessor if kind == "processor" else SparseSDPA)(cfg, **options))
        except SeqLenRequired as err:
            raise ValueError(f"patching module {name!r}: method {cfg.method!r} stores parameters per query block "
                             f"of seq_len tokens: pass flexsparse.patch(model, config, seq_len=N), N the token count "
                             f"of the model's attention calls (other lengths interpolate them)") from err
        except (TypeError, ValueError) as err:
            raise type(err)(f"patching module {name!r}: {err}") from err
    inherited = getattr(model, "_parallel_config", None)   # diffusers' enable_parallelism ran before patch
    modules = dict(model.named_modules())
    for (name, module, kind), new in zip(sites, built):
        if kind == "processor":
            if context_parallel_config(inherited) is not None:
                new._parallel_config = inherited
            _install_processor(module, new)
        else:
            _install_route(module, new, prefix_tokens(name, modules))
            block = block_of(name, modules)
            if is_single_stream(module) and block is not None and text_positions(block) is not None:
                _install_block(block, name.rpartition(".")[2])
    report = PatchReport(dict(zip(names, configs)), skipped, spec.dense_warmup_steps)
    logger.info("flexsparse.patch: %s", report.summary())
    return report


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
        if record["kind"] == "block":
            continue
        if record["kind"] == "route":
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


def _install_route(module: nn.Module, site: SparseSDPA, prefix: int) -> None:
    """Route the SDPA calls of ``module`` to ``site``; ``prefix``: its calls' prefix tokens (``joint.prefix_tokens``).
    """
    record = {"kind": "route", "forward": module.__dict__.get("forward"),   # e.g. an accelerate hook
              "class_forward": type(module).forward, "text_positions": text_positions(module), "prefix_tokens": prefix}
    if isinstance(getattr(module, "fused_attn", None), bool):   # timm's switch between SDPA and its own math
        record["fused_attn"] = module.fused_attn
        module.fused_attn = True
    module.add_module(SITE, site.to(_device_of(module)))
    module.forward = types.MethodType(_routed_forward, module)
    module.__dict__[RECORD] = record


def _install_block(block: nn.Module, child: str) -> None:
    """Wrap the forward of the single-stream ``block`` so that its attention module ``child`` knows each call's
    text (``_block_forward``)."""
    record = block.__dict__.get(RECORD)
    if record is None:
        record = {"kind": "block", "forward": block.__dict__.get("forward"), "class_forward": type(block).forward,
                  "children": [], "text_positions": text_positions(block)}
        block.forward = types.MethodType(_block_forward, block)
        block.__dict__[RECORD] = record
    record["children"].append(child)


def _previous_forward(module: nn.Module, args: tuple, kwargs: dict):
    """The module's forward (an instance-level one it had before patching, else its class's, the function kept at
    patch time: dynamo cannot trace ``type(module).forward`` of classes it runs in graph, such as diffusers'
    ``Attention``) on the call."""
    record = module.__dict__[RECORD]
    if record["forward"] is None:
        return record["class_forward"](module, *args, **kwargs)
    return record["forward"](*args, **kwargs)


def _routed_forward(self: nn.Module, *args, **kwargs):
    """The module's forward with its SDPA calls sent to its ``SparseSDPA``, joint calls as such
    (``joint.call_text``)."""
    text = call_text(self, self.__dict__[RECORD], args, kwargs)
    return routed_call(self, getattr(self, SITE), lambda: _previous_forward(self, args, kwargs), args, kwargs, text)


def _block_forward(self: nn.Module, *args, **kwargs):
    """The single-stream block's forward, its attention modules holding the call's text (``BLOCK_TEXT``: the lengths
    of its ``encoder_hidden_states`` and ``hidden_states``, on the side of ``SINGLE_STREAM_BLOCKS``) meanwhile."""
    record = self.__dict__[RECORD]
    text = joined_text(record["text_positions"], SINGLE_STREAM_BLOCKS, type(self).__name__, args, kwargs)
    children = [getattr(self, name) for name in record["children"]]
    for child in children:
        child.__dict__[BLOCK_TEXT] = text
    try:
        return _previous_forward(self, args, kwargs)
    finally:
        for child in children:
            child.__dict__.pop(BLOCK_TEXT, None)
