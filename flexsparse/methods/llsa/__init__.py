"""``llsa``: log-linear sparse attention."""
from .method import LLSA

METHOD = LLSA()
