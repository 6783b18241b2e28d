"""What the training loop calls besides save()/restore(): step marks, should_save, preemption.

Layer: orchestration. May import: save, restore and everything below.
Internal: nothing here is public API; the facade `checkpointing` re-exports what users need.
Preemption sees the manager only through a narrow protocol.
"""

__all__: list[str] = []
