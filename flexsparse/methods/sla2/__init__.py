"""``sla2``: SLA2, learnable router and alpha-mixing of sparse and linear attention."""
from .method import SLA2

METHOD = SLA2()
