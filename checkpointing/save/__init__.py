"""The save path: the job (frozen inputs, separate progress), the handle, the staging pool, write watching, the writer, the background worker thread, the uploader.

Layer: orchestration. May import: observe, dist, tier, storage, plan, state, format, errors, options.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
Nothing here knows the manager: it is handed what it uses.
"""

__all__: list[str] = []
