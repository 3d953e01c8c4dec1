"""Finding the attention modules of a model and their head geometry.

Kinds: ``"processor"`` (a diffusers-style ``Attention`` with the stock processor and ``to_out``, which patch
replaces by ``FlexSparseAttnProcessor``), ``"timm"`` (a timm-style ``Attention``: ``qkv``, ``num_heads``,
``fused_attn``, ``proj``) and ``"sdpa"`` (any other module, including diffusers modules with a custom
processor: its ``F.scaled_dot_product_attention`` calls are routed).

By default every diffusers-style self-attention is patched, single-stream ones (no ``to_out``, e.g. Flux's
``pre_only`` ones) where their block's forward takes ``encoder_hidden_states`` (``flexsparse.integration.joint``
finds their text there), and timm-style attention. Cross-attention is left out (``is_cross_attention``): the module's
``is_cross_attention`` flag (diffusers' ``Attention``, Wan's), a class named ``...CrossAttention``, or a child that
``CROSS_ATTENTION_CHILDREN`` names for modules whose class serves both (LTX-Video's ``LTXAttention``); so is the
attention of the prompt's refiner blocks (``TEXT_REFINER_BLOCKS``, HunyuanVideo's), which sees no visual token.
``skipped_sites`` names the attention-like modules that a patch leaves alone, and why, for ``patch``'s summary.
"""
from __future__ import annotations

import re
from fnmatch import fnmatchcase

from torch import nn

from ..module import SparseAttention
from .joint import is_single_stream, text_positions
from .sdpa import SparseSDPA

STOCK_PROCESSORS = ("AttnProcessor", "AttnProcessor2_0")
_HEADS = ("num_heads", "heads", "n_heads", "n_head", "num_attention_heads")
_HEAD_DIMS = ("head_dim", "dim_head", "attention_head_dim")
_WIDTHS = ("inner_dim", "embed_dim", "hidden_size", "dim")
_ATTENTION_NAME = re.compile("attention|attn", re.IGNORECASE)
_OURS = (SparseAttention, SparseSDPA)   # already flexsparse: never reported as skipped
# block class -> its children that attend another sequence (text, audio), for attention classes without an
# ``is_cross_attention`` flag that serve as self- and cross-attention alike
CROSS_ATTENTION_CHILDREN = {
    "LTXVideoTransformerBlock": ("attn2",),
    "LTX2VideoTransformerBlock": ("attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"),
}
# blocks that refine the prompt's tokens before the transformer: their attention sees no visual token
TEXT_REFINER_BLOCKS = ("HunyuanVideoIndividualTokenRefinerBlock", "HunyuanVideo15IndividualTokenRefinerBlock",
                       "HunyuanImageIndividualTokenRefinerBlock", "MiniMaxH3TokenRefinerBlock")


def is_diffusers_attention(module: nn.Module) -> bool:
    """``to_q``, ``to_k``, ``to_v``, ``heads``, ``set_processor`` and ``to_out`` or ``pre_only``."""
    return (all(hasattr(module, name) for name in ("to_q", "to_k", "to_v", "heads"))
            and (hasattr(module, "to_out") or getattr(module, "pre_only", False) is True)
            and callable(getattr(module, "set_processor", None)))


def is_timm_attention(module: nn.Module) -> bool:
    """``qkv`` (a Linear), ``num_heads``, ``fused_attn`` and ``proj``."""
    return (isinstance(getattr(module, "qkv", None), nn.Linear)
            and all(hasattr(module, name) for name in ("num_heads", "fused_attn", "proj")))


def kind_of(module: nn.Module) -> str:
    if (is_diffusers_attention(module) and not is_single_stream(module)
            and type(getattr(module, "processor", None)).__name__ in STOCK_PROCESSORS):
        return "processor"
    if is_timm_attention(module):
        return "timm"
    return "sdpa"


