"""flexsparse: trainable sparse attention for diffusion transformers.

``attention(q, k, v, config)`` mirrors ``F.scaled_dot_product_attention`` for ``(B, H, N, D)`` tensors;
``SparseAttention`` holds learnable parts; ``Config.from_dict`` validates a config dict;
``METHODS`` is the registry of methods; ``patch(model, config)`` swaps the attention of an existing model
(``set_step`` drives its dense warm-up, ``unpatch`` undoes it); ``ParallelConfig`` shards the sequence over
ranks (``flexsparse.parallel``); ``Joint`` marks the text tokens of a joint text+visual sequence.
"""
from .api import attention
from .config import Config, Joint
from .integration import patch, set_step, unpatch
from .methods import METHODS
from .module import SparseAttention
from .parallel import ParallelConfig

__all__ = ["attention", "SparseAttention", "Config", "Joint", "METHODS", "ParallelConfig", "patch", "unpatch",
           "set_step"]
__version__ = "0.1.0"
