"""Training helpers for SLA2's two stages (arXiv 2602.12675, Alg. 1).

Stage 1 (calibration): ``QKVRecorder`` records the Q, K, V of chosen ``SparseAttention`` layers from
a few batches; ``calibrate_sla2`` fits each layer's router and alpha by MSE against full attention
with the SoftTop-k router, per ``topk_ratio``; ``CalibrationResult.apply`` loads a fit into the layers
(or ``.state_dict(ratio)`` for ``load_state_dict``). Stage 2: ``prepare_stage2`` switches the layers
to the hard top-k router, freezes the router and returns the optimizer's param groups.
"""
from .calibrate import CalibrationResult, CalibrationRow, calibrate_sla2
from .layers import select_layers, set_config
from .record import QKV, QKVRecorder
from .stage2 import prepare_stage2

__all__ = ["QKVRecorder", "QKV", "calibrate_sla2", "CalibrationResult", "CalibrationRow", "prepare_stage2",
           "select_layers", "set_config"]
