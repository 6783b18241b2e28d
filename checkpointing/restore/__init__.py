"""The restore path: which step, planning against the target state, reading verified bytes into target boxes, export.

Layer: orchestration. May import: observe, dist, tier, storage, plan, state, format, errors, options.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
Independent of save/ (neither imports the other).
"""

__all__: list[str] = []
