"""The config of ``full``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import Config


@dataclass(frozen=True)
class FullConfig(Config):
    """Dense softmax attention."""

    method: ClassVar[str] = "full"
