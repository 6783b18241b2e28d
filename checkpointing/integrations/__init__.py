"""Adapters that let training frameworks drive a CheckpointManager (optional extras).

Each module imports its framework at import time and is imported only by users of that
framework: `checkpointing.integrations.lightning` (Lightning's CheckpointIO),
`checkpointing.integrations.transformers` (the Hugging Face Trainer), and
`checkpointing.integrations.torchtitan` (torchtitan's checkpointer). Nothing in the core imports
this package (import-linter checks it).
"""
