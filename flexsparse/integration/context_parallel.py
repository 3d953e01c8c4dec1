"""Patched attention under diffusers' context parallelism (``model.enable_parallelism(config=
diffusers.ContextParallelConfig(ulysses_degree=P))``).

diffusers shards the hidden states along the sequence where the model's ``_cp_plan`` says (gathering them after the
blocks) and gives every attention processor with a ``_parallel_config`` attribute the model's
``diffusers.ParallelConfig``; the processor passes it to ``dispatch_attention_fn``, whose backends exchange the
shards. A patched module runs flexsparse's Ulysses path instead (``flexsparse.parallel.ulysses_attention`` over
diffusers' ``"ulysses"`` mesh, cached per diffusers config), so that the sparse method sees the whole sequence, in
rank order, as in one process:

* ``FlexSparseAttnProcessor`` has the ``_parallel_config`` attribute (``patch`` after ``enable_parallelism`` copies
  the model's);
* a routed module (one with its own processor, e.g. ``WanAttnProcessor``) runs with its processor's
  ``_parallel_config`` cleared for the call, so that the ``"native"`` backend calls ``F.scaled_dot_product_attention``
  on the local shards and its ``SparseSDPA`` exchanges them.

ValueError instead of attention within the local shard: ring attention (``ring_degree > 1``); a sparse method on a
call given ``encoder_hidden_states`` (cross-attention, whose context diffusers may replicate, or joint text-image
attention, whose ranks interleave text and image shards: neither order is the one-process one) or on a joint call
of a single-stream block (which joins its text and image shards before its attention module: ``RouteSDPA``
refuses it); a routed module whose forward made no SDPA call (a backend other than ``"native"``);
``patch(..., parallel=)`` over another group. Not detectable here: a single-stream module whose block gets the two
sharded streams already joined (patched only when named in ``layers=``) sees them interleaved by rank.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from ..parallel import ParallelConfig
from .joint import CallText
from .sdpa import RouteSDPA, SparseSDPA

CONTEXT = "encoder_hidden_states"


def context_parallel_config(parallel_config: Any) -> Any | None:
    """The ``ContextParallelConfig`` of a diffusers ``ParallelConfig`` (a processor's or model's
    ``_parallel_config``), or None."""
    return getattr(parallel_config, "context_parallel_config", None)


def bind(site: SparseSDPA, cp: Any) -> ParallelConfig:
    """The ``flexsparse.ParallelConfig`` of ``site``'s calls under diffusers' ``ContextParallelConfig`` ``cp``: over
    its ulysses mesh, or the site's own ``parallel`` when that is the same group. Built once per ``cp``."""
    cached = site._diffusers_parallel
    if cached is not None and cached[0] is cp:
        return cached[1]
    parallel = _from_diffusers(cp, site.parallel)
    site._diffusers_parallel = (cp, parallel)
    return parallel


def _from_diffusers(cp: Any, given: ParallelConfig | None) -> ParallelConfig:
    if cp.ring_degree > 1:
        raise ValueError(f"diffusers context parallelism with ring_degree={cp.ring_degree} (ring attention) is not "
                         "supported by flexsparse's patched attention, which exchanges shards as Ulysses only: use "
                         f"ContextParallelConfig(ulysses_degree={cp.ring_degree * cp.ulysses_degree}) (ring_degree=1)")
    if cp._ulysses_mesh is None:
        raise ValueError("diffusers' ContextParallelConfig has no ulysses mesh: it is not set up; enable it with "
                         "model.enable_parallelism(config=...)")
    derived = ParallelConfig(cp._ulysses_mesh)
    if given is None:
        return derived
    ours, theirs = (dist.get_process_group_ranks(p.ulysses_group) for p in (given, derived))
    if ours != theirs:
        raise ValueError(f"flexsparse.patch(..., parallel=) shards the sequence over ranks {ours} but diffusers' "
                         f"context parallelism over ranks {theirs}; pass a ParallelConfig over the same 'ulysses' "
                         "group or leave parallel= out")
    return given


def refuse_context(site: SparseSDPA, module: nn.Module) -> None:
    """Raise for a sparse method on a call given ``encoder_hidden_states`` under context parallelism."""
    if site.attention is not None:
        raise ValueError(f"{type(module).__name__} got encoder_hidden_states under diffusers context parallelism: "
                         "cross-attention (diffusers may replicate the context on every rank) and joint text-image "
                         "attention (each rank concatenates its text and image shards) do not give a sparse method "
                         "the one-process token order; patch only self-attention modules (layers=) or give these "
                         "the 'full' config (overrides=)")


