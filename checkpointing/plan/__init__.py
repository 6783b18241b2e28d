"""Decisions as pure functions: where each chunk goes (pack plan), which rank writes a replicated tensor, which chunks an incremental save reuses, retention, when to save, interval advice.

Layer: pure. May import: checkpointing.errors, checkpointing.format.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
"""

__all__: list[str] = []
