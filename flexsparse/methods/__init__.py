"""One module per method, each reading top-down: select (``flexsparse.masks``) -> attend (a backend) -> combine.

Every method module defines:
  ``BACKENDS``        backends it supports (besides ``"auto"``),
  ``SELF_ATTENTION``  whether q and k must have the same length,
  ``init_params(cfg, head_dim, num_heads, seq_len) -> dict[str, Tensor]`` its learnable parameters,
  ``forward(q, k, v, cfg, *, backend, scale, params, need_lse) -> (o, lse)`` (``lse`` may be None
                      when ``need_lse`` is False and the backend saves work by skipping it).
"""
from . import full, llsa, sla, sla2, topk, vsa

MODULES = {"full": full, "topk": topk, "vsa": vsa, "llsa": llsa, "sla": sla, "sla2": sla2}


def method_module(name: str):
    """The module implementing method ``name``."""
    return MODULES[name]
