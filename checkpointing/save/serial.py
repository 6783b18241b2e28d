"""One background thread that runs queued items one at a time, in order (orchestration).

The save worker (ckpt-io) and the uploader (ckpt-upload) each own one: items are handed over with
`put`, `close` lets the items queued so far run and then joins the thread. The handler must not
raise (each keeps its errors on the job it runs). With `cpu` (save/yielding.py) the thread's
priority follows the save's: lowered once a snapshot is staged, raised when something waits.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

from checkpointing.save.yielding import CpuYield

Item = TypeVar("Item")


class SerialThread(Generic[Item]):
    """A daemon thread named `name` calling `handle(item)` for each item put, in order."""

    def __init__(self, name: str, handle: Callable[[Item], None], *, cpu: CpuYield | None = None) -> None:
        self._handle = handle
        self._cpu = cpu
        self._queue: queue.Queue[Item | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Item) -> None:
        self._queue.put(item)

    def pending(self) -> bool:
        """Something is queued (an item, or close's stop) that waits for the current one."""
        return not self._queue.empty()

    def close(self) -> None:
        """Stop once the items put so far have run."""
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
                self._handle(item)
        finally:
            if self._cpu is not None:
                self._cpu.leave()
