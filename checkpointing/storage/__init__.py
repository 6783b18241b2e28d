"""Storage: one small protocol and its backends. Orchestration talks to tiers only through it."""

from .base import Storage, StreamWriter
from .local import LocalStorage

__all__ = ["Storage", "StreamWriter", "LocalStorage"]
