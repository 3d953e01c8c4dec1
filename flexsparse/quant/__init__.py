"""FP8 quantization of the sparse branch: scales, saturating casts, fake quantization (FP8 e4m3, INT8 for
Q and K) and the QAT wrapper of a softmax branch (docs/methods.md "FP8 QAT").

torchao (extra ``quant``) provides the scale and cast primitives; it is imported on first use only.
"""
from .attention import (at_quantized_statistics, qat_attention, quantize_kv, quantize_qk, quantize_v,
                        quantized_softmax, quantizes_p)
from .formats import (E4M3, E4M3_MAX, FORMATS, INT8_MAX, P_SCALE, amax_to_scale, block_scales, channel_scales,
                      fake_quant, fake_quant_blocks, head_scales, quantize, to_e4m3)

__all__ = [
    "qat_attention", "quantize_kv", "quantize_qk", "quantize_v", "quantized_softmax", "quantizes_p",
    "at_quantized_statistics", "E4M3", "E4M3_MAX", "FORMATS", "INT8_MAX", "P_SCALE", "amax_to_scale",
    "block_scales", "channel_scales", "fake_quant", "fake_quant_blocks", "head_scales", "quantize", "to_e4m3",
]
