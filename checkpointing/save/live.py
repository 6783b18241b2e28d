"""The writing managers alive in this process (layer: save): their saves finish at interpreter exit, and a
child forked from the process disowns them.

A child that `fork()` made (a DataLoader worker, multiprocessing's "fork" start method, os.fork) has a
copy of every manager, but none of its threads: waiting for their saves would hang for ever, and
finishing them would write the parent's records into the checkpoint directory a second time. So in
the child every manager turns closed at once (`forked`: nothing waited for, nothing written, its
optimizer guard removed), and exiting the child does nothing to the directory. The writer lock
(tier/lock.py) and the preemption handlers (training/preemption.py) let go in the child by their
own fork handlers.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import weakref
from typing import Any, Callable

log = logging.getLogger("checkpointing")

_LIVE: "weakref.WeakKeyDictionary[Any, tuple[Callable, Callable]]" = weakref.WeakKeyDictionary()  # manager -> (close, forked)


def track(close: Callable[[], Any], forked: Callable[[], Any]) -> None:
    """A manager opened here: `close()` at exit, `forked()` in a forked child (its bound methods; it is held weakly)."""
    _LIVE[close.__self__] = (close.__func__, forked.__func__)  # type: ignore[attr-defined]


def _each(which: int) -> list[Callable[[], Any]]:
    return [functools.partial(methods[which], owner) for owner, methods in list(_LIVE.items())]


@atexit.register
def _finish_saves_at_exit() -> None:
    """A save issued just before the interpreter exits still becomes durable."""
    for close in _each(0):
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - exiting: report, do not raise
            log.error("checkpointing: at exit: %s", exc)


def _in_child() -> None:
    for forked in _each(1):
        try:
            forked()
        except Exception:  # noqa: BLE001 - the child goes on; the manager is closed whatever failed
            pass
    _LIVE.clear()


os.register_at_fork(after_in_child=_in_child)
