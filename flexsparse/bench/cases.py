"""The registry of benchmark cases: method config x backend x shape x mode, plus the dense baselines.

Methods come from ``flexsparse.methods.METHODS`` (name -> ``.backends``, ``.example`` config) and backend
availability from ``flexsparse.backends.runs_on``; nothing else of the package's internals is used.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..backends import runs_on
from ..methods import METHODS

MODES = ("fwd", "fwd+bwd")
BASELINES = {"sdpa": "dense SDPA", "flex_dense": "dense flex"}   # kind -> name in tables
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CHECK_SHAPE = {"batch": 1, "heads": 2, "n": 700}   # the reference check's shape (N ragged for every block size)


@dataclass
class Case:
    """One measurement. ``kind``: ``"method"``, ``"sdpa"`` (``F.scaled_dot_product_attention``) or
    ``"flex_dense"`` (compiled ``flex_attention``, no mask); ``config``/``backend``: a method case's; shape
    ``(batch, heads, n, dim)`` in ``dtype`` (a torch dtype name) on ``device``; ``mode``: ``"fwd"``,
    ``"fwd+bwd"`` or ``"check"`` (max error against the fp64 reference); ``graph``: time CUDA-graph replays."""

    kind: str
    config: dict | None
    backend: str | None
    batch: int
    heads: int
    n: int
    dim: int
    dtype: str
    mode: str
    device: str
    graph: bool = False

    @property
    def name(self) -> str:
        """The method's name, or the baseline's (``"dense SDPA"``, ``"dense flex"``)."""
        return self.config["method"] if self.kind == "method" else BASELINES[self.kind]

    @property
    def label(self) -> str:
        """What the progress bar and the messages call the case, e.g. ``llsa/triton N=65536 fwd+bwd``."""
        what = f"{self.name}/{self.backend}" if self.kind == "method" else self.name
        return f"check {what} N={self.n}" if self.mode == "check" else f"{what} N={self.n} {self.mode}"

    def to_dict(self) -> dict:
        """The JSON form that ``measure`` and ``worker.py`` take (the fields and ``label``)."""
        return {**asdict(self), "label": self.label}


def method_names() -> list[str]:
    """Every registered method, in registry order."""
    return list(METHODS)


def backend_names() -> list[str]:
    """Every backend some method runs on, ``"reference"`` left out (it is the check, not a contender)."""
    names = []
    for method in METHODS.values():
        names += [b for b in method.backends if b != "reference" and b not in names]
    return names


def example_config(method: str) -> dict:
    """A copy of the method's example config."""
    return dict(METHODS[method].example)


def runnable_backends(method: str, device: torch.device, backward: bool, wanted=None) -> list[str]:
    """The method's backends (``"reference"`` left out, among ``wanted`` if given) that run on ``device``,
    with backward when ``backward``."""
    return [b for b in METHODS[method].backends
            if b != "reference" and (wanted is None or b in wanted) and runs_on(b, device, backward)]


def make_cases(configs: dict[str, dict], backends: dict[str, list[str]], sizes: list[int], *, batch: int,
               heads: int, dim: int, dtype: str, modes: tuple[str, ...], device: str, baselines: tuple[str, ...],
               check: bool, graph: bool = False) -> list[Case]:
    """The cases of a run. ``configs``: method name -> config; ``backends``: method name -> backends to time;
    ``baselines``: kinds timed at every size and mode (``"flex_dense"`` only where FlexAttention runs that mode
    on the device). With ``check``, one ``"check"`` case per (method, backend) comes first, at
    ``CHECK_SHAPE``. Then, for each size and mode, the baselines and the method cases."""
    cases = []
    if check:
        cases += [Case("method", configs[m], b, CHECK_SHAPE["batch"], CHECK_SHAPE["heads"], CHECK_SHAPE["n"], dim,
                       dtype, "check", device) for m in configs for b in backends[m]]
    for n in sizes:
        for mode in modes:
            backward = mode == "fwd+bwd"
            shape = dict(batch=batch, heads=heads, n=n, dim=dim, dtype=dtype, mode=mode, device=device, graph=graph)
            for kind in baselines:
                if kind != "flex_dense" or runs_on("flex", torch.device(device), backward):
                    cases.append(Case(kind, None, None, **shape))
            cases += [Case("method", configs[m], b, **shape) for m in configs for b in backends[m]]
    return cases
