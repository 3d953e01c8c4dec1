"""Recording the Q, K, V that chosen ``SparseAttention`` layers receive (SLA2 stage 1's data set)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..api import attention
from ..config import Joint
from .layers import LayerSpec, select_layers

FULL = {"method": "full"}


@dataclass(frozen=True)
class QKV:
    """One recorded call: ``q (B, H, N, D)``, ``k, v (B, Hk, N, D)`` (detached, as received), the
    softmax scale it was called with (None: ``1/sqrt(D)``) and its ``flexsparse.Joint`` (None: no text tokens),
    so that calibration runs the call as the layer does, the method on its visual tokens."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float | None
    joint: Joint | None = None

    @property
    def visual_keys(self) -> int:
        """The keys the method selects among: all but the text tokens."""
        return self.k.shape[2] - (0 if self.joint is None else self.joint.length)

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.q, self.k, self.v))


class QKVRecorder:
    """Forward hooks that store the inputs of chosen ``SparseAttention`` layers::

        with QKVRecorder(model, max_batches=4, device="cpu") as recorder:
            for x, t in batches:
                model(x, t)
        recorder.records["blocks.0.attn.attention"]       # list of QKV

    layers: which ``SparseAttention`` modules (see ``select_layers``; default every ``sla2`` one).
    max_batches: calls recorded per layer (the first ones); later calls run but are not stored, so
        memory is bounded by ``max_batches`` calls of every layer. Whole calls are kept: the router
        must see the full sequence length it will run at, so tokens are never subsampled.
    device: where records are stored (e.g. ``"cpu"`` to keep accelerator memory free); default: as received.
    dense: while recording, the chosen layers return full attention of their inputs instead of their
        sparse output, so every layer sees the activations of the dense (pre-trained) model, as in
        SLA2's stage 1 where Q, K, V are sampled from the original model.
    The hooks are removed on leaving the ``with`` block (or by ``remove()``); records stay. Record
    with the eager model (a ``torch.compile``d one would recompile around the hooks).
    """

    def __init__(self, model: nn.Module, layers: LayerSpec = None, *, max_batches: int = 4,
                 device: "torch.device | str | None" = None, dense: bool = True):
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
            raise ValueError(f"max_batches must be an int >= 1, got {max_batches!r}")
        self.layers = select_layers(model, layers)
        if not self.layers:
            raise ValueError("layers selected no SparseAttention module")
        self.max_batches, self.device, self.dense = max_batches, device, dense
        self.records: dict[str, list[QKV]] = {name: [] for name in self.layers}
        self.calls: dict[str, int] = {name: 0 for name in self.layers}
        self._handles = []

    def __enter__(self) -> "QKVRecorder":
        if self._handles:
            raise RuntimeError("this QKVRecorder is already recording")
        for name, module in self.layers.items():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Stop recording (remove the hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def nbytes(self) -> int:
        """Bytes held by the records."""
        return sum(r.nbytes for rs in self.records.values() for r in rs)

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            q, k, v = _qkv(args, kwargs)
            scale, joint = kwargs.get("scale"), Joint.from_value(kwargs.get("joint"))
            self.calls[name] += 1
            if len(self.records[name]) < self.max_batches:
                store = [x.detach().to(self.device or x.device, copy=True) for x in (q, k, v)]
                self.records[name].append(QKV(*store, scale, None if joint is None else joint.to(store[0].device)))
            if self.dense:
                return attention(q, k, v, FULL, scale=scale, return_lse=bool(kwargs.get("return_lse")), joint=joint)
            return output
        return hook


def _qkv(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    given = list(args[:3]) + [kwargs[n] for n in ("q", "k", "v")[len(args):] if n in kwargs]
    if len(given) != 3:
        raise TypeError("SparseAttention was called without q, k and v")
    return tuple(given)
