"""An event loop of the remote tier's own, on a thread we name, and hooks for every thread doing its I/O (layer: storage, I/O).

An async fsspec filesystem (s3fs) runs every request on an asyncio event loop; by default fsspec's
one loop thread (`fsspecIO`) serves every async filesystem in the process, the user's included, and
that thread does most of an upload's CPU work (signing, checksums, copies into the HTTP stack:
docs/benchmarks.md, "What an upload costs this process's CPU"). A storage opened with `own_loop`
(the manager's remote tier) gets an IoLoop instead: its own loop on a daemon thread
(`ckpt-remote-io`), whose default executor's threads are named after it. The loop lives as long as
the IoLoop (it stops when the IoLoop is garbage collected, or at close()); the aiohttp session s3fs
binds to it stays valid for the storage's whole life.

ThreadHooks are callables run on each thread that does a storage's I/O: the loop's thread (when a
hook is added) and every thread a pool starts afterwards (the pool's initializer). The save layer
uses them to let those threads follow its CPU priority (save/yielding.py); this layer knows nothing
about priorities.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

log = logging.getLogger("checkpointing")


class ThreadHooks:
    """Callables to run on each new I/O thread (`run` is a thread pool's initializer). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []

    def add(self, hook: Callable[[], None]) -> None:
        with self._lock:
            self._hooks.append(hook)

    def run(self) -> None:
        """Run every hook on the calling thread; a failing hook is logged, never fatal to the thread."""
        with self._lock:
            hooks = list(self._hooks)
        for hook in hooks:
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - a pool thread must start whatever a hook does
                log.debug("checkpointing: a thread hook failed: %s", exc)


class IoLoop:
    """An asyncio event loop running on a daemon thread named `name` (see the module)."""

    def __init__(self, name: str = "ckpt-remote-io") -> None:
        self.hooks = ThreadHooks()
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_quiet)
        self._name = name
        self._retired: list[ThreadPoolExecutor] = []  # executors replaced by on_thread(): shut down, joined at close
        self._executor = self._new_executor()
        self._closers: list[Callable[[], Awaitable[Any]]] = []
        ready = threading.Event()
        self.thread = threading.Thread(target=_serve, args=(self.loop, ready), name=name, daemon=True)
        self.thread.start()
        ready.wait()
        # the thread holds the loop, not this object: when the IoLoop goes, so do the thread and the loop
        self._finish = weakref.finalize(self, _finish, self.loop, self.thread, self._closers, self._retired)

    def _new_executor(self) -> ThreadPoolExecutor:
        executor = ThreadPoolExecutor(thread_name_prefix=f"{self._name}-pool", initializer=self.hooks.run)
        self.loop.set_default_executor(executor)
        return executor

    def on_thread(self, hook: Callable[[], None]) -> None:
        """Run `hook` on the loop's thread now (waiting for it), and on every thread of the loop's default executor
        from now on: the executor is replaced (threads it started before, e.g. for the first requests' DNS lookups,
        never ran the hook); the old one's threads end once their call returns."""
        self.hooks.add(hook)
        if threading.current_thread() is self.thread:
            self._hooked(hook)
            return
        asyncio.run_coroutine_threadsafe(_call(functools.partial(self._hooked, hook)), self.loop).result()

    def _hooked(self, hook: Callable[[], None]) -> None:
        """On the loop's thread: `hook` here, and a fresh default executor."""
        hook()
        old, self._executor = self._executor, self._new_executor()
        old.shutdown(wait=False)
        self._retired.append(old)

    def at_close(self, closer: Callable[[], Awaitable[Any]]) -> None:
        """Await `closer()` on the loop before it stops (what was opened on it: an HTTP session)."""
        self._closers.append(closer)

    def close(self) -> None:
        """Stop the loop and its thread, then close the loop (idempotent). Requests that still need
        the loop fail afterwards (fsspec: 'Loop is not running')."""
        self._finish()


def _serve(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(ready.set)
    loop.run_forever()


async def _call(hook: Callable[[], None]) -> None:
    hook()


async def _await(closer: Callable[[], Awaitable[Any]]) -> None:
    await closer()


def _finish(loop: asyncio.AbstractEventLoop, thread: threading.Thread, closers: list[Callable[[], Awaitable[Any]]],
            retired: list[ThreadPoolExecutor]) -> None:
    if loop.is_closed():
        return
    if thread is not threading.current_thread() and loop.is_running():
        for closer in closers:
            try:
                asyncio.run_coroutine_threadsafe(_await(closer), loop).result(timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - closing must go on
                log.debug("checkpointing: closing a session on the remote tier's loop failed: %s", exc)
        try:  # the pool's threads end now, not some time after close() returned (loop.close() does not wait)
            asyncio.run_coroutine_threadsafe(loop.shutdown_default_executor(), loop).result(timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - closing must go on
            log.debug("checkpointing: stopping the remote tier's I/O pool failed: %s", exc)
        for executor in retired:  # their threads end with the call they run, if any
            executor.shutdown(wait=True)
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # closed meanwhile
        return
    if thread is not threading.current_thread():
        thread.join(timeout=10.0)
        if not loop.is_running():
            loop.close()  # also shuts down the default executor (without waiting)


def _quiet(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A task of the HTTP client that failed with nobody awaiting it (a connection reset while an upload
    failed): the request that matters raised its error already, through the retry wrapper; only debug."""
    exc = context.get("exception")
    log.debug("checkpointing: remote I/O loop: %s%s", context.get("message", ""), f" ({type(exc).__name__}: {exc})" if exc else "")
