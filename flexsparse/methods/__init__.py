"""The methods, one folder each: ``config.py`` (its config class), ``method.py`` (select -> attend -> combine on a
backend) and ``reference.py`` (its dense spec). ``METHODS`` is the one registry: adding a method is its folder
plus one name in the line below (CONTRIBUTING.md, "Adding a method").
"""
from ..config import Config
from . import full, llsa, sla, sla2, topk, vsa
from .base import Method, SeqLenRequired

METHODS: dict[str, Method] = {m.METHOD.name: m.METHOD for m in (full, topk, vsa, llsa, sla, sla2)}
Config.registry.update({name: method.config for name, method in METHODS.items()})

__all__ = ["METHODS", "Method", "SeqLenRequired"]
