"""One background thread that runs queued items one at a time, in order (orchestration).

The save worker (ckpt-io) and the uploader (ckpt-upload) each own one: items are handed over with
`put`, `close` lets the items queued so far run and then joins the thread. The handler must not
raise (each keeps its errors on the job it runs). With `cpu` (save/yielding.py) the thread's
priority follows the save's: lowered once a snapshot is staged, raised when something waits.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Generic, TypeVar

from checkpointing.errors import CheckpointError
from checkpointing.save.yielding import CpuYield

Item = TypeVar("Item")


log = logging.getLogger("checkpointing")


class SerialThread(Generic[Item]):
    """A daemon thread named `name` calling `handle(item)` for each item put, in order."""

    def __init__(self, name: str, handle: Callable[[Item], None], *, cpu: CpuYield | None = None, lazy: bool = False) -> None:
        """`lazy`: the thread starts at the first put() (a manager that never saves, read_only=True, starts none).
        Only where put() is called by the training thread: a thread inherits the policy of the one starting it."""
        self._handle = handle
        self._cpu = cpu
        self._queue: queue.Queue[Item | None] = queue.Queue()
        self._unfinished = 0  # items put and not yet handled
        self._closed = False
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        if not lazy:
            self._thread.start()

    def put(self, item: Item) -> None:
        """Queue `item`; CheckpointError once close() began (a save() that raced the manager's close() on another
        thread: the item would never run, and whoever waits for it would wait forever)."""
        with self._idle:  # the item goes in before a close()'s stop, or put() raises
            if self._closed:
                raise CheckpointError("this CheckpointManager was closed (by another thread) while this call ran: nothing was "
                                      "saved; create a new one")
            if self._thread.ident is None:
                self._thread.start()  # first: it waits for the thread, and a KeyboardInterrupt there leaves nothing counted
            self._unfinished += 1
            self._queue.put(item)

    def busy(self) -> bool:
        """An item is running or queued."""
        with self._idle:
            return self._unfinished > 0

    def wait_idle(self) -> None:
        """Until every item put so far has been handled."""
        with self._idle:
            self._idle.wait_for(lambda: self._unfinished == 0)

    def pending(self) -> bool:
        """Something is queued (an item, or close's stop) that waits for the current one."""
        return not self._queue.empty()

    def close(self) -> None:
        """Stop once the items put so far have run; put() raises from now on."""
        with self._idle:
            self._closed = True
            if self._thread.ident is None:
                return  # never started: nothing was put
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        if self._cpu is not None:
            self._cpu.enter()
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                try:
                    self._handle(item)
                except Exception:  # noqa: BLE001 - a handler's bug must not end the thread: every later item would hang
                    log.exception("checkpointing: %s: unexpected error (the thread goes on with the next item)", self._thread.name)
                finally:
                    with self._idle:
                        self._unfinished -= 1
                        self._idle.notify_all()
        finally:
            if self._cpu is not None:
                self._cpu.leave()
