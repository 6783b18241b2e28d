"""The on-disk format: names of things on disk, manifest and commit encoding (manifest.py) and strict decoding (decode.py), dtypes, the merge of the ranks' reports, per-step sizes.

Layer: pure (no I/O, no threads). May import: checkpointing.errors only.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
docs/format.md is the spec this code implements.
"""

__all__: list[str] = []
