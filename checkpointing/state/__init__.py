"""A user's state as data: flattening into a JSON tree plus tensor leaves, DTensor sharding facts, opt-in codecs, RNG state, byte views of tensors.

Layer: pure. May import: checkpointing.errors, checkpointing.format.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
"""

__all__: list[str] = []