def find_sites(model: nn.Module, layers: tuple[str, ...] | None) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, kind)`` of the modules to patch, in ``named_modules`` order: those whose
    names match a glob of ``layers``, or by default every diffusers-style self-attention (cross-
    attention modules are skipped, and single-stream ones whose text length is unknown: ``_text_unknown``) and
    timm-style attention."""
    named = list(model.named_modules())
    if layers is None:
        modules = dict(named)
        chosen = [(n, m) for n, m in named if is_timm_attention(m)
                  or (is_diffusers_attention(m) and not is_cross_attention(n, m, modules)
                      and not _text_unknown(n, m, modules) and not _refines_text(n, modules))]
        if not chosen:
            raise ValueError("found no diffusers- or timm-style attention module in the model; name the modules "
                             "that call F.scaled_dot_product_attention with layers=['blocks.*.attn']")
    else:
        for pattern in layers:
            if not any(fnmatchcase(n, pattern) for n, _ in named):
                some = [n for n, _ in named[1:9]]
                raise ValueError(f"layers pattern {pattern!r} matches no module name (names look like {some})")
        chosen = [(n, m) for n, m in named if any(fnmatchcase(n, p) for p in layers)]
    names = [n for n, _ in chosen]
    for outer in names:
        for inner in names:
            if _nested(outer, inner):
                raise ValueError(f"layers select both {outer or '<root>'!r} and its submodule {inner!r}; "
                                 "select only the attention modules")
    return [(n, m, kind_of(m)) for n, m in chosen]


def skipped_sites(model: nn.Module, chosen: list[str], layers: tuple[str, ...] | None) -> dict[str, str]:
    """``{name: reason}`` of the attention-like modules (``is_attention_like``) of ``model`` that are not in
    ``chosen`` (the names ``find_sites`` returned for ``layers``), leaving out flexsparse's own modules, those inside
    or around a chosen one (its parts, the block holding it) and those inside a skipped one (its parts, e.g. a
    processor that is a module): the outermost of each nest, as ``named_modules`` lists parents first."""
    picked, skipped, modules = set(chosen), {}, dict(model.named_modules())
    for name, module in modules.items():
        if (name in picked or not is_attention_like(module) or isinstance(module, _OURS)
                or any(_nested(name, other) or _nested(other, name) for other in picked)
                or any(_nested(other, name) for other in skipped)):
            continue
        skipped[name] = _skip_reason(name, module, layers, modules)
    return skipped


def is_attention_like(module: nn.Module) -> bool:
    """Diffusers- or timm-style attention, or a class named like one (``Attention``, ``Attn`` in any case)."""
    return (is_diffusers_attention(module) or is_timm_attention(module)
            or _ATTENTION_NAME.search(type(module).__name__) is not None)


def _skip_reason(name: str, module: nn.Module, layers: tuple[str, ...] | None, modules: dict[str, nn.Module]) -> str:
    if layers is not None:
        return "not matched by layers="
    if is_diffusers_attention(module) and _text_unknown(name, module, modules):
        return ("single-stream attention whose block gets its text and image tokens already joined, so their "
                "lengths are unknown (named in layers=, it attends them all as visual tokens)")
    if is_diffusers_attention(module) and _refines_text(name, modules):
        return "attention over the prompt's tokens only, in a text refiner block (patched only when named in layers=)"
    if is_diffusers_attention(module):   # by default only its cross-attention is left out
        return "cross-attention (patched only when named in layers=)"
    return "not diffusers- or timm-style (name it in layers= if it calls F.scaled_dot_product_attention)"


def is_cross_attention(name: str, module: nn.Module, modules: dict[str, nn.Module]) -> bool:
    """Whether the attention module ``name`` attends another sequence than its queries' (module docstring)."""
    flag = getattr(module, "is_cross_attention", None)
    if flag is not None:
        return bool(flag)
    if "CrossAttention" in type(module).__name__:
        return True
    block = block_of(name, modules)
    return block is not None and name.rpartition(".")[2] in CROSS_ATTENTION_CHILDREN.get(type(block).__name__, ())


def block_of(name: str, modules: dict[str, nn.Module]) -> nn.Module | None:
    """The module that holds module ``name`` (its parent), None for the root."""
    return modules[name.rpartition(".")[0]] if name else None


def _text_unknown(name: str, module: nn.Module, modules: dict[str, nn.Module]) -> bool:
    """A single-stream attention module whose block's forward takes no ``hidden_states`` and
    ``encoder_hidden_states`` (``joint.text_positions``): nothing says which of its tokens are text."""
    block = block_of(name, modules)
    return is_single_stream(module) and (block is None or text_positions(block) is None)


def _refines_text(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether module ``name`` sits in a ``TEXT_REFINER_BLOCKS`` block."""
    block = block_of(name, modules)
    return block is not None and type(block).__name__ in TEXT_REFINER_BLOCKS


def _nested(outer: str, inner: str) -> bool:
    """Whether module name ``inner`` is inside ``outer`` (``""``: the root)."""
    return inner != outer and (outer == "" or inner.startswith(outer + "."))


def head_geometry(name: str, module: nn.Module, kind: str, head_dim: int | None,
                  num_heads: int | None) -> dict[str, int]:
    """``{"head_dim", "num_heads"}`` of the queries of ``module``: the given values, else read from
    the module's attributes."""
    if num_heads is None:
        num_heads = next((getattr(module, a) for a in _HEADS if isinstance(getattr(module, a, None), int)), None)
    if head_dim is None and num_heads:
        head_dim = next((getattr(module, a) for a in _HEAD_DIMS if isinstance(getattr(module, a, None), int)), None)
        if head_dim is None:
            if isinstance(getattr(module, "to_q", None), nn.Linear):
                width = module.to_q.out_features
            elif kind == "timm":
                width = module.qkv.out_features // 3
            else:
                width = next((getattr(module, a) for a in _WIDTHS if isinstance(getattr(module, a, None), int)), None)
            head_dim = width // num_heads if width else None
    if not head_dim or not num_heads:
        raise ValueError(f"cannot tell the number of heads and head dim of module {name!r} "
                         f"({type(module).__name__}); pass head_dim= and num_heads= to flexsparse.patch")
    return {"head_dim": head_dim, "num_heads": num_heads}
