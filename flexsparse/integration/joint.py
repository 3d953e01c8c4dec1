"""Where the text tokens of a patched module's call are, so that its sparse method attends them as text
(``flexsparse.Joint``): diffusers' joint and single-stream blocks, and a ViT's prefix tokens.

An SDPA call of a patched module is joint when it has as many queries and keys as the call's text and visual tokens
together: it gets ``joint=Joint(side, text length)``; its other SDPA calls (cross-attention with the text as keys
only, IP-Adapter's image-prompt attention) get none. The text of a module's call, the first that applies:

* the call's ``encoder_hidden_states`` ``(B, n_text, C)``, which the module's processor joins with its
  ``hidden_states`` ``(B, n_visual, C)`` (``JOINT_PROCESSORS``: first in Flux's double-stream blocks and CogVideoX's,
  last in SD3's and HunyuanVideo's);
* for a single-stream attention module (diffusers-style, without ``to_out``: its block projects its output), the
  ``encoder_hidden_states`` of its block's call, which the block joins with its ``hidden_states`` before calling the
  module (``SINGLE_STREAM_BLOCKS``: first in Flux's single blocks); ``patch`` wraps the block's forward to hand the
  lengths to the module (``BLOCK_TEXT``);
* ``num_prefix_tokens`` of the module or a module around it (timm's name for a ViT's class and register tokens), a
  prefix of every self-attention call.

A processor or block missing from the tables joins the text on a side flexsparse does not know: such a call runs
dense attention (exact) and says why (``SparseSDPA``'s ``dense=``: logged at WARNING, an error under ``strict``).
Adding its class name to the table makes it joint. A single-stream module whose block gets the text and image tokens
already joined (no ``encoder_hidden_states`` argument) has no text length to find: ``patch`` skips it by default and
says so in its report.

Under sequence parallelism each rank joins its own text and image shards around the attention module, so the
exchanged sequence interleaves them: ``RouteSDPA`` refuses such a joint call with a sparse method
(``CallText.per_rank``). Prefix tokens belong to the sequence before it is sharded and stay at the start of the
exchanged one.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from ..config import Joint

# class names of processors (or attention modules without one) that join the ``encoder_hidden_states`` of a call with
# its ``hidden_states`` into one self-attention sequence -> where the text goes
JOINT_PROCESSORS = {
    "FluxAttnProcessor": "prefix",                 # Flux double-stream blocks
    "FluxIPAdapterAttnProcessor": "prefix",
    "JointAttnProcessor2_0": "suffix",             # SD3
    "FusedJointAttnProcessor2_0": "suffix",
    "CogVideoXAttnProcessor2_0": "prefix",
    "FusedCogVideoXAttnProcessor2_0": "prefix",
    "HunyuanVideoAttnProcessor2_0": "suffix",      # HunyuanVideo double- and single-stream blocks
    "LongCatImageAttnProcessor": "prefix",         # Flux's, in other models
    "OvisImageAttnProcessor": "prefix",
    "BriaAttnProcessor": "prefix",
    "QwenDoubleStreamAttnProcessor2_0": "prefix",
    "AuraFlowAttnProcessor2_0": "prefix",
    "FusedAuraFlowAttnProcessor2_0": "prefix",
}
# class names of blocks that join their ``encoder_hidden_states`` and ``hidden_states`` arguments before calling their
# single-stream attention module -> where the text goes
SINGLE_STREAM_BLOCKS = {
    "FluxSingleTransformerBlock": "prefix",
    "LongCatImageSingleTransformerBlock": "prefix",   # Flux's, in other models
    "OvisImageSingleTransformerBlock": "prefix",
    "BriaSingleTransformerBlock": "prefix",
}
TEXT, VISUAL = "encoder_hidden_states", "hidden_states"
BLOCK_TEXT = "_flexsparse_block_text"   # a module's attribute while its single-stream block runs: that call's CallText


@dataclass(frozen=True)
class CallText:
    """The text tokens of one call of a patched module: ``length`` text tokens on the ``side`` (``"prefix"`` or
    ``"suffix"``; None where ``owner``, the class that joins them, is in no table) of ``visual`` visual tokens (None:
    any number, for prefix tokens). ``per_rank``: the model joins them around its attention module, so that under
    sequence parallelism each rank joins its own shards (prefix tokens are part of the sequence before any sharding,
    at the start of the exchanged one)."""

    side: str | None
    length: int
    visual: int | None
    owner: str
    per_rank: bool = True

    def sdpa_arguments(self, n_queries: int, n_keys: int) -> dict[str, Any]:
        """``SparseSDPA`` keywords for an SDPA call of ``n_queries`` queries and ``n_keys`` keys: ``joint`` where it
        attends the joint sequence, ``dense`` (the reason) where it does so with the text on an unknown side or where
        it attends the call's text as many queries (cross-attention that the lengths alone would not tell), none for
        other calls (cross-attention of other lengths is ``SparseSDPA``'s own check)."""
        total = n_queries if self.visual is None else self.length + self.visual
        if self.visual is not None and n_queries == n_keys == self.length != total:
            return {"dense": ("cross-attention", f"its {n_queries} queries attend the call's {n_keys} "
                              "encoder_hidden_states tokens (as many as the queries), not a joint sequence")}
        if not self.length or n_queries != n_keys or n_queries != total or n_queries <= self.length:
            return {}
        if self.side is None:
            return {"dense": ("unknown text side", f"{self.length} of its {n_queries} tokens are text that "
                              f"{self.owner} joins to the visual tokens on a side flexsparse does not know (add the "
                              "class to flexsparse.integration.joint.JOINT_PROCESSORS or SINGLE_STREAM_BLOCKS)")}
        return {"joint": Joint(self.side, self.length)}


def text_positions(module: nn.Module) -> tuple[int, int] | None:
    """Positions of ``hidden_states`` and ``encoder_hidden_states`` among the arguments of ``module``'s forward
    (after ``self``), or None when it takes either by keyword only or not at all. Read once, at patch time."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if VISUAL not in positional or TEXT not in positional:
        return None
    return positional.index(VISUAL), positional.index(TEXT)


def joined_text(positions: tuple[int, int] | None, table: Mapping[str, str], owner: str, args: tuple,
                kwargs: dict) -> CallText | None:
    """The ``CallText`` of a call ``(*args, **kwargs)`` of a forward whose ``hidden_states`` and
    ``encoder_hidden_states`` sit at ``positions`` (``text_positions``), when both are token tensors ``(B, N, C)``;
    its side is ``owner``'s in ``table``."""
    if positions is None:
        return None
    visual, text = (kwargs.get(name, args[i] if i < len(args) else None) for name, i in zip((VISUAL, TEXT), positions))
    if not (_tokens(visual) and _tokens(text)):
        return None
    return CallText(table.get(owner), text.shape[1], visual.shape[1], owner)


def call_text(module: nn.Module, record: Mapping[str, Any], args: tuple, kwargs: dict) -> CallText | None:
    """The ``CallText`` of a call of the routed module ``module`` (``record``: what ``patch`` stored for it, its
    ``text_positions`` and ``prefix_tokens``), in the order of the module docstring, or None."""
    processor = getattr(module, "processor", None)
    owner = type(module if processor is None else processor).__name__
    text = joined_text(record["text_positions"], JOINT_PROCESSORS, owner, args, kwargs)
    if text is None:
        text = module.__dict__.get(BLOCK_TEXT)
    if text is None and record["prefix_tokens"]:
        text = CallText("prefix", record["prefix_tokens"], None, "num_prefix_tokens", per_rank=False)
    return text


def is_single_stream(module: nn.Module) -> bool:
    """A diffusers-style attention module without an output projection (``to_out`` absent or None, e.g.
    ``pre_only=True``): its block projects its output, and joins its text and image tokens around it."""
    return getattr(module, "to_out", None) is None


def prefix_tokens(name: str, modules: Mapping[str, nn.Module]) -> int:
    """``num_prefix_tokens`` (an int) of module ``name`` or the nearest module around it that has one, else 0."""
    while True:
        count = getattr(modules[name], "num_prefix_tokens", None)
        if isinstance(count, int) and not isinstance(count, bool):
            return max(count, 0)
        if not name:
            return 0
        name = name.rpartition(".")[0]


def _tokens(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 3
