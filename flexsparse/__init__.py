"""flexsparse: trainable sparse attention for diffusion transformers.

``attention(q, k, v, config)`` mirrors ``F.scaled_dot_product_attention`` for ``(B, H, N, D)`` tensors;
``SparseAttention`` holds learnable parts; ``Config.from_dict`` validates a config dict.
"""
from .api import attention
from .config import METHODS, Config
from .module import SparseAttention

__all__ = ["attention", "SparseAttention", "Config", "METHODS"]
__version__ = "0.1.0"
