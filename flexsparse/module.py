"""``SparseAttention``: an ``nn.Module`` that holds a method's learnable parts, and checkpoints that say what
those parts mean."""
from __future__ import annotations

import json
from typing import Any, Mapping

import torch
from torch import nn

from ._checks import check_positive_int
from .api import attention, head_params
from .config import Config
from .methods import METHODS
from .parallel import ParallelConfig

CONFIG_KEY = "config"   # the state_dict entry (after the module's prefix) that says what the parameters mean
# config keys that do not change what the parameters mean: how the same attention is computed (reduction order,
# FP8 precision of the sparse branch) or only the initial value that a load replaces
UNCHECKED_KEYS = ("alpha_init", "deterministic", "quant")


class SparseAttention(nn.Module):
    """Sparse attention with the method's learnable parameters (SLA projection, SLA2 router and
    alpha, VSA gate) registered as module parameters, so they train and live in ``state_dict``; those the config
    passes no gradient to (SLA2's router under ``router="hard"``) with ``requires_grad=False``.

    ``forward(q, k, v)`` takes ``(B, H, N, D)`` tensors like ``F.scaled_dot_product_attention`` (``joint=``: a
    ``flexsparse.Joint`` for joint text+visual sequences, see ``flexsparse.attention``).
    ``seq_len`` is needed only by methods whose parameters are laid out along the sequence (SLA2's per-block alpha,
    stored at ``seq_len``'s blocks and interpolated to a call's at other lengths); it is the whole sequence's length
    under sequence parallelism. ``parallel``: a ``flexsparse.ParallelConfig`` when q, k, v are this rank's shards of
    the sequence (``flexsparse.attention``).

    Checkpoints: besides ``params.*``, ``state_dict`` holds ``config``: the canonical JSON of the config with
    ``head_dim`` and ``num_heads``, as a uint8 tensor of its UTF-8 bytes (a tensor, since safetensors cannot store
    ``get_extra_state``'s arbitrary objects), written at save time from the config that runs, so in-place changes
    (``prepare_stage2``) are saved. ``load_state_dict`` refuses, naming both values, an entry whose method,
    ``head_dim``, ``num_heads`` or any config key but ``UNCHECKED_KEYS`` differs, and parameters holding NaN or Inf;
    a refused module keeps its parameters. The shapes of the parameters (SLA2's alpha: ``seq_len``) are torch's
    check. A checkpoint without the entry loads with ``strict=False``; to load the parameters into another config
    on purpose, leave the entries out: ``load_state_dict(SparseAttention.without_configs(sd), strict=False)``.
    """

    def __init__(self, config: "Mapping[str, Any] | Config", *, head_dim: int, num_heads: int,
                 seq_len: int | None = None, backend: str = "auto", parallel: ParallelConfig | None = None):
        super().__init__()
        self.config = Config.from_dict(config)
        check_positive_int("head_dim", head_dim)
        check_positive_int("num_heads", num_heads)
        method = METHODS[self.config.method]
        if backend not in (*method.backends, "auto"):
            raise ValueError(f"backend {backend!r} is not available for method {method.name!r}; "
                             f"available: {list(method.backends) + ['auto']}")
        self.parallel = ParallelConfig.check(parallel)
        self.head_dim, self.num_heads, self.seq_len, self.backend = head_dim, num_heads, seq_len, backend
        initial = method.init_params(self.config, head_dim, num_heads, seq_len)
        frozen = method.frozen_params(self.config)
        self.params = nn.ParameterDict({name: nn.Parameter(value, requires_grad=name not in frozen)
                                        for name, value in initial.items()})

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                return_lse: bool = False, joint=None):
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q has head dim {q.shape[-1]} but this SparseAttention was built with "
                             f"head_dim={self.head_dim}")
        if q.shape[1] != self.num_heads:
            raise ValueError(f"q has {q.shape[1]} heads but this SparseAttention was built with "
                             f"num_heads={self.num_heads}")
        return attention(q, k, v, self.config, backend=self.backend, scale=scale, return_lse=return_lse,
                         params=dict(self.params.items()), parallel=self.parallel, joint=joint)

    def forward_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: slice, *,
                      scale: float | None = None, joint=None) -> torch.Tensor:
        """Attention of the query heads ``heads`` (a slice of ``range(num_heads)``) over the whole sequence in this
        process, with those heads' rows of the per-head parameters: the call a sequence-parallel caller makes on
        each rank (``flexsparse.parallel.ulysses_attention``). q ``(B, len(heads), N, D)``; ``joint``: a
        ``flexsparse.Joint`` of that whole sequence."""
        if q.shape[1] != len(range(self.num_heads)[heads]):
            raise ValueError(f"q has {q.shape[1]} heads but the slice {heads} of this SparseAttention's "
                             f"{self.num_heads} heads has {len(range(self.num_heads)[heads])}")
        method = METHODS[self.config.method]
        return attention(q, k, v, self.config, backend=self.backend, scale=scale,
                         params=head_params(method, self.config, dict(self.params.items()), heads), joint=joint)

    @staticmethod
    def without_configs(state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict`` without its ``SparseAttention`` config entries (keys ``config`` or ``*.config``), for
        ``load_state_dict(..., strict=False)`` into modules of another config."""
        return {key: value for key, value in state_dict.items() if key.rpartition(".")[2] != CONFIG_KEY}

    def _description_json(self) -> str:
        """What gives the parameters their meaning: the config's keys, ``head_dim`` and ``num_heads``."""
        return json.dumps({**self.config.to_dict(), "head_dim": self.head_dim, "num_heads": self.num_heads},
                          sort_keys=True, separators=(",", ":"))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + CONFIG_KEY] = torch.tensor(list(self._description_json().encode()), dtype=torch.uint8)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + CONFIG_KEY
        errors = [f"{prefix}params.{name} holds NaN or Inf; refusing to load it" for name in self.params
                  if not _finite(state_dict.get(f"{prefix}params.{name}"))]
        if key in state_dict:   # taken out: it is no parameter, so torch would call it unexpected
            errors += self._config_errors(key, state_dict.pop(key))
        elif strict:
            missing_keys.append(key)
        if errors:
            error_msgs.extend(errors)
            for name, param in self.params.items():   # a refused module keeps its parameters
                if f"{prefix}params.{name}" in state_dict:
                    state_dict[f"{prefix}params.{name}"] = param
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _config_errors(self, key: str, value: Any) -> list[str]:
        try:
            saved = json.loads(bytes(value.to("cpu", torch.uint8).tolist()).decode())
            if not isinstance(saved, dict):
                raise ValueError
        except (AttributeError, TypeError, ValueError):
            return [f"{key} is not a SparseAttention config (the UTF-8 JSON bytes that state_dict writes)"]
        own = json.loads(self._description_json())
        differ = ["method"] if saved.get("method") != own["method"] else sorted(
            k for k in saved.keys() | own.keys() if k not in UNCHECKED_KEYS and saved.get(k) != own.get(k))
        if not differ:
            return []

        def listed(values: dict) -> str:
            return ", ".join(f"{k}={values[k]!r}" if k in values else f"no {k!r}" for k in differ)
        return [f"{key}: checkpoint config has {listed(saved)}, this module has {listed(own)}; to load the "
                "parameters anyway: load_state_dict(SparseAttention.without_configs(state_dict), strict=False)"]

    def extra_repr(self) -> str:
        return f"config={self.config.to_dict()}, head_dim={self.head_dim}, num_heads={self.num_heads}"


def _finite(value: Any) -> bool:
    """False only for a tensor holding NaN or Inf (a meta tensor holds no values)."""
    return not isinstance(value, torch.Tensor) or value.is_meta or bool(torch.isfinite(value).all())
