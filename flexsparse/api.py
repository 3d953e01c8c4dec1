"""The functional entry point ``flexsparse.attention``: validate, pick the backend, then the method's select and
attend steps on it."""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch

from . import backends, eager_graphs
from ._checks import check_flag, check_qkv, resolve_scale
from .backends.text_keys import WithTextKeys
from .config import Config, Joint
from .methods import METHODS
from .parallel import ParallelConfig, ring_attention, ring_methods, ulysses_attention


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: "Mapping[str, Any] | Config", *,
              backend: str = "auto", scale: float | None = None, return_lse: bool = False,
              params: Mapping[str, torch.Tensor] | None = None, parallel: ParallelConfig | None = None,
              joint: "Joint | Mapping[str, Any] | None" = None):
    """Sparse attention shaped like ``F.scaled_dot_product_attention``.

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with ``H % Hk == 0`` (GQA).
    config: a dict such as ``{"method": "llsa", "block_size": 16, "topk": 8}`` or a ``Config``.
    backend: ``"reference"``, ``"torch"``, ``"flex"``, ``"triton"`` or ``"auto"``.
    params: learnable tensors of methods that have them (``SparseAttention`` passes its own).
    parallel: a ``flexsparse.ParallelConfig``: q, k, v are this rank's shards of the sequence (every head) and the
    result is this rank's shard (``flexsparse.parallel.ulysses_attention``); ``None``: no communication.
    joint: a ``flexsparse.Joint`` (or ``{"text": "prefix" | "suffix", "length": n}``): the sequence is text and
    visual tokens; the method selects among the visual ones, and every query attends every text token densely.
    Returns ``o (B, H, Nq, D)`` in q's dtype, and with ``return_lse`` also the natural-log LSE
    ``(B, H, Nq)`` (fp32; fp64 for fp64 inputs) of the (sparse) softmax branch.
    """
    cfg = Config.from_dict(config)
    method = METHODS[cfg.method]
    check_qkv(q, k, v, self_attention=method.self_attention)
    scale = resolve_scale(scale, q.shape[-1])
    check_flag("return_lse", return_lse)
    parallel = ParallelConfig.check(parallel)
    joint = Joint.from_value(joint)
    if parallel is not None and parallel.communicates:
        ring = parallel if parallel.ring_degree > 1 else None
        if ring is not None and joint is not None:
            raise ValueError("joint attention runs under Ulysses sequence parallelism, not over a 'ring' mesh dim "
                             "(its text tokens would sit in one rank's chunk)")
        if ring is not None and method.ring is None:
            raise ValueError(f"ring attention (a 'ring' mesh dim of size {ring.ring_degree}) runs the methods "
                             f"{ring_methods(METHODS)}, not {cfg.method!r}: put every sequence-parallel rank of "
                             f"this method on the 'ulysses' dim")

        def attend_heads(q, k, v, heads: slice):
            local_params = head_params(method, cfg, params, heads)
            return _attend(q, k, v, cfg, method, backend, scale, return_lse, local_params, ring, joint)
        if parallel.ulysses_degree > 1:
            return ulysses_attention(q, k, v, attend_heads, parallel, return_lse=return_lse)
        out, lse = attend_heads(q, k, v, slice(None))
    else:
        out, lse = _attend(q, k, v, cfg, method, backend, scale, return_lse, params, joint=joint)
    return (out, lse) if return_lse else out


