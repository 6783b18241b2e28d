"""Across ranks, through the torch.distributed store (never collectives from a background thread): the coordinator protocol and its local and store-backed implementations, store keys, polling, the remote-tier commit.

Layer: I/O (the store). May import: tier, storage, plan, state, format, errors.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
"""

__all__: list[str] = []
