"""``full``: dense attention."""
from .method import Full

METHOD = Full()
