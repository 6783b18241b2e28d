"""Preemption: on SIGTERM, save the latest state, commit it, and exit within the grace period.

Installed by ``mgr.handle_preemption(state, grace_s=..., signals=...)`` (orchestration).

- **The signal handler only records the signal** (which, when) and wakes the watchdog. Python
  runs it on the main thread between two bytecodes, possibly in the middle of a save() or of the
  user's code, so it touches no lock, file or tensor.
- **The training thread acts at its next safe point**: a point where the user's whole state is
  the state after a finished step, which only the loop knows: ``mgr.should_save(step)``,
  ``mgr.save(step, ...)``, ``mgr.step(step)`` (the previous step ended) and the end of
  ``with mgr.step(step):``. There the manager saves `state` as that step (eagerly; a save of
  that step already in flight is simply finished), waits until it is committed on the local
  tier, and exits: ``SystemExit(128 + signum)`` when the previous handler was the default one
  (so ``with`` blocks and ``finally`` clauses run and the exit status is the conventional 143
  for SIGTERM), the previous Python handler is called when there was one, and nothing more
  happens when the signal was ignored before.
- **The optimizer step pre-hook is not a safe point** for an emergency save: between backward and
  optimizer.step() the parameters are those of the previous step but the data loader, the RNG and
  the user's counters have moved on. A loop that marks no step (only save() every N steps) gets
  the in-flight save finished at the next optimizer.step(), and then exits: the newest committed
  step is restored next time.
- **Several ranks** must save the same step. The first rank to reach a safe point after its
  signal proposes the next step (its last finished step + 1) through the job's store
  (compare-and-set: the first proposal wins); every rank checks the store at each safe point
  (one round trip per step, only while handling is installed), and each saves the agreed step
  when it gets there. One step of margin suffices when the ranks synchronise every step (data
  parallel training does, in backward): no rank can have finished step a + 1 before the
  proposer, still at the end of step a, has done its part of it. The save commits through the
  coordinator like any other; then the ranks meet at a store barrier and exit. A rank that is
  not signalled (a signal delivered to one process only) learns of the stop from the store.
- **The watchdog** (a daemon thread) ends the process with status 128 + signum when the grace
  period runs out before the process has exited: a safe point never reached (a hung collective,
  a loop that marks no step and saves rarely), an upload still running in close(). Whatever
  was not committed by then is invisible (commit marker last), so the next start restores the
  newest committed step; an interrupted upload to the remote tier resumes then.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from typing import Any, Mapping, Protocol

from checkpointing.dist import keys
from checkpointing.dist.store import wait_set
from checkpointing.dist.types import Store
from checkpointing.errors import CheckpointError
from checkpointing.options import PreemptionOptions
from checkpointing.save.job import SaveJob

log = logging.getLogger("checkpointing")

STOP_KEY = keys.PREEMPT_STOP


class SavePath(Protocol):
    """What preemption asks of the manager's save path (save/issue.SaveIssuer is one)."""

    @property
    def current(self) -> SaveJob | None:
        """The newest save issued (it may be done)."""
        ...

    def committed_steps(self) -> set[int]:
        """Committed steps, without asking the remote tier."""
        ...

    def issue(self, step: int, state: Mapping[str, Any], *, eager: bool | None = None) -> SaveJob:
        """A save, as save() makes it (raises what save() raises)."""
        ...