def _attend(q, k, v, cfg: Config, method, backend: str, scale: float, return_lse: bool, params,
            ring: ParallelConfig | None = None, joint: Joint | None = None):
    """The method's select and attend steps on the backend resolved for this call, with the config fitted to the
    lengths (``Method.fit``): ``(o, lse or None)``. ``ring``: q, k, v are this rank's chunk of the ring group's
    sequence (``flexsparse.parallel.ring``), whose chunks hold whole blocks, so the config runs unfitted. ``joint``:
    the steps run on the visual tokens, every softmax branch also over the text keys (``WithTextKeys``), and the
    text queries attend every key densely; the outputs in the sequence's order."""
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    whole = q, k, v
    if joint is not None:
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"joint attention is self-attention over one sequence: q and k must have the same "
                             f"length, got {q.shape[2]} and {k.shape[2]}")
        text, visual = joint.slices(q.shape[2])
        check_text_mask(joint, q)
        q, k, v = (x[:, :, visual] for x in whole)
    fitted = method.fit(cfg, q.shape[2], k.shape[2]) if ring is None else cfg
    blocks = tuple(getattr(fitted, name) for name in ("block_q", "block_k", "block_size") if hasattr(fitted, name))
    needs_lse = return_lse or ring is not None or joint is not None
    chosen = backends.resolve(backend, method, q.device, needs_grad, needs_lse=needs_lse, dtype=q.dtype,
                              blocks=blocks, head_dim=q.shape[-1], quant=getattr(cfg, "quant", None),
                              batch_heads=q.shape[0] * q.shape[1])
    if ring is not None:
        q, k, v = chosen.prepare_inputs(q, k, v, keep_views=method.keeps_views, needs_grad=needs_grad)
        with _without_autocast(q.device.type):
            out, lse = ring_attention(q, k, v, method, cfg, chosen, scale=scale,
                                      params=method.check_params(cfg, q, params), need_lse=return_lse, parallel=ring)
        return _returned(out, lse, return_lse)
    steps = chosen if joint is None else WithTextKeys(chosen, whole[1][:, :, text], whole[2][:, :, text], joint.mask)
    names = sorted(params) if params else []
    values = [params[name] for name in names]

    def select_attend(q, k, v, *values):
        return _select_attend(q, k, v, cfg, fitted, method, chosen, steps, scale, needs_lse, dict(zip(names, values)),
                              needs_grad)
    if joint is None and chosen.graphs_small_calls and eager_graphs.applies(q, [q, k, v, *values]):
        key = eager_graphs.call_key(method.name, fitted, chosen.name, chosen.capture_settings(), scale, needs_lse,
                                    tuple(names), *(eager_graphs.tensor_key(x) for x in (q, k, v, *values)))
        out, lse = eager_graphs.run(key, select_attend, [q, k, v, *values])
    else:
        out, lse = select_attend(q, k, v, *values)
    if joint is not None:
        keys = joint.mask
        if keys is not None:   # the text mask over the whole sequence: every visual key attended
            keys = joint.join(keys, keys.new_ones(q.shape[0], q.shape[2]), dim=1)
        with _without_autocast(q.device.type):
            o_text, lse_text = chosen.dense_attention(whole[0][:, :, text], whole[1], whole[2], scale,
                                                      need_lse=return_lse, key_mask=keys)
        out = joint.join(o_text.to(out.dtype), out, dim=2)
        lse = joint.join(lse_text.to(lse.dtype), lse, dim=2) if return_lse else None
    return _returned(out, lse, return_lse)


def _select_attend(q, k, v, cfg: Config, fitted: Config, method, chosen, steps, scale: float, needs_lse: bool,
                   params: dict, needs_grad: bool):
    """The method's select and attend steps (``steps``: the resolved backend ``chosen``, or it with text keys):
    ``(o, lse or None)``."""
    q, k, v = chosen.prepare_inputs(q, k, v, keep_views=method.keeps_views, needs_grad=needs_grad)
    with _without_autocast(q.device.type):
        params = method.check_params(cfg, q, params)
        selection = method.select(q, k, v, fitted, chosen, params)
        return steps.attend(method, q, k, v, selection, fitted, scale=scale, params=params, need_lse=needs_lse)


def _returned(out: torch.Tensor, lse: torch.Tensor | None, return_lse: bool):
    """``(o, lse)`` as ``_attend`` returns them: the LSE in fp32 (fp64 for fp64 inputs) or ``None``."""
    if not return_lse:
        return out, None
    return out, (lse if lse.dtype == torch.float64 else lse.float())


def check_text_mask(joint: Joint, q: torch.Tensor) -> None:
    """``joint.mask`` (if any) on q's device with a row per batch element of q ``(B, H, N, D)``."""
    mask = joint.mask
    if mask is not None and (mask.shape[0] != q.shape[0] or mask.device != q.device):
        raise ValueError(f"joint.mask must have one row per batch element of q on its device: ({q.shape[0]}, "
                         f"{joint.length}) on {q.device}, got {tuple(mask.shape)} on {mask.device}")


def head_params(method, cfg: Config, params: Mapping[str, torch.Tensor] | None, heads: slice):
    """``params`` for the query heads ``heads``: the method's per-head parameters (``Method.head_params``) sliced,
    the others whole."""
    if not params:
        return params
    per_head = method.head_params(cfg)
    return {name: value[heads] if name in per_head else value for name, value in params.items()}


def _without_autocast(device_type: str):
    """The precision follows the input dtypes (fp32 accumulation); an enclosing autocast region would
    recast the internal matmuls, selection scores included, to bf16/fp16."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
