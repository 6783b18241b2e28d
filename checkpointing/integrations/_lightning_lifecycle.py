"""When LightningCheckpointIO opens its manager, and how its teardown waits (layer: integrations).

`arm`: a global optimizer-step hook that acts only for steps a Lightning Strategy takes with this plugin as
its CheckpointIO (found on the stack: Lightning steps every optimizer through Strategy.optimizer_step); the
manager opens at the first (`after_step`).
A plugin kept only to read (`LightningCheckpointIO(dir).load_module(...)`) never opens a manager, so it
never writes to the directory nor takes its writer lock, whatever optimizers the process steps.

`wrapped_by`, `chain_teardown`: a wrapping CheckpointIO whose teardown does not call the wrapped one's (Lightning's
AsyncCheckpointIO) gets the plugin's teardown after its own, so that the end of fit waits for the saves
and writes their pointers there too (`trainer.test(ckpt_path="best")` next finds them).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from typing import Any

from lightning.pytorch.strategies import Strategy
from torch.optim.optimizer import register_optimizer_step_post_hook

from checkpointing.errors import CheckpointError, CheckpointNotFoundError
from checkpointing.integrations import _lightning_values as vals

log = logging.getLogger("checkpointing")

MAX_DEPTH = 64  # frames between a Strategy's optimizer_step and the optimizer's step hooks (a few in practice)


def arm(io: Any) -> Any:
    """Call `after_step(io)` after each optimizer step a Lightning Strategy using `io` takes (while `io` lives), and
    `wrapped_by(io, outer)` once per optimizer whose Strategy's CheckpointIO wraps `io` (`outer`: Lightning's
    AsyncCheckpointIO, say). Returns the hook's handle (removed when `io` is collected)."""
    me = weakref.ref(io)
    attached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> whether a Strategy of io steps it

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        plugin = me()
        if plugin is None:
            return
        known = attached.get(optimizer)
        if known is None:
            outer = strategy_io(plugin, sys._getframe(1))
            known = attached[optimizer] = outer is not None
            if outer is not None and outer is not plugin:
                wrapped_by(plugin, outer)
        if known:
            after_step(plugin)

    handle = register_optimizer_step_post_hook(hook)
    weakref.finalize(io, handle.remove)
    _PLUGINS.add(io)
    return handle


_PLUGINS: weakref.WeakSet = weakref.WeakSet()  # the plugins of this process


def _in_child() -> None:
    """A child forked from this process (a DataLoader worker): a plugin's saves and their done callbacks are the
    parent's, so its teardown at exit would wait for ever. Here it forgets them (the manager: save/live.py)."""
    for io in list(_PLUGINS):
        io._lock = threading.Lock()  # another thread may have held it at the fork
        if io._mgr is not None:
            atexit.unregister(io._at_exit)
            io._mgr, io._steps = None, {}


os.register_at_fork(after_in_child=_in_child)


def after_step(io: Any) -> None:
    """After an optimizer step of a Trainer that uses `io`: open its manager (global rank 0), which then defers the
    copy of the state the optimizer steps, so that the first save costs the loop no more than the later ones."""
    if io._mgr is None:
        vals.add_rank_zero_group(io._options)  # under DDP, on every rank once (a collective): the group rank 0 saves in
    if io._mgr is None and vals.global_rank_zero():
        try:
            io._open()
        except CheckpointError as exc:  # the first save raises it, where Lightning reports it
            log.debug("checkpointing: LightningCheckpointIO: opening the manager after a step: %s", exc)


def wrapped_by(io: Any, outer: Any) -> None:
    """A Strategy's CheckpointIO `outer` wraps `io` (Lightning's AsyncCheckpointIO): saves reach `io` after Lightning
    made them (and after removals Lightning made since: _lightning_pending.Removals), and the end of fit must wait for
    them too: `outer`'s teardown ends with `io`'s."""
    chain_teardown(outer, io)
    with io._lock:
        io._removals.reordered = True


def strategy_io(io: Any, frame: Any) -> Any:
    """When the optimizer step running at `frame` is a Lightning Strategy's whose CheckpointIO is `io` (directly, or
    inside a wrapping one such as Lightning's AsyncCheckpointIO): that Strategy's CheckpointIO; else None."""
    for _ in range(MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name == "optimizer_step":
            owner = frame.f_locals.get("self")
            if isinstance(owner, Strategy):
                plugin = outer = owner._checkpoint_io
                for _ in range(8):  # unwrap _WrappingCheckpointIO
                    if plugin is io:
                        return outer
                    plugin = getattr(plugin, "_checkpoint_io", None)
                return None
        frame = frame.f_back
    return None


def chain_teardown(wrapper: Any, io: Any) -> None:
    """Make `wrapper.teardown()` (a CheckpointIO wrapping `io`) end with `io.teardown()`, once per wrapper; a second
    teardown of `io` (a wrapper that calls it itself) finds nothing left to do."""
    if getattr(wrapper, "_checkpointing_chained", None) is io:
        return
    own = wrapper.teardown

    def teardown() -> None:
        try:
            own()
        finally:
            io.teardown()

    wrapper.teardown = teardown
    wrapper._checkpointing_chained = io


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