class Preemption:
    """One manager's handling of preemption signals; see the module docstring. `saves` is the
    manager's save path; `store` the training thread's connection to the job's store (several
    ranks), or None."""

    def __init__(self, saves: SavePath, state: Mapping[str, Any], options: PreemptionOptions, *, rank: int = 0,
                 world_size: int = 1, store: Store | None = None) -> None:
        self.saves = saves
        self.rank, self.world_size = rank, world_size
        self.state = state
        self.options = options
        self.signum: int | None = None
        self.deadline: float | None = None  # monotonic
        self.handled = False
        self.saved: int | None = None  # the step the emergency save saved (or found committed)
        self.went_on = False  # the handler installed before returned: training goes on, close() waits as usual
        self._acting = False
        self._stop: int | None = None  # the agreed step (several ranks)
        self._previous: dict[int, Any] = {}
        self._signalled = threading.Event()
        self._disarmed = threading.Event()
        self._store = store
        self._watchdog = threading.Thread(target=self._watch, name="ckpt-preempt", daemon=True)

    # ------------------------------------------------------------------ installation (main thread)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError("handle_preemption() must be called from the main thread (Python delivers signals there)")
        for sig in self.options.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        _INSTALLED.add(self)  # a forked child gets the previous handlers back (its watchdog is the parent's)
        self._watchdog.start()

    def uninstall(self) -> None:
        """Put the previous handlers back (main thread only; elsewhere they stay: harmless, they only set a flag)."""
        if threading.current_thread() is threading.main_thread():
            for sig, prev in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous_kept = dict(self._previous)
        self._previous.clear()

    def stop(self) -> None:
        """The manager closes: uninstall, and let the watchdog go unless a signal is being handled."""
        self.uninstall()
        if self.signum is None:
            self._disarmed.set()
            self._signalled.set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            return  # a second delivery (a launcher forwarding what the process group already got): still handling
        self.signum = signum
        self.deadline = time.monotonic() + self.options.grace_s
        self._signalled.set()

    @property
    def requested(self) -> bool:
        """A stop was requested: by a signal to this process, or (several ranks) by another rank."""
        return self.signum is not None or self._stop is not None

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    # ------------------------------------------------------------------ safe points (training thread)

    def check(self, step: int | None) -> None:
        """At a safe point: the state is that after step `step` (None: no step ended in this process)."""
        if self.handled or self._acting:
            return
        if self._store is None:
            if self.signum is None:
                return
            return self._act(step)
        stop = self._agree(step)
        if stop is None or step is None or step < stop:
            return
        if step > stop:
            log.error("checkpointing: rank %d is at step %d, past the step %d the ranks agreed to stop at; exiting without "
                      "a new save (the ranks do not step in lockstep)", self.rank, step, stop)
            return self._exit(None)
        self._act(step)

    def at_optimizer_step(self) -> None:
        """The optimizer pre-hook of a loop that marks no step: finish the in-flight save and exit."""
        if self.handled or self._acting:
            return
        if self.signum is None and (self._store is None or self._stop is None and not self._poll()):
            return
        if self._store is not None and self.signum is not None:
            self._store.compare_set(STOP_KEY, "", "-1")  # the other ranks stop too (nothing new is saved)
        self._acting = True
        job = self.saves.current
        log.warning("checkpointing: preempted; this loop marks no step (call mgr.should_save(step) or mgr.step(step) in it "
                    "for an emergency save of the latest state), so the in-flight save is finished and the newest committed "
                    "step is what the next start restores")
        if job is not None:
            self._wait_local(job)
        self._exit(None)

    def _agree(self, step: int | None) -> int | None:
        if self._stop is not None:
            return self._stop
        assert self._store is not None
        if self._poll():
            self._stop = int(self._store.get(STOP_KEY))
        elif self.signum is not None and step is not None:
            self._stop = int(self._store.compare_set(STOP_KEY, "", str(step + 1)))
            log.warning("checkpointing: rank %d preempted (%s) at step %d: the ranks stop after step %d",
                        self.rank, signal.Signals(self.signum).name, step, self._stop)
        if self._stop is not None and self.deadline is None:  # learnt from another rank: its grace applies here too
            self.deadline = time.monotonic() + self.options.grace_s
            self.signum = self.signum or signal.SIGTERM
            self._signalled.set()
        return self._stop

    def at_close(self, step: int | None) -> None:
        """close() while a signal is pending (the loop ended between safe points): the emergency
        save without exiting (one rank only: several ranks would not agree on a step here)."""
        if self.signum is not None and not self.handled and not self._acting and self._store is None:
            self._act(step, exit=False)

    def _act(self, step: int | None, exit: bool = True) -> None:
        """Save `step` (or finish its save), wait for the local commit, meet the other ranks, exit."""
        self._acting = True
        t0 = time.monotonic()
        name = signal.Signals(self.signum).name if self.signum else "a stop request"
        if step is None:
            log.warning("checkpointing: preempted (%s) before any step ended: nothing newer than the committed steps to save", name)
        else:
            job = self.saves.current
            writing = job is not None and not job.outcome.done.is_set()
            if job is not None and job.step == step:
                if writing:
                    log.warning("checkpointing: preempted (%s): finishing the in-flight save of step %d", name, step)
            elif step in self.saves.committed_steps():
                job = None
            else:
                if writing:
                    log.warning("checkpointing: preempted (%s): finishing the in-flight save of step %d first", name, job.step)
                log.warning("checkpointing: preempted (%s): emergency save of step %d (%.1f s of the %.0f s grace left)",
                            name, step, self.remaining() or 0.0, self.options.grace_s)
                job = self._save(step)
            if job is not None:
                self._wait_local(job)
                if job.outcome.error is None:
                    log.warning("checkpointing: step %d committed on the local tier %.2f s after the safe point; exiting",
                                step, time.monotonic() - t0)
            self.saved = step
        self._barrier()
        if exit:
            self._exit(step)
        else:
            self.handled = True

    def _save(self, step: int) -> SaveJob | None:
        for attempt in (1, 2):
            try:
                return self.saves.issue(step, self.state, eager=True)
            except CheckpointError as exc:  # the first may be an earlier save's error, raised once
                log.error("checkpointing: emergency save of step %d: %s", step, exc)
                current = self.saves.current
                if attempt == 2 or current is None or current.step == step:
                    return None
        return None

    def _wait_local(self, job: SaveJob) -> None:
        outcome = job.outcome
        if not outcome.wait(self.remaining()):
            log.error("checkpointing: step %d is not committed locally within the grace period", job.step)
        elif outcome.error is not None:
            log.error("checkpointing: the save of step %d failed: %s; the newest committed step is intact", job.step, outcome.error)
            outcome.error_reported = True

    def _barrier(self) -> None:
        """Every rank is done; then rank 0 (which may host the store) leaves last."""
        if self._store is None:
            return
        end = time.monotonic() + max(0.0, (self.remaining() or 0.0) - 1.0)
        try:
            self._store.set(keys.preempt_done(self.rank), b"1")
            if not wait_set(self._store, [keys.preempt_done(r) for r in range(self.world_size)], end):
                log.error("checkpointing: not every rank finished the emergency save within the grace period; exiting")
                return
            self._store.set(keys.preempt_left(self.rank), b"1")
            if self.rank == 0:
                wait_set(self._store, [keys.preempt_left(r) for r in range(self.world_size)], end)
        except Exception as exc:  # noqa: BLE001 - the store is gone (its host exited): nothing left to wait for
            log.warning("checkpointing: rank %d: the store went away during the exit barrier (%s)", self.rank, type(exc).__name__)

    def _poll(self) -> bool:
        """Whether another rank asked to stop (one store round trip); a lost store reads as no."""
        assert self._store is not None
        try:
            return bool(self._store.check([STOP_KEY]))
        except Exception as exc:  # noqa: BLE001 - never break the training loop over a status poll
            if not getattr(self, "_poll_failed", False):
                self._poll_failed = True
                log.warning("checkpointing: rank %d cannot reach the store to check for preemption: %s", self.rank, exc)
            return False

    def _exit(self, step: int | None) -> None:
        self.handled = True
        signum = self.signum or signal.SIGTERM
        prev = self._previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if prev is signal.SIG_IGN:
            self._disarmed.set()
            self.went_on = True
            return
        if callable(prev) and prev is not signal.SIG_DFL:
            self._disarmed.set()
            self.went_on = True
            prev(signum, None)
            return
        if threading.current_thread() is threading.main_thread():  # a launcher's forwarded copy must not kill the teardown
            signal.signal(signum, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    # ------------------------------------------------------------------ watchdog

    def _watch(self) -> None:
        self._signalled.wait()
        if self._disarmed.is_set():
            return
        while self.deadline is None:  # (set with signum; a stop() woke us)
            if self._disarmed.wait(0.05):
                return
        if self._disarmed.wait(max(0.0, self.deadline - time.monotonic())):
            return
        signum = self.signum or signal.SIGTERM
        log.error("checkpointing: the %.0f s grace period after %s ran out; exiting now with status %d (the newest committed "
                  "step is intact; anything not committed is invisible)", self.options.grace_s, signal.Signals(signum).name, 128 + signum)
        for handler in logging.getLogger().handlers + log.handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        os._exit(128 + signum)


_INSTALLED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the handlers installed in this process


def _in_child() -> None:
    """A child forked from this process (a DataLoader worker, multiprocessing's fork): the handlers only set a flag that
    the parent's watchdog acts on, and that thread is not here: the signals get their previous handlers back."""
    for handler in list(_INSTALLED):
        handler.uninstall()
    _INSTALLED.clear()


os.register_at_fork(after_in_child=_in_child)
