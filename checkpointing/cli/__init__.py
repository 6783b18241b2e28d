"""`checkpointing ls|inspect|verify|gc|report|export` (also `python -m checkpointing`): argument parsing, commands, the report's tables and plot.

Layer: the top (a user of the package). May import: anything.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
"""

from checkpointing.cli.app import main

__all__ = ["main"]
