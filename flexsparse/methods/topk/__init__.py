"""``topk``: block top-K attention."""
from .method import TopK

METHOD = TopK()
