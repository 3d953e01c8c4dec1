"""``vsa``: coarse tile attention plus fine block top-K attention."""
from .method import VSA

METHOD = VSA()
