"""``sla``: sparse-linear attention."""
from .method import SLA

METHOD = SLA()
