"""How large transfers run on a remote tier: part size, parallelism, pacing (layer: storage, I/O).

Transfers is the one object FsspecStorage hands to everything that moves large objects (upload.py's
multipart uploads and streams, remote.py's parallel ranged reads): parts of `part_bytes`, at most
`max_concurrency` at a time on one thread pool, paced by a Throttle to `max_bytes_per_s`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from checkpointing.errors import CheckpointConfigError
from checkpointing.storage.ioloop import ThreadHooks

S3_MIN_PART = 5 << 20  # every part but the last must be at least this big


class Transfers:
    """How large objects move: parts of `part_bytes`, at most `max_concurrency` at a time on one
    thread pool (started with the first part, stopped by close()), paced to `max_bytes_per_s` if set.
    The sizes are checked here, for the tier `url` (S3 parts are at least 5 MiB). `hooks` run on
    each pool thread as it starts (storage/ioloop.py)."""

    def __init__(self, url: str, *, is_s3: bool, part_bytes: int, max_concurrency: int, max_bytes_per_s: float | None) -> None:
        if max_concurrency < 1:
            raise CheckpointConfigError(f"max_concurrency={max_concurrency} for {url}: must be >= 1")
        minimum = S3_MIN_PART if is_s3 else 1
        if part_bytes < minimum:
            raise CheckpointConfigError(f"part_bytes={part_bytes} for {url}: must be >= {minimum} (S3 parts are at least 5 MiB)")
        if max_bytes_per_s is not None and max_bytes_per_s <= 0:
            raise CheckpointConfigError(f"max_bytes_per_s={max_bytes_per_s} for {url}: must be > 0, or None for no limit")
        self.part_bytes, self.max_concurrency = part_bytes, max_concurrency
        self.pace: Callable[[int], None] = Throttle(max_bytes_per_s) if max_bytes_per_s else _no_pace
        self.hooks = ThreadHooks()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="ckpt-upload", initializer=self.hooks.run)
            return self._pool

    def close(self) -> None:
        """Stop the threads (after the transfers they run); a later transfer starts them again."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _no_pace(nbytes: int) -> None:
    return None


class Throttle:
    """Paces transfers to `rate` bytes/s across threads: each reserves its share of time, then waits its turn."""

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)
        self.lock = threading.Lock()
        self.next = time.monotonic()

    def __call__(self, nbytes: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next)
            self.next = start + nbytes / self.rate
        if start > now:
            time.sleep(start - now)
