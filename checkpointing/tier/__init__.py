"""One tier at a time: the catalog of committed steps, pins of saves in flight, reference-safe collection (gc, retention), the TIER id, verification.

Layer: I/O through the storage protocol. May import: storage, plan, state, format, errors.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
"""

__all__: list[str] = []
