"""Cyclic garbage collection paused while a manifest is built or read (layer: format).

Committing a step, rank 0 parses every rank's report, merges them, encodes the manifest and decodes
it again (the reader's checks); a tier's leader decodes it too, and every restore decodes the
manifest it reads. That is hundreds of thousands of lists, dicts and small objects per manifest of
a few ranks (millions at hundreds of ranks), all alive until the decode or merge ends. Such a burst
keeps triggering CPython's cyclic collector, and the survivors push it into full collections that
walk the whole process's heap, every tensor and module of the training process included: measured,
half of rank 0's CPU per save went to them, and half of decoding a 10 MB manifest
(docs/benchmarks.md, "What every rank pays per save for the commit"). None of it forms cycles;
reference counting frees it all the same. `decode.decode_manifest` runs inside this pause; the
coordinators (dist/) put it around rank 0's whole merge, and the save worker (save/worker.py)
around each save it writes and commits: objects that live while a save runs and die after it
would otherwise be promoted by collections meanwhile and set off a full collection every few dozen
saves. Cyclic garbage the rest of the process makes inside a block is collected after it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0  # blocks open now, in any thread
_resume = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off inside the block, on again after the last open block ends if it was
    on when the first began (a process that turned it off keeps it off). Blocks may overlap across
    threads. A gc.disable() another thread makes inside a block is undone at its end."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
