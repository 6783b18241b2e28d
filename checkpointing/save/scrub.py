"""Re-verifying borrowed chunks after each committed save, on the ckpt-io thread (orchestration).

After the worker commits a save (and has set its `done`, so neither that save nor the training
thread waits), `Reverifier.after_commit` reads back and digests the share of the chunks the new
step borrows from earlier files that plan/scrub.py selects, paced at `bytes_per_s`. A chunk that
does not match its digest (or cannot be read) is logged as a warning naming file, bytes and step,
remembered, and `screen` drops it from the reuse base of the next save, which then writes it anew;
the counts go into that save's SaveStats (bytes_reverified, chunks_reverified, chunks_damaged).
When the next save is queued (`busy`) the round reads only the chunks whose window ends now, at
full speed, and leaves the rest for later rounds.

Reads go through the page cache: the packs are written with O_DIRECT, so a chunk is read from the
device unless a restore (or buffered writes: direct_io=False, tmpfs) left its pages cached.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from checkpointing.format.manifest import ChunkRef, chunk_digest
from checkpointing.plan import scrub
from checkpointing.plan.reuse import ReuseBase
from checkpointing.save.job import Reverified
from checkpointing.storage import LocalStorage

log = logging.getLogger("checkpointing")


class Reverifier:
    """The ckpt-io thread's re-verification state: windows per borrowed chunk, chunks found
    damaged, and the counts since the last save took them. `every` None: off. `busy()` says a
    save is waiting for the thread; `interrupt()` (any thread) wakes a paced wait early."""

    def __init__(self, storage: LocalStorage, *, every: int | None, bytes_per_s: float, busy: Callable[[], bool]) -> None:
        self._storage, self._every, self._rate, self._busy = storage, every, bytes_per_s, busy
        self._wake = threading.Event()
        self._round = 0
        self._since: dict[scrub.ChunkId, int] = {}
        self._damaged: set[scrub.ChunkId] = set()
        self._counts = Reverified()
        self._buf = bytearray()

    def interrupt(self) -> None:
        self._wake.set()

    def take_counts(self) -> Reverified:
        """What was re-verified (and found damaged) since the last call: the next save's record."""
        counts, self._counts = self._counts, Reverified()
        return counts

    def screen(self, base: ReuseBase | None) -> ReuseBase | None:
        """`base` less the chunks found damaged: the save that takes it writes them anew."""
        return base.without(self._damaged) if base is not None and self._damaged else base

    def after_commit(self, step: int, borrowed: Sequence[ChunkRef]) -> None:
        """One round over the chunks step `step` borrows from earlier files. Never raises."""
        if self._every is None:
            return
        self._wake.clear()  # a save queued from now on wakes a paced wait; one queued before shows in busy()
        candidates = scrub.unique(borrowed)
        chosen = scrub.select(candidates, self._since, self._round, self._every)
        verified: list[ChunkRef] = []
        t0, done, damaged = time.perf_counter(), 0, 0
        for n, ref in enumerate(chosen.must + chosen.extra):
            must = n < len(chosen.must)
            if not must and self._busy():
                break  # the next save waits: the rest stays due
            wait = 0.0 if self._busy() else scrub.pace(done, time.perf_counter() - t0, self._rate)
            if wait > 0 and self._wake.wait(wait) and not must:
                break
            ok = self._check(step, ref)
            done += ref.length
            verified.append(ref)
            damaged += not ok
        self._since = scrub.advance(self._since, candidates, self._round, verified)
        self._round += 1
        c = self._counts
        self._counts = Reverified(c.bytes + done, c.chunks + len(verified), c.damaged + damaged)

    def _check(self, step: int, ref: ChunkRef) -> bool:
        """Read `ref` back and compare its digest; remember and log it when it does not match."""
        if len(self._buf) < ref.length:
            self._buf = bytearray(ref.length)
        view = memoryview(self._buf)[: ref.length]
        try:
            self._storage.read_into(ref.file, ref.offset, view)
            got = chunk_digest(view)
        except FileNotFoundError:
            log.debug("checkpointing: re-verification: %s is gone (its steps were deleted); not a base any more", ref.file)
            return True  # the next save's base check (every file there at its size) refuses it
        except (OSError, EOFError) as exc:
            got = f"unreadable ({type(exc).__name__}: {exc})"
        if got == ref.digest:
            return True
        self._damaged.add(scrub.chunk_id(ref))
        log.warning("checkpointing: re-verification: bytes %d..%d of %s/%s (a chunk step %d and earlier steps use) are damaged "
                    "(%s, expected %s); the next save writes them anew, and steps before it that use them fail to restore "
                    "from this tier: run `checkpointing verify`", ref.offset, ref.offset + ref.length, self._storage.root,
                    ref.file, step, got, ref.digest)
        return False
