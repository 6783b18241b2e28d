"""What saves cost: SaveStats records and their sink (metrics.jsonl, log line, on_metrics), the step clock, accounting glue, and the summary of a run's records (what `checkpointing report` shows).

Layer: observation (metrics.jsonl is its only file). May import: dist and everything below it.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
"""

__all__: list[str] = []
