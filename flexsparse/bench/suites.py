"""Named suites: which methods, backends, shapes and baselines a run takes when the command line does not say."""
from __future__ import annotations

from dataclasses import dataclass

GPU_PAPER_SHAPE = {"sizes": [65536], "batch": 2, "heads": 8, "dim": 64, "dtype": "bf16"}


@dataclass(frozen=True)
class Suite:
    """``methods``/``backends``: ``None`` for every registered method / every backend that runs on the device;
    ``shapes``: device type (``"cuda"``, ``"cpu"``) -> ``sizes``, ``batch``, ``heads``, ``dim``, ``dtype``
    (``"cuda"``'s serve a device without its own entry); ``baselines``: ``cases.BASELINES`` kinds;
    ``check``: check each (method, backend) against the fp64 reference first."""

    about: str
    shapes: dict
    methods: tuple[str, ...] | None = None
    backends: tuple[str, ...] | None = None
    baselines: tuple[str, ...] = ("sdpa",)
    check: bool = False

    def shape(self, device_type: str) -> dict:
        """The default shape of the suite on a device type."""
        return dict(self.shapes.get(device_type, self.shapes["cuda"]))


SUITES = {
    "demo": Suite(
        "every method x every backend that runs on the device, checked against the reference at N=700; "
        "dense SDPA (and dense FlexAttention beside the flex backend) as baselines",
        {"cuda": {"sizes": [4096, 16384, 65536], "batch": 2, "heads": 8, "dim": 64, "dtype": "bf16"},
         "cpu": {"sizes": [1024, 2048], "batch": 1, "heads": 2, "dim": 64, "dtype": "fp32"}},
        baselines=("sdpa", "flex_dense"), check=True),
    "compare": Suite(
        "llsa, sla, sla2, topk, vsa (example configs) on triton at B2 H8 N65536 D64 bf16, and dense SDPA",
        {"cuda": GPU_PAPER_SHAPE}, methods=("llsa", "sla", "sla2", "topk", "vsa"), backends=("triton",)),
    "flex": Suite(
        "every method on the flex backend at B2 H8 N65536 D64 bf16, with dense SDPA and dense FlexAttention",
        {"cuda": GPU_PAPER_SHAPE}, backends=("flex",), baselines=("sdpa", "flex_dense")),
    "long": Suite(
        "llsa, sla, topk on triton at N = 64K, 128K, 256K (B2 H8 D64 bf16), and dense SDPA",
        {"cuda": {**GPU_PAPER_SHAPE, "sizes": [65536, 131072, 262144]}}, methods=("llsa", "sla", "topk"),
        backends=("triton",)),
}
