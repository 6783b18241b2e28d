"""The save's background threads give the CPU to the training loop while nothing waits for them (orchestration).

On a machine whose cores the training step keeps busy, every CPU-second a save's threads take is
taken from a training thread, and a loop whose intra-op threads meet at barriers, and whose thread
needs the GIL for every op it dispatches, pays more than that second (docs/benchmarks.md, "A
save's threads yield the CPU"). With `background_yield_s` (options.py) the threads doing the work
nothing waits for run at SCHED_IDLE: the kernel gives them a core only when nothing else wants it
(between steps, while the loop waits on I/O, data or the device, on cores training leaves idle),
and a training thread that wakes up preempts them at once.

A save copies its snapshot at normal priority: the guard before the next optimizer.step() waits
for that copy (and the first save allocates the pool then). `CpuYield.lower()` (the ckpt-io
thread, once every chunk is staged) puts every registered thread (ckpt-io, and the write-behind
thread of the pack being written) at SCHED_IDLE for what follows: digests, writes, the commit,
retention, re-verification. `hurry()` puts them back at normal priority whenever something waits
for the save: the next save() (at submit, and while it waits for the previous one), handle.wait(),
wait(), delete(), close(), an emergency save (SaveOutcome.wait()); and a timer `after_s` seconds
after lower(), which bounds how much later a step becomes durable because of yielding. The commit
stops that timer (`committed()`); what follows it stays low until something waits or the next
save is submitted.

Only where it can be undone: Linux, and a process allowed to raise a thread's priority again
(CAP_SYS_NICE, or RLIMIT_NICE >= 20: the kernel treats SCHED_IDLE as nice 20); `can_yield()` tries
it once per process on a thread of its own. Elsewhere nothing is lowered and saves run as without
the option. A thread whose policy is not SCHED_OTHER (SCHED_BATCH, real time, already idle: the
user's choice) is left alone. Threads inherit their maker's policy: the timer is started by the
thread calling lower() before anything is lowered, and no thread that outlives a save may be
started by a lowered one (observe/metrics.py starts its thread up front for that reason).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger("checkpointing")

_IDLE = getattr(os, "SCHED_IDLE", None)
_OTHER = getattr(os, "SCHED_OTHER", None)


@functools.lru_cache(maxsize=1)
def can_yield() -> bool:
    """This process may put a thread at SCHED_IDLE and back (tried once, on a short-lived thread)."""
    if _IDLE is None or _OTHER is None or not hasattr(os, "sched_setscheduler"):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            if os.sched_getscheduler(0) != _OTHER:
                result.append(False)
                return
            os.sched_setscheduler(0, _IDLE, os.sched_param(0))
            os.sched_setscheduler(0, _OTHER, os.sched_param(0))
            result.append(True)
        except OSError as exc:
            log.debug("checkpointing: background threads keep normal priority (%s: cannot raise it again once lowered)", exc)
            result.append(False)

    t = threading.Thread(target=probe, name="ckpt-yield-probe", daemon=True)
    t.start()
    t.join()
    return bool(result and result[0])


class CpuYield:
    """The priority of the threads that run a save's background work (see the module).

    Threads `enter()` on themselves and `leave()` before they end. `after_s` None (or a process
    that may not undo it, see can_yield) turns the whole object into no-ops.
    """

    def __init__(self, after_s: float | None) -> None:
        self.after_s = after_s
        self.enabled = after_s is not None and can_yield()
        self._lock = threading.Lock()
        # registered threads by native id, each at SCHED_IDLE while low, else SCHED_OTHER; a thread that
        # ended without leave() (a pool's) is dropped before its id could name another thread
        self._tids: dict[int, threading.Thread] = {}
        self._low_since: float | None = None  # perf_counter of lower(), while low
        # the current job's (set by the thread running it): True once something waits for that job;
        # lower() does nothing then (checked under the lock the waiter's hurry() takes)
        self.waited: Callable[[], bool] | None = None
        self._low_s = 0.0  # seconds spent low since committed()
        self._timer: threading.Timer | None = None

    @property
    def low(self) -> bool:
        return self._low_since is not None

    def enter(self) -> None:
        """The calling thread does save work: it follows lower()/hurry() until leave()."""
        if not self.enabled:
            return
        tid = threading.get_native_id()
        with self._lock:
            policy = os.sched_getscheduler(0)
            if policy not in (_OTHER, _IDLE):
                return  # the user's policy (SCHED_BATCH, real time): not ours to change
            # SCHED_IDLE here was inherited from a lowered save thread that started this one (where
            # the process itself runs at SCHED_IDLE, can_yield() is False and nothing gets here)
            self._tids[tid] = threading.current_thread()
            want = _IDLE if self._low_since is not None else _OTHER
            if policy != want:
                self._set(tid, want)

    def leave(self) -> None:
        """The calling thread ends (or stops doing save work): back at normal priority, unregistered."""
        if not self.enabled:
            return
        tid = threading.get_native_id()
        with self._lock:
            if self._tids.pop(tid, None) is not None:
                if self._low_since is not None:
                    self._set(tid, _OTHER)

    def lower(self) -> None:
        """Nothing waits for the save: the registered threads run only on cores nothing else wants,
        until hurry() (at the latest `after_s` seconds from now). A no-op while low, and once
        something waits for the current job (`waited`)."""
        if not self.enabled:
            return
        with self._lock:
            if self._low_since is not None or (self.waited is not None and self.waited()):
                return
            # the timer thread is made before this thread is lowered: a thread inherits its maker's policy
            self._timer = threading.Timer(self.after_s, self.hurry)  # type: ignore[arg-type]
            self._timer.name, self._timer.daemon = "ckpt-yield-timer", True
            self._timer.start()
            self._low_since = time.perf_counter()
            me = threading.get_native_id()
            for tid in self._live():
                if tid != me:
                    self._set(tid, _IDLE)
            lower_me = me in self._tids
        if lower_me:  # last, and outside the lock: a lowered thread holding it would make a waiter wait for a free core
            self._set(me, _IDLE)
            if self._low_since is None:  # hurried meanwhile (before that call): undo it
                self._set(me, _OTHER)

    def hurry(self) -> None:
        """Something waits for the save (or the time is up): the registered threads at normal priority."""
        if not self.enabled or self._low_since is None:
            return
        with self._lock:
            if self._low_since is None:
                return
            self._low_s += time.perf_counter() - self._low_since
            self._low_since = None
            timer, self._timer = self._timer, None
            for tid in self._live():
                self._set(tid, _OTHER)
        if timer is not None and timer is not threading.current_thread():
            timer.cancel()

    def committed(self) -> float:
        """The save is committed (durable): no deadline is left to keep, so the timer stops; the
        threads stay low for what follows (retention, records, re-verification) until hurried.
        Returns the seconds spent low since the last call (the save's `yielded_s`)."""
        with self._lock:
            now = time.perf_counter()
            low = self._low_s + (now - self._low_since if self._low_since is not None else 0.0)
            self._low_s = 0.0
            if self._low_since is not None:
                self._low_since = now
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        return low

    def close(self) -> None:
        """No more saves: back at normal priority, no timer left."""
        self.hurry()

    def _live(self) -> list[int]:
        """The registered threads still alive (under the lock); the others are forgotten."""
        for tid in [tid for tid, thread in self._tids.items() if not thread.is_alive()]:
            del self._tids[tid]
        return list(self._tids)

    def _set(self, tid: int, policy: int | None) -> None:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))  # type: ignore[arg-type]
        except OSError as exc:  # the thread ended meanwhile, or the permission was taken away: never fatal
            log.debug("checkpointing: cannot change thread %d's priority: %s", tid, exc)
