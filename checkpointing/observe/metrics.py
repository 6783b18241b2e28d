"""Per-save records: a frozen SaveStats, JSON lines beside the checkpoints, one log line, and the
sink that writes them and hands them to the user's callback (observe: the save path, save/records.py,
makes each SaveStats from its job).

A save's record is complete once its step-time cost is final (steptime.py: after the steps that
ran during its background work). Until then `mgr.stats()` and `handle.wait()` show it without the
step fields; `metrics.jsonl` and `on_metrics` get it once, complete (see SaveAccounting), and once more
for each later try of its upload when that failed (SaveStats.upload_tries).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import queue
import stat
import threading
from typing import Any, BinaryIO, Callable, Iterator

log = logging.getLogger("checkpointing")


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What one save cost. Times in seconds, sizes in bytes.

    wait_prev_s: save() waited for the previous save to finish writing (and for what the ckpt-io thread
        does after it: retention, re-verification).
    stall_s: the training thread was blocked by this save (inside save(), after wait_prev_s, plus
        guard_wait_s); the loop's total blocked time is wait_prev_s + stall_s.
    guard_wait_s: the part of stall_s spent in the guard before the next optimizer.step().
    snapshot_s: save() entry to the last byte staged. write_s: staged to pack data durable.
    commit_s: manifest + commit marker durable (with several ranks: reporting to rank 0, its merge,
        and every local tier's commit). total_s: save() entry to committed on the local tier.
    bytes_total: the state's bytes. bytes_written: this rank's new pack file (changed chunks, plus
        page padding). bytes_reused: chunks an incremental save took from earlier steps instead of
        writing them (chunks_reused of chunks_total). bytes_upload_reused: with a remote tier, bytes
        this rank's upload found there already (earlier steps' files, or a resumed upload's).
        bytes_unwritten: of the state, the bytes staging neither compared nor copied because the
        kernel saw no write to their pages since the previous save (change_detection="auto").
        bytes_deferred: of the state, the bytes copied after save() returned, overlapping the next
        forward/backward (parameters and optimizer state, passed as objects or as state_dict()s of
        optimizers the guard has seen step); the rest was copied inside save().
    bytes_reverified, chunks_reverified: borrowed chunks read back and digested on the ckpt-io
        thread between the previous save's commit and this save (reverify_every, docs/design.md
        "Incremental saves"); chunks_damaged: of those, the ones that did not match their digest
        (or could not be read): this save wrote them anew instead of borrowing them.
    yielded_s: seconds between the snapshot and the local commit during which the save's background
        threads ran at the lowest CPU priority, giving the cores to the training loop
        (background_yield_s); None when they did not yield (the option off, or not allowed here).
    tier: where the step is durable: "local", or "local+remote" once uploaded.
    upload_s, bytes_uploaded, upload_bytes_per_s (None without a remote tier): local commit to
        committed on the remote tier (every rank's data up, then rank 0's manifest and COMMIT); the
        bytes this rank uploaded, and their rate over this rank's own transfer time.
    upload_tries (None without a remote tier): the try of the upload this record reports (1: the
        upload that followed the save). Each later try of a failed upload (a later save's, or a resumed
        one in the next process: save/uploader.py) gives its save another record: the same step, rank
        and time, that try's upload fields and upload_tries, and, when it succeeded, ok=True,
        tier="local+remote"; the one with the highest upload_tries replaces the others
        (observe/summary.py `current`).
    ok: durable on every configured tier; a step whose upload failed has ok=False, tier="local"
        and the upload error in `error` (it is committed locally). committed: the step is committed
        on the local tier (True also when only its upload or peer copy failed).

    Step accounting (None until the save's cost is final, and without marked steps; see
    checkpointing/steptime.py for the definitions):
    step_stall_s: the training thread was blocked by this save inside its step (wait_prev_s +
        stall_s). slowdown_s: extra time of the steps that ran while its background work did,
        against step_time_s (the median step time with no save in flight). cost_s: step_stall_s +
        slowdown_s. overhead_pct: cost_s as a percentage of the training time since the previous save.
    time_to_first_durable_s: on the run's first successful save only: seconds from the manager's
        creation to this save being durable on every configured tier.
    recovered: the record of a save whose process was killed before writing it (after its local
        commit), written by the next manager on the directory from the step's manifest: its times
        in the saving process (stall_s ... total_s) and staging_bytes are unknown (None); with a
        remote tier, upload_s and the upload's bytes are the resumed upload's.
    """

    step: int
    ok: bool
    error: str | None
    wait_prev_s: float
    stall_s: float
    guard_wait_s: float
    snapshot_s: float
    write_s: float
    commit_s: float
    total_s: float
    bytes_total: int
    bytes_written: int
    bytes_reused: int
    write_bytes_per_s: float
    staging_bytes: int
    tier: str = "local"
    time: float = 0.0  # wall-clock time.time() when the save was requested
    rank: int = 0  # of the process group; ranks sharing a directory append to one metrics.jsonl
    world_size: int = 1
    upload_s: float | None = None
    bytes_uploaded: int | None = None
    upload_bytes_per_s: float | None = None
    step_stall_s: float | None = None
    slowdown_s: float | None = None
    cost_s: float | None = None
    overhead_pct: float | None = None
    step_time_s: float | None = None
    time_to_first_durable_s: float | None = None
    chunks_total: int = 0
    chunks_reused: int = 0
    bytes_upload_reused: int | None = None
    bytes_unwritten: int = 0
    bytes_reverified: int = 0
    chunks_reverified: int = 0
    chunks_damaged: int = 0
    bytes_deferred: int = 0
    yielded_s: float | None = None
    committed: bool = False
    recovered: bool = False
    upload_tries: int | None = None

    def __getitem__(self, name: str) -> Any:
        if name not in _FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def keys(self) -> Iterator[str]:
        return iter(_FIELDS)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = tuple(f.name for f in dataclasses.fields(SaveStats))


