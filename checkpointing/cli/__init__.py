"""`checkpointing ls|inspect|verify|gc|report|export` (also `python -m checkpointing`).

app.py parses the arguments and runs a command; commands.py holds the commands on a tier (targets.py
opens the tier, progress.py draws their progress bars), report.py the report's tables, plot and
command; fmt.py is how all of them format numbers and print a failure, tables.py how ls, inspect
and report fit their tables to the terminal (--wide: every column).

Layer: the top (a user of the package). May import: anything.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
"""

from checkpointing.cli.app import main

__all__ = ["main"]
