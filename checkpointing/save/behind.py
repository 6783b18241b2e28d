"""Write-behind: pool ranges handed over while staging goes on, written to the pack on a thread of their own.

The save's I/O thread copies chunks into the pool and digests them; each range it hands over here is
written by the `ckpt-write` thread (SerialThread), in the order given, in `write_block` pieces. Both
threads spend their time in calls that release the GIL (memmove and xxh3 on one, pwrite on the
other), so the write of the first chunks overlaps the copy of the later ones, and the save is
durable about one copy sooner. The pool's bytes in a handed-over range are not changed until
`finish()` returns: the pool is reused only by the next save, which starts after this one.

The thread's priority follows the save's (`cpu`, save/yielding.py).

A failed write keeps its error; what is queued after it is skipped, and `finish()` raises it.
"""

from __future__ import annotations

from checkpointing.save.serial import SerialThread
from checkpointing.save.yielding import CpuYield
from checkpointing.storage import StreamWriter


def write_range(stream: StreamWriter, view: memoryview, start: int, end: int, block: int) -> None:
    """Write pool bytes [start, end) of `view` to `stream` in pieces of at most `block` bytes."""
    while start < end:
        n = min(end - start, block)
        stream.write(view[start : start + n])
        start += n


class WriteBehind:
    """Writes ranges of `view` to `stream` on a background thread, in the order they are put."""

    def __init__(self, stream: StreamWriter, view: memoryview, write_block: int, *, cpu: CpuYield | None = None) -> None:
        self._stream = stream
        self._view = view
        self._block = write_block
        self._error: BaseException | None = None
        self._dropped = False
        self._thread: SerialThread[tuple[int, int]] = SerialThread("ckpt-write", self._write, cpu=cpu)

    def put(self, start: int, end: int) -> None:
        """Write pool bytes [start, end) next."""
        self._thread.put((start, end))

    def finish(self) -> None:
        """Wait until everything put is written; raise the first write's error."""
        self._thread.close()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """Skip what is still queued and wait for the write under way (the stream is closed next)."""
        self._dropped = True
        self._thread.close()

    def _write(self, span: tuple[int, int]) -> None:
        if self._error is not None or self._dropped:
            return
        try:
            write_range(self._stream, self._view, *span, self._block)
        except BaseException as exc:  # kept for finish(): a SerialThread's handler must not raise
            self._error = exc