MAX_METRICS_BYTES = 256 << 20  # a metrics file copied to or read from a remote tier at most


def append_jsonl(path: os.PathLike | str, stats: SaveStats | dict[str, Any]) -> None:
    """Append one record as a JSON line (one write: lines of ranks sharing the file do not interleave)."""
    record = stats.as_dict() if isinstance(stats, SaveStats) else stats
    line = json.dumps(record, sort_keys=True) + "\n"
    try:  # never through a link, never blocking on a FIFO: the checkpoint directory may hold anything
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP and not os.path.islink(path):
            raise
        log.warning("checkpointing: %s is a symbolic link: metrics line not written (never written through a link)", path)
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            log.warning("checkpointing: %s is not a regular file: metrics line not written", path)
            return
        if st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":  # a line torn by a crash: ours starts a new one
            line = "\n" + line
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def last_recorded_step(path: os.PathLike | str, rank: int, *, tail_bytes: int = 1 << 18) -> int | None:
    """The step of the last record `rank` appended to the metrics file at `path` (None: no record of it),
    from the file's last `tail_bytes` (all of it when they hold no record of that rank)."""
    f = _open_regular(path)
    if f is None:  # a directory, a FIFO: nothing recorded (log_save says it writes no line)
        return None
    with f:
        size = os.fstat(f.fileno()).st_size
        for start in dict.fromkeys((max(0, size - tail_bytes), 0)):
            for line in reversed(_lines_from(f, start)):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("rank", 0) == rank and isinstance(rec.get("step"), int):
                    return rec["step"]
    return None


def failed_uploads(path: os.PathLike | str, rank: int, steps: set[int], *, tail_bytes: int = 1 << 20) -> dict[int, tuple[dict[str, Any], int]]:
    """Of `steps`, those whose last record by `rank` in the metrics file's last `tail_bytes` says the step was
    committed and its upload failed: step -> (that record, its upload_tries)."""
    f = _open_regular(path)
    if f is None:
        return {}
    with f:
        last: dict[int, dict[str, Any]] = {}
        for rec in parse_jsonl(b"\n".join(_lines_from(f, max(0, os.fstat(f.fileno()).st_size - tail_bytes)))):
            if isinstance(rec, dict) and rec.get("rank", 0) == rank and rec.get("step") in steps:
                last[rec["step"]] = rec
    out = {}
    for step, rec in last.items():
        if rec.get("ok") is False and rec.get("committed") is True and rec.get("upload_s") is not None:
            tries = rec.get("upload_tries")
            out[step] = (rec, tries if isinstance(tries, int) and not isinstance(tries, bool) and tries > 0 else 1)
    return out


def _lines_from(f: BinaryIO, start: int) -> list[bytes]:
    """The lines of `f` from byte `start` on; past 0, without the first (a tail's first line may be cut)."""
    f.seek(start)
    return f.read().splitlines()[1 if start else 0:]


def read_jsonl(path: os.PathLike | str) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            return parse_jsonl(f.read())
    except FileNotFoundError:
        return []


def parse_jsonl(data: bytes) -> list[Any]:
    """The JSON value of each line (a line torn by a crash, or not JSON, is skipped)."""
    out = []
    for line in data.splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def metrics_bytes(path: os.PathLike | str) -> bytes | None:
    """The metrics file's bytes (None: none there, a link, not a regular file, or over MAX_METRICS_BYTES)."""
    f = _open_regular(path)
    if f is None:
        return None
    with f:
        return f.read() if os.fstat(f.fileno()).st_size <= MAX_METRICS_BYTES else None


