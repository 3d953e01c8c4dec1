"""FP8 quantization of the sparse branch: scales, saturating casts and straight-through estimators."""
