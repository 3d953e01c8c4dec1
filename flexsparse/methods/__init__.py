"""One module per method, each reading top-down: select (``flexsparse.masks``) -> attend (a backend) -> combine.

Every method module defines:
  ``BACKENDS``        backends it supports (besides ``"auto"``),
  ``SELF_ATTENTION``  whether q and k must have the same length,
  ``init_params(cfg, head_dim, num_heads, seq_len) -> dict[str, Tensor]`` its learnable parameters,
  ``forward(q, k, v, cfg, *, backend, scale, params, need_lse) -> (o, lse)`` (``lse`` may be None
                      when ``need_lse`` is False and the backend saves work by skipping it).
"""
from typing import NamedTuple

from . import full, llsa, sla, sla2, topk, vsa

MODULES = {"full": full, "topk": topk, "vsa": vsa, "llsa": llsa, "sla": sla, "sla2": sla2}


class Method(NamedTuple):
    """A registered method: its name, its module, the backends it runs on and an example config."""

    name: str
    module: object
    backends: tuple[str, ...]
    example: dict


_EXAMPLES = {
    "full": {"method": "full"},
    "topk": {"method": "topk", "block_size": 64, "topk": 8},
    "vsa": {"method": "vsa", "block_size": 64, "topk": 8},
    "llsa": {"method": "llsa", "block_size": 16, "topk": 8},
    "sla": {"method": "sla", "block_size": 64, "topk_ratio": 0.05},
    "sla2": {"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.05},
}
METHODS = {name: Method(name, module, module.BACKENDS, _EXAMPLES[name]) for name, module in MODULES.items()}


def method_module(name: str):
    """The module implementing method ``name``."""
    return MODULES[name]
