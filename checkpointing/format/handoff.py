"""Long pure-Python work hands the GIL to a waiting thread at least every millisecond (layer: format).

Rank 0 merges every rank's report into the manifest on a background thread, a tier's leader decodes
it, every rank encodes its report: at hundreds of ranks that is seconds of Python per save, all of
it holding the GIL. CPython lets a thread that waits for the GIL force a switch only after the
switch interval (5 ms), and a training thread takes the GIL back after every op it dispatches: it
waited up to 5 ms each time while such a thread ran, even at SCHED_IDLE (bench/bench_yield.py
--model probe, docs/benchmarks.md: 3.8 ms on average while rank 0 merged 64 ranks' reports, 0.95 ms
with the merge handing over every millisecond, 0.15 ms with no merge). `handoff()` is called once
per unit of such work (a leaf, a shard, a tensor); at most once per millisecond per thread it
releases the GIL for a moment (`time.sleep(0)`), so a thread that waits for it runs at once. With
no thread waiting the cost is a clock read per call and a system call per millisecond.
"""

from __future__ import annotations

import threading
import time

INTERVAL_S = 0.001

_last = threading.local()


def handoff() -> None:
    """Let a thread that waits for the GIL have it, if this thread has held it for INTERVAL_S."""
    now = time.perf_counter()
    last = getattr(_last, "t", None)
    if last is None:
        _last.t = now
    elif now - last >= INTERVAL_S:
        _release()
        _last.t = time.perf_counter()


def _release() -> None:
    time.sleep(0)  # drops the GIL; a thread waiting for it takes it before this one goes on