def processor_parallel(site: SparseSDPA, processor: Any, module: nn.Module,
                       context: Any) -> ParallelConfig | None:
    """The parallel config of a processor's call: diffusers' context parallelism when ``enable_parallelism`` set
    the processor's ``_parallel_config``, else None (the site's own)."""
    cp = context_parallel_config(getattr(processor, "_parallel_config", None))
    if cp is None:
        return None
    parallel = bind(site, cp)
    if context is not None:
        refuse_context(site, module)
    return parallel


def routed_call(module: nn.Module, site: SparseSDPA, forward: Callable[[], Any], args: tuple, kwargs: dict,
                text: CallText | None = None) -> Any:
    """``forward()`` (the module's ``forward(*args, **kwargs)``) with its SDPA calls sent to ``site``, through
    flexsparse's Ulysses path when the module's processor is under diffusers' context parallelism; ``text``: the
    call's text tokens (``flexsparse.integration.joint``), for its joint SDPA calls. A forward that
    made no SDPA call ran its attention outside flexsparse (a diffusers attention backend other than ``"native"``, a
    processor or code path of its own): ``site.fallback`` says so (an error under ``strict``), and under context
    parallelism it is a ValueError (the shards were not exchanged)."""
    processor = getattr(module, "processor", None)
    cp = context_parallel_config(getattr(processor, "_parallel_config", None))
    if cp is None:
        route = RouteSDPA(site, text=text)
        with route:
            out = forward()
        if not route.calls:
            site.fallback("no SDPA call", bypass_detail(processor))
        return out
    route = RouteSDPA(site, parallel=bind(site, cp), text=text)
    if _argument(module, CONTEXT, args, kwargs) is not None:
        refuse_context(site, module)
    with _dispatch_on_shards(processor), route:
        out = forward()
    if not route.calls:
        backend = diffusers_backend(processor) or "the active default"
        raise ValueError(f"{type(module).__name__} under diffusers context parallelism made no "
                         f"F.scaled_dot_product_attention call (attention backend: {backend}), so flexsparse could "
                         "not exchange its shards; use the 'native' backend (model.set_attention_backend('native'))")
    return out


def bypass_detail(processor: Any) -> str:
    """What a routed module's forward without an SDPA call did, and how to route it, for ``SparseSDPA.fallback``."""
    detail = "its forward made no F.scaled_dot_product_attention call, so its attention ran outside flexsparse"
    backend = diffusers_backend(processor)
    if backend is not None and backend != "native":
        detail += (f": diffusers attention backend {backend!r} does not call it; run patched modules on 'native' "
                   "(model.set_attention_backend('native'), outside attention_backend(...))")
    return detail


def diffusers_backend(processor: Any) -> str | None:
    """The name of the diffusers attention backend that ``processor`` dispatches to: its own
    (``set_attention_backend``), else the active one (``attention_backend(...)``, ``DIFFUSERS_ATTN_BACKEND``); None for
    a processor without one (not a dispatching diffusers processor). Reads diffusers only if it is imported already."""
    if not hasattr(processor, "_attention_backend"):
        return None
    backend = processor._attention_backend
    if backend is None:
        dispatch = sys.modules.get("diffusers.models.attention_dispatch")
        backend = getattr(getattr(dispatch, "_AttentionBackendRegistry", None), "_active_backend", None)
    return None if backend is None else str(getattr(backend, "value", backend))


@contextlib.contextmanager
def _dispatch_on_shards(processor: Any):
    """The processor's ``_parallel_config`` cleared: its dispatch then attends on the local shards (the ``"native"``
    backend through SDPA, which the route exchanges)."""
    saved, processor._parallel_config = processor._parallel_config, None
    try:
        yield
    finally:
        processor._parallel_config = saved


def _argument(module: nn.Module, name: str, args: tuple, kwargs: dict) -> Any:
    """The value of ``forward``'s argument ``name`` in a call ``(*args, **kwargs)``, or None."""
    if name in kwargs:
        return kwargs[name]
    try:
        bound = inspect.signature(type(module).forward).bind_partial(module, *args)
    except (TypeError, ValueError):
        return None
    return bound.arguments.get(name)
