"""When LightningCheckpointIO opens its manager, and how its teardown waits (layer: integrations).

`arm`: a global optimizer-step hook that acts only for steps a Lightning Strategy takes with this plugin
as its CheckpointIO (found on the stack: Lightning steps every optimizer through Strategy.optimizer_step).
A plugin kept only to read (`LightningCheckpointIO(dir).load_module(...)`) never opens a manager, so it
never writes to the directory nor takes its writer lock, whatever optimizers the process steps.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Callable

from lightning.pytorch.strategies import Strategy
from torch.optim.optimizer import register_optimizer_step_post_hook

from checkpointing.errors import CheckpointError, CheckpointNotFoundError

log = logging.getLogger("checkpointing")

MAX_DEPTH = 64  # frames between a Strategy's optimizer_step and the optimizer's step hooks (a few in practice)


def arm(io: Any, after_step: Callable[[Any], None]) -> Any:
    """Call `after_step(io)` after each optimizer step a Lightning Strategy using `io` takes (while `io` lives).
    Returns the hook's handle (removed when `io` is collected)."""
    me = weakref.ref(io)
    attached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> whether a Strategy of io steps it

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        plugin = me()
        if plugin is None:
            return
        known = attached.get(optimizer)
        if known is None:
            known = attached[optimizer] = stepped_for(plugin, sys._getframe(1))
        if known:
            after_step(plugin)

    handle = register_optimizer_step_post_hook(hook)
    weakref.finalize(io, handle.remove)
    return handle


def stepped_for(io: Any, frame: Any) -> bool:
    """Whether the optimizer step running at `frame` is a Lightning Strategy's whose CheckpointIO is `io`
    (directly, or inside a wrapping one such as Lightning's AsyncCheckpointIO)."""
    for _ in range(MAX_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name == "optimizer_step":
            owner = frame.f_locals.get("self")
            if isinstance(owner, Strategy):
                plugin = owner._checkpoint_io
                for _ in range(8):  # unwrap _WrappingCheckpointIO
                    if plugin is io:
                        return True
                    plugin = getattr(plugin, "_checkpoint_io", None)
                return False
        frame = frame.f_back
    return False


def delete_steps(mgr: Any, steps: list[int]) -> set[int]:
    """mgr.delete() each of `steps` (released by Lightning); those that stay, returned: a tier that cannot be listed (an
    outage) fails a delete, and training goes on (they are tried again at the next collection, or by the next run)."""
    kept = set()
    for step in steps:
        try:
            mgr.delete(step, allow_latest=True)
        except CheckpointNotFoundError:
            pass  # gone already (a retention of the manager's own)
        except CheckpointError as exc:
            log.warning("checkpointing: LightningCheckpointIO: step %d stays for now: %s", step, exc)
            kept.add(step)
    return kept
