"""SaveHandle: what save() returns, a save in flight as the user sees it (orchestration).

The handle holds its job (save/job.py) and the one thing it needs from around it: `stall`, where
the time wait_staged() blocks the training thread is accounted (SaveAccounting.stall).

It is also a future as the ecosystem expects: a `concurrent.futures.Future` (what DCP's async_save
returns) with `result(timeout)`, `exception(timeout)`, `done()`, `add_done_callback(fn)`, and
`cancel()` (a save cannot be cancelled: False), that `concurrent.futures.wait`/`as_completed` and
`asyncio.wrap_future` accept. `result()`/`exception()` give the save's error every time they are
called; it then counts as reported, so the next save() or wait() does not raise it again. The
Future's own state (what those functions watch) is set by the thread that finishes the save
(hooks on its events, job.Signal; a thread of its own only to wait for peer copies); callbacks
added before then run on a thread of their own, never on the checkpoint's threads.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Protocol

from checkpointing.errors import CheckpointSaveError, CheckpointTimeoutError
from checkpointing.observe.metrics import SaveStats
from checkpointing.save.job import SaveJob, Stall

log = logging.getLogger("checkpointing")


class Copies(Protocol):
    """The save's copies on other nodes (peer_copies: checkpointing/peer/types.PeerJob): `done` once
    they are committed or failed, then `error`, raised once."""

    done: threading.Event
    error: BaseException | None
    error_reported: bool

    def raise_error(self) -> None: ...


class SaveHandle(concurrent.futures.Future):
    """A save in flight. `wait()` returns its SaveStats once committed, or raises its error.
    `peer`: its peer copies (None without peer_copies), which wait() waits for too."""

    def __init__(self, job: SaveJob, *, stall: Stall, peer: Copies | None = None) -> None:
        super().__init__()
        self._job = job
        self._stall = stall
        self.step = job.step
        self.peer = peer
        super().set_running_or_notify_cancel()
        self._settle_lock = threading.Lock()
        self._settled = False
        self._callbacks: list[Callable[["SaveHandle"], object]] = []
        self._peer_watch: threading.Thread | None = None
        job.outcome.done.when_set(self._settle)
        if job.upload is not None:
            job.upload.done.when_set(self._settle)

    def done(self) -> bool:
        """Durable on every configured tier (or failed)."""
        upload = self._job.upload
        return (self._job.outcome.done.is_set() and (upload is None or upload.done.is_set())
                and (self.peer is None or self.peer.done.is_set()))

    def local_done(self) -> bool:
        """Committed on the local tier (or failed); with a remote tier the upload may still run."""
        return self._job.outcome.done.is_set()

    def wait_staged(self) -> None:
        """Block until the snapshot no longer reads live tensors (then they may be mutated)."""
        self._job.wait_staged(self._stall)

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the step is durable on every configured tier; return its SaveStats or raise its error (each call,
        as result(): a Future's exception() or a done callback before it does not use the error up)."""
        self._wait_done(timeout)
        error = self._failure()
        if error is not None:
            raise error
        return self._job_stats()

    def result(self, timeout: float | None = None) -> SaveStats:
        """The SaveStats once durable on every configured tier; the save's error (each call) if it failed;
        CheckpointTimeoutError (a TimeoutError) if neither happened within `timeout` seconds."""
        self._wait_done(timeout)
        error = self._failure()
        if error is not None:
            raise error
        return self._job_stats()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error once it finished (None if it succeeded); CheckpointTimeoutError as result()."""
        self._wait_done(timeout)
        return self._failure()

    def add_done_callback(self, fn: Callable[["SaveHandle"], object]) -> None:
        """Call `fn(handle)` once the save is durable on every tier or failed: at once (on this thread)
        if it is already, else on a thread of its own. An exception from `fn` is logged, not raised.
        Registering a callback does not hurry a save whose threads yield (a wait does)."""
        if not self.done():
            with self._settle_lock:
                if not self._settled:
                    self._callbacks.append(fn)
                    return
        self._call(fn)

    def cancel(self) -> bool:
        """A save cannot be cancelled once issued: always False (as a running Future)."""
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return not self.done()

    def _wait_done(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._job.outcome.wait(timeout):
            raise CheckpointTimeoutError(f"step {self.step} is not durable after {timeout} s; call wait() again or raise the timeout")
        upload = self._job.upload
        if upload is not None and not self._job.outcome.error:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not upload.wait(left):
                raise CheckpointTimeoutError(f"step {self.step} is committed locally but not yet on the remote tier after "
                                             f"{timeout} s; call wait() again or raise the timeout")
        if self.peer is not None and not self._job.outcome.error:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.peer.done.wait(left):
                raise CheckpointTimeoutError(f"step {self.step} is committed locally but not yet on its peers after {timeout} s; "
                                             "call wait() again or raise the timeout")

    def _failure(self) -> BaseException | None:
        """The finished save's error (or its upload's), marked reported; None when it succeeded."""
        outcome, upload = self._job.outcome, self._job.upload
        if outcome.error is not None:
            outcome.error_reported = True
            if isinstance(outcome.error, CheckpointSaveError):
                return outcome.error
            error = CheckpointSaveError(self.step, outcome.error)
            error.__cause__ = outcome.error
            return error
        if upload is not None and upload.error is not None:
            upload.error_reported = True
            return upload.error
        if self.peer is not None and self.peer.error is not None:
            self.peer.error_reported = True
            return self.peer.error
        return None

    def _settle(self) -> None:
        """A hook of the save's events: once the save is durable everywhere or failed, set the Future's state."""
        outcome, upload = self._job.outcome, self._job.upload
        if not outcome.done.is_set() or (not outcome.error and upload is not None and not upload.done.is_set()):
            return
        if not outcome.error and self.peer is not None and not self.peer.done.is_set():
            with self._settle_lock:  # peer copies' event has no hooks: a thread waits for it
                start, self._peer_watch = self._peer_watch is None, self._peer_watch or threading.Thread(
                    target=lambda: (self.peer.done.wait(), self._settle()), name=f"ckpt-handle-{self.step}", daemon=True)  # type: ignore[union-attr]
            if start:
                self._peer_watch.start()
            return
        with self._settle_lock:
            if self._settled:
                return
            self._settled = True
            callbacks, self._callbacks = self._callbacks, []
        error = outcome.error or (upload.error if upload is not None else None) or (self.peer.error if self.peer else None)
        if error is not None:  # not marked reported: the user has not seen it through this state
            super().set_exception(error)
        else:
            super().set_result(outcome.stats)
        if callbacks:  # user code: never on the thread that finished the save
            threading.Thread(target=lambda: [self._call(fn) for fn in callbacks], name=f"ckpt-callback-{self.step}",
                             daemon=True).start()

    def set_result(self, result: object) -> None:
        raise RuntimeError("a SaveHandle finishes with its save; set_result() is not for callers")

    def set_exception(self, exception: BaseException | None) -> None:
        raise RuntimeError("a SaveHandle finishes with its save; set_exception() is not for callers")

    def _call(self, fn: Callable[["SaveHandle"], object]) -> None:
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - a user callback must not kill our thread or the caller's save
            log.exception("checkpointing: a done callback of the save of step %d raised", self.step)

    def _job_stats(self) -> SaveStats:
        assert self._job.outcome.stats is not None
        return self._job.outcome.stats

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"
