"""The steps on their way to the remote tier, and the failed uploads waiting to be tried again (layer: save).

The uploader (save/uploader.py) adds and removes them; local retention never deletes a step listed here: until its
upload succeeds (or is given up), its local copy is its only one.
"""

from __future__ import annotations

import threading

from checkpointing.save.job import UploadJob

__all__ = ["PendingUploads"]


class PendingUploads:
    """The steps whose upload is queued or running, or failed and is to be tried again (thread-safe):
    the uploader adds and removes them; retention on either tier never deletes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[UploadJob] = []
        self.failed: dict[int, UploadJob] = {}  # step -> its failed upload, tried again with the next one

    def add(self, job: UploadJob) -> None:
        with self._lock:
            self._jobs.append(job)

    def remove(self, job: UploadJob) -> None:
        with self._lock:
            self._jobs.remove(job)

    def steps(self) -> set[int]:
        with self._lock:
            return {j.step for j in self._jobs} | set(self.failed)

    def fail(self, job: UploadJob) -> None:
        with self._lock:
            self.failed[job.step] = job

    def forget(self, step: int) -> None:
        """`step` was deleted: its failed upload is not tried again."""
        with self._lock:
            self.failed.pop(step, None)

    def retrying(self) -> bool:
        """A failed upload waits to be tried again, or is tried again now: its files may lie on the remote tier."""
        with self._lock:
            return bool(self.failed) or any(j.tries > 1 for j in self._jobs)

    def take_failed(self, through_seq: int | None = None) -> list[UploadJob]:
        """The failed uploads (those numbered up to `through_seq`), by step; they leave the list."""
        with self._lock:
            jobs = sorted((j for j in self.failed.values() if through_seq is None or j.seq <= through_seq), key=lambda j: j.step)
            for j in jobs:
                del self.failed[j.step]
            return jobs

    def through(self, seq: int) -> list[UploadJob]:
        """The uploads queued or running that are numbered up to `seq`."""
        with self._lock:
            return [j for j in self._jobs if j.seq <= seq]
