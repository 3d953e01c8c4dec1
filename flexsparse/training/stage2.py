"""SLA2 stage 2 (arXiv 2602.12675, Alg. 1): fine-tune the model with the hard top-k router (as at
inference), the router frozen and alpha trained with the model."""
from __future__ import annotations

from torch import nn

from .layers import LayerSpec, require_sla2, select_layers, set_config

TRAINABLE = ("alpha", "none", "all")


def prepare_stage2(model: nn.Module, layers: LayerSpec = None, *, trainable: str = "alpha",
                   router: str = "hard") -> list[dict]:
    """Switch the chosen ``sla2`` layers (see ``select_layers``; default all) to ``router`` and set
    which of their parameters train; return the optimizer's param groups.

    trainable: ``"alpha"`` (the paper: router frozen, alpha trained), ``"none"`` (router and alpha
        frozen) or ``"all"`` (router too; it gets gradients only through ``router="soft"``, since
        hard top-k is not differentiable, so ``"all"`` with ``"hard"`` is refused).
    Returns ``[{"name": "model", "params": [...]}, {"name": "alpha", ...}, {"name": "router", ...}]``:
    the model's other parameters that require grad (left as they are), then the layers' trainable
    alpha and router parameters, empty groups left out. Extra keys (``lr``, ...) may be added to a
    group before it goes to the optimizer, e.g. a larger learning rate for alpha.
    """
    if trainable not in TRAINABLE:
        raise ValueError(f"trainable must be one of {list(TRAINABLE)}, got {trainable!r}")
    if router not in ("hard", "soft"):
        raise ValueError(f"router must be 'hard' or 'soft', got {router!r}")
    if trainable == "all" and router == "hard":
        raise ValueError("trainable='all' trains the router, but hard top-k passes it no gradient; "
                         "use router='soft' (O(N^2) like calibration) or trainable='alpha'")
    chosen = select_layers(model, layers)
    require_sla2(chosen)
    alpha, proj = [], []
    for name, module in chosen.items():
        set_config(model, name, router=router)
        module.params["alpha_logit"].requires_grad_(trainable != "none")
        for key in ("proj_q", "proj_k"):
            module.params[key].requires_grad_(trainable == "all")
        alpha.append(module.params["alpha_logit"])
        proj += [module.params["proj_q"], module.params["proj_k"]]
    special = {id(p) for p in alpha + proj}
    groups = [{"name": "model", "params": [p for p in model.parameters() if p.requires_grad and id(p) not in special]},
              {"name": "alpha", "params": [p for p in alpha if p.requires_grad]},
              {"name": "router", "params": [p for p in proj if p.requires_grad]}]
    return [g for g in groups if g["params"]]
