"""SLA2 stage 1 (arXiv 2602.12675, Alg. 1): fit each layer's router (``proj_q``, ``proj_k``) and
``alpha`` by the MSE between SLA2 with the differentiable SoftTop-k router and full attention, on
Q, K, V recorded by ``QKVRecorder``.

One fit per ``topk_ratio`` by default: the paper trains the router and alpha "for each sparsity
setting (5%, 4%, 3%)" and fine-tunes and deploys each at its own k%. A separate fit also suits alpha,
whose best value tracks the attention mass the kept blocks hold, which differs with k%. ``joint=True``
instead fits one router and alpha to the mean of the MSEs over all the ratios (one set of parameters
meant to serve every ratio).

SoftTop-k on standardized scores (``softtopk_standardize``, the default here): the soft objective
has a degenerate minimum. A uniform mask ``M = c`` makes the soft sparse branch
``softmax(S + log c) = softmax(S)``, i.e. full attention, so with ``alpha -> 1`` the soft MSE goes
to 0 while the hard top-k output (what stage 2 and inference run) is no better. Scaling the
projections down moves the mask towards that uniform point, and with the default softmaxed router
scores (``~1/Tk`` each, so ``P_c / tau`` spans little) the mask starts close to it: fitting that
objective lowered the soft MSE ~10x and *raised* the hard MSE by 10-50% on the layers of a small
DiT from ``examples/dit`` (16x16 pixels, 8x4-token blocks, k% = 10 and 5). Standardizing each row
of raw scores before SoftTop-k leaves the hard selection unchanged (same order) but fixes the mask's
sharpness to ``tau`` row standard deviations whatever the projections' scale, so the fit must
improve the ranking; it lowered the hard MSE 2-3x there.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from tabulate import tabulate
from tqdm.auto import tqdm

from ..api import attention
from ..masks import num_blocks, ratio_count
from .layers import require_sla2, set_config
from .record import FULL, QKV, QKVRecorder

FITTED = ("proj_q", "proj_k", "alpha_logit")


@dataclass(frozen=True)
class CalibrationRow:
    """MSE against full attention of one layer at one ``topk_ratio`` (mean over the records), with the
    soft (SoftTop-k, the fitted objective) and the hard (top-k, what stage 2 and inference run) router,
    before and after the fit. ``kept``: key blocks kept per query block of ``key_blocks``."""

    layer: str
    topk_ratio: float
    kept: int
    key_blocks: int
    soft_before: float
    soft_after: float
    hard_before: float
    hard_after: float


@dataclass
class CalibrationResult:
    """``params[topk_ratio][layer]``: the fitted ``proj_q``, ``proj_k``, ``alpha_logit`` (fp32, CPU);
    ``rows``: the MSE report; ``joint``: one fit shared by all ratios."""

    params: dict[float, dict[str, dict[str, torch.Tensor]]]
    rows: list[CalibrationRow]
    joint: bool

    def table(self) -> str:
        """The report as a text table (``tabulate``)."""
        body = [(r.layer, r.topk_ratio, f"{r.kept}/{r.key_blocks}", r.soft_before, r.soft_after, r.hard_before,
                 r.hard_after, f"{100 * (r.hard_after / r.hard_before - 1):+.1f}%" if r.hard_before else "-")
                for r in self.rows]
        return tabulate(body, headers=["layer", "topk_ratio", "blocks", "MSE soft before", "soft after",
                                       "MSE hard before", "hard after", "hard change"], floatfmt=".4g")

    def state_dict(self, topk_ratio: float) -> dict[str, torch.Tensor]:
        """The fit for ``topk_ratio`` under the model's ``state_dict`` keys
        (``<layer>.params.proj_q`` ...), for ``model.load_state_dict(..., strict=False)``. Parameters only: no
        ``<layer>.config`` entry is checked, so the model must be built with ``topk_ratio``."""
        return {f"{layer}.params.{name}": value for layer, fitted in self._fit(topk_ratio).items()
                for name, value in fitted.items()}

    def apply(self, model: torch.nn.Module, topk_ratio: float) -> None:
        """Copy the fit for ``topk_ratio`` into the layers of ``model`` (the recorded model or one built
        the same way) and set their config's ``topk_ratio`` to it, so they run at the ratio they were
        fitted for. (``topk_ratio`` is config, not state: a model loading the calibrated
        ``state_dict`` elsewhere must be built with the same ratio.)"""
        fitted = self._fit(topk_ratio)
        with torch.no_grad():
            for layer, values in fitted.items():
                module = model.get_submodule(layer)
                for name, value in values.items():
                    module.params[name].copy_(value)
                set_config(model, layer, topk_ratio=topk_ratio)

    def _fit(self, topk_ratio: float) -> dict[str, dict[str, torch.Tensor]]:
        if topk_ratio not in self.params:
            raise ValueError(f"no calibration for topk_ratio={topk_ratio}; calibrated: {sorted(self.params)}")
        return self.params[topk_ratio]


def calibrate_sla2(recorder: QKVRecorder, topk_ratios: Sequence[float] = (0.05, 0.04, 0.03), *, steps: int = 200,
                   lr: float = 1e-2, joint: bool = False, standardize: bool = True, tau: float | None = None,
                   backend: str | None = None, device: "torch.device | str | None" = None,
                   progress: bool = True) -> CalibrationResult:
    """Fit the router and alpha of every recorded ``sla2`` layer (stage 1); the layers are not changed
    (``CalibrationResult.apply`` loads a fit into them).

    recorder: a ``QKVRecorder`` that has recorded at least one call of each of its layers.
    topk_ratios: the k% to fit (fraction of key blocks kept per query block).
    steps: Adam steps per layer and fit, one recorded call each (cycling through the records).
    lr: Adam learning rate of ``proj_q``, ``proj_k`` and ``alpha_logit``.
    joint: one fit on the mean MSE over ``topk_ratios`` instead of one fit per ratio.
    standardize: SoftTop-k on per-row standardized raw router scores (see the module docstring);
        False: on the scores as the layer's config computes them (the paper's literal objective).
    tau: SoftTop-k temperature; default: the layer's ``tau`` (0.1, the paper's).
    backend: backend of the hard-router evaluation; default: the layer's own, with ``"auto"`` on a
        CPU device meaning ``"torch"`` (a few no-grad calls do not pay for compiling flex). The soft
        router always runs in PyTorch (O(N^2): every key carries weight).
    device: where to fit; default: the layer's parameters' device. Records are moved there one at a time.
    progress: show a tqdm bar.
    Each fit starts from the layer's current parameters and runs in fp32.
    """
    layers = recorder.layers
    require_sla2(layers)
    empty = [name for name in layers if not recorder.records[name]]
    if empty:
        raise ValueError(f"no recorded call for layers {empty}: run the model inside `with recorder:` first")
    ratios = _check_ratios(topk_ratios)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    groups = [ratios] if joint else [(r,) for r in ratios]
    params: dict[float, dict[str, dict[str, torch.Tensor]]] = {r: {} for r in ratios}
    rows = []
    bar = tqdm(total=len(layers) * len(groups) * steps, desc="SLA2 calibration", disable=not progress)
    for name, module in layers.items():
        on = torch.device(device) if device is not None else module.params["alpha_logit"].device
        data = _LayerData(recorder.records[name], on)
        initial = {n: module.params[n].detach().to(on, torch.float32) for n in FITTED}
        hard_backend = backend or ("torch" if module.backend == "auto" and on.type == "cpu" else module.backend)
        for group in groups:
            configs = [dataclasses.replace(module.config, router="soft", topk_ratio=r, softtopk_standardize=standardize,
                                           tau=module.config.tau if tau is None else tau) for r in group]
            bar.set_description(f"SLA2 calibration {name} k={','.join(f'{r:g}' for r in group)}")
            fitted = _fit(data, configs, initial, steps, lr, bar)
            for ratio, soft in zip(group, configs):
                hard = dataclasses.replace(module.config, topk_ratio=ratio, router="hard")
                params[ratio][name] = {n: t.cpu() for n, t in fitted.items()}
                n_keys = data.records[0].visual_keys
                rows.append(CalibrationRow(
                    name, ratio, ratio_count(ratio, num_blocks(n_keys, soft.block_k), minimum=1),
                    num_blocks(n_keys, soft.block_k),
                    data.mse(soft, initial, "torch"), data.mse(soft, fitted, "torch"),
                    data.mse(hard, initial, hard_backend), data.mse(hard, fitted, hard_backend)))
    bar.close()
    return CalibrationResult(params, rows, joint)


class _LayerData:
    """One layer's records on the fitting device (one call at a time, fp32) and their full-attention
    outputs (computed once, kept where the records are; a joint call's padding text tokens left out)."""

    def __init__(self, records: list[QKV], device: torch.device):
        self.records, self.device = records, device
        self._targets: list[torch.Tensor | None] = [None] * len(records)

    def __len__(self) -> int:
        return len(self.records)

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None, torch.Tensor]:
        r = self.records[i]
        q, k, v = (x.to(self.device, torch.float32) for x in (r.q, r.k, r.v))
        if self._targets[i] is None:
            with torch.no_grad():
                self._targets[i] = attention(q, k, v, FULL, scale=r.scale, joint=self.joint(i)).to(r.q.device)
        return q, k, v, r.scale, self._targets[i].to(self.device)

    def joint(self, i: int):
        """Record ``i``'s ``Joint`` (None without text tokens) on the fitting device."""
        joint = self.records[i].joint
        return None if joint is None else joint.to(self.device)

    def loss(self, i: int, config, params: dict[str, torch.Tensor], backend: str) -> torch.Tensor:
        """MSE (fp32) of SLA2 with ``config`` and ``params`` against full attention on record ``i`` (a joint call as
        such: the method on its visual tokens, the text attended densely)."""
        q, k, v, scale, target = self.get(i)
        out = attention(q, k, v, config, backend=backend, scale=scale, params=params, joint=self.joint(i))
        return F.mse_loss(out, target)

    @torch.no_grad()
    def mse(self, config, params: dict[str, torch.Tensor], backend: str) -> float:
        """Mean of ``loss`` over the records."""
        return sum(self.loss(i, config, params, backend).item() for i in range(len(self))) / len(self)


def _fit(data: _LayerData, configs: list, initial: dict[str, torch.Tensor], steps: int, lr: float,
         bar) -> dict[str, torch.Tensor]:
    """Adam on the mean over ``configs`` of the soft-router MSE, from ``initial``; the fitted tensors."""
    params = {n: t.clone().requires_grad_(True) for n, t in initial.items()}
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    for step in range(steps):
        loss = sum(data.loss(step % len(data), c, params, "torch") for c in configs) / len(configs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4g}")
    return {n: t.detach() for n, t in params.items()}


def _check_ratios(ratios: Sequence[float]) -> tuple[float, ...]:
    if isinstance(ratios, (int, float)):
        ratios = (ratios,)
    ratios = tuple(ratios)
    if not ratios:
        raise ValueError("topk_ratios must name at least one ratio")
    for r in ratios:
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"topk_ratios must be numbers in (0, 1] (fraction of key blocks kept), got {r!r}")
    if len(set(ratios)) != len(ratios):
        raise ValueError(f"topk_ratios has repeated values: {ratios}")
    return tuple(float(r) for r in ratios)