def _open_regular(path: os.PathLike | str) -> BinaryIO | None:
    """`path` opened for reading when it is a regular file (not through a link, never blocking on a FIFO);
    else None (os.fdopen() of a directory would raise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def log_save(stats: SaveStats, where: str) -> None:
    mb = stats.bytes_written / 1e6
    if stats.ok:
        log.info(
            "checkpointing: step %d committed in %.3f s (stall %.1f ms, wait_prev %.1f ms, %.1f MB at %.2f GB/s%s) -> %s",
            stats.step, stats.total_s, stats.stall_s * 1e3, stats.wait_prev_s * 1e3, mb, stats.write_bytes_per_s / 1e9,
            f", {stats.bytes_reused / 1e6:.1f} MB reused" if stats.bytes_reused else "", where,
        )
    elif stats.upload_s is not None and stats.tier == "local":
        log.error("checkpointing: step %d committed locally, its upload failed after %.3f s: %s", stats.step, stats.upload_s, stats.error)
    else:
        log.error("checkpointing: step %d failed after %.3f s: %s", stats.step, stats.total_s, stats.error)
    if stats.ok and stats.upload_s is not None:
        log.info(
            "checkpointing: step %d durable on the remote tier %.3f s after its local commit (%.1f MB from this rank at %.1f MB/s)",
            stats.step, stats.upload_s, (stats.bytes_uploaded or 0) / 1e6, (stats.upload_bytes_per_s or 0) / 1e6,
        )


class MetricsSink:
    """Where finished records go: `metrics.jsonl`, then the user's `on_metrics` callback.

    `emit(record, now=True)` appends the line on the calling (background) thread; `now=False`
    (from the training thread) leaves the append to the sink's writer thread ("ckpt-metrics-write",
    started at the first such record), which appends nothing else. The callback always runs on the
    sink's callback thread ("ckpt-metrics": started here when there is a callback, so that it never
    inherits the CPU priority of a yielding background thread, save/yielding.py), in the order records
    were emitted, so a slow callback (a network logger) delays neither training, nor saving, nor the
    lines in the file (a process killed while callbacks queue up has written every record that was
    final). An exception in the callback is logged (the first with its traceback) and never reaches a
    save. `close()` writes and delivers what is queued, then stops the threads.
    """

    def __init__(self, path: os.PathLike | str, callback: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.path = path
        self.callback = callback
        self.callback_errors = 0
        self.append_errors = 0  # the first failed append is a warning, the later ones debug lines
        self._lines: _Worker = _Worker("ckpt-metrics-write", self._append)
        self._calls: _Worker = _Worker("ckpt-metrics", self._call)
        if callback is not None:
            self._calls.start()

    def emit(self, record: dict[str, Any], *, now: bool) -> None:
        if now:
            self._append(record)
        else:
            self._lines.put(record)
        if self.callback is not None:
            self._calls.put(record)

    def close(self) -> None:
        self._lines.close()
        self._calls.close()
        if self.callback_errors > 1:
            log.warning("checkpointing: the on_metrics callback raised %d times in all", self.callback_errors)

    def _call(self, record: dict[str, Any]) -> None:
        assert self.callback is not None
        try:
            self.callback(dict(record))
        except Exception:  # noqa: BLE001 - the user's code: log it, keep saving
            self.callback_errors += 1
            if self.callback_errors == 1:
                log.warning("checkpointing: the on_metrics callback raised (logged once; saving goes on)", exc_info=True)

    def _append(self, record: dict[str, Any]) -> None:
        try:
            append_jsonl(self.path, record)
        except OSError as exc:
            self.append_errors += 1
            log.log(logging.WARNING if self.append_errors == 1 else logging.DEBUG, "checkpointing: could not append metrics to %s: %s "
                    "(the saves go on without their metrics lines; said once)", self.path, exc)


class _Worker:
    """A daemon thread named `name` calling `handle(record)` for each record put, in order; started at the first
    put() (or start()); close() lets it finish what is queued, then joins it."""

    def __init__(self, name: str, handle: Callable[[dict[str, Any]], None]) -> None:
        self._name, self._handle = name, handle
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def put(self, record: dict[str, Any]) -> None:
        self.start()
        self._queue.put(record)

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _loop(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                self._handle(record)
            except Exception:  # noqa: BLE001 - a bug here must not stop the later records
                log.exception("checkpointing: %s: unexpected error (the thread goes on with the next record)", self._name)
