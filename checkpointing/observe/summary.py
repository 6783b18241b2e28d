"""What the saves of a run cost, summed up from their metrics records (layer: observe).

Input is a list of metrics records: dicts as ``SaveStats.as_dict()`` writes them to
``DIR/metrics.jsonl`` (:func:`load_records`, the one function here that reads a file), one per save,
written once the save's step cost is final. Optional fields that newer writers add (``upload_s``,
``upload_bytes_per_s``, ``tier``, ``step_stall_s``, ``slowdown_s``, ``cost_s``, ``overhead_pct``,
``step_time_s``, ``time_to_first_durable_s``; see :mod:`checkpointing.observe.steptime`) may be
missing; unknown fields are ignored and missing or non-numeric ones read as absent
(:func:`number`).

Outputs: a :class:`Summary` with percentiles and, given an MTBF, the Young/Daly interval
(:func:`summarize`), and the JSON document ``checkpointing report --json`` prints (:func:`to_json`).
Times are in seconds, sizes in bytes, throughputs in bytes per second. The tables and the plot
that show them are checkpointing/cli/report.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from checkpointing.errors import CheckpointConfigError
from checkpointing.format.naming import METRICS_NAME
from checkpointing.observe.metrics import read_jsonl
from checkpointing.plan import advice

__all__ = ["JSON_SCHEMA", "SAVE_KEYS", "Record", "Spread", "Summary", "by_save", "current", "load_records", "number", "recorded",
           "stands_in", "succeeded", "summarize", "to_json"]

Record = Mapping[str, Any]  # one metrics record: a JSON object, as SaveStats.as_dict() writes it

JSON_SCHEMA = "checkpointing.report/1"
SAME_SAVE_S = 60.0  # ranks call save() for one step this close in time; a later run's save of that step comes later
# every save row of to_json() has exactly these keys (null when the record lacks the field)
# (every field of SaveStats: the report is the records of mgr.stats(), field for field)
SAVE_KEYS = ("step", "rank", "world_size", "ok", "committed", "error", "time", "tier", "wait_prev_s", "stall_s", "guard_wait_s",
             "snapshot_s", "write_s", "commit_s", "upload_s", "total_s", "bytes_total", "bytes_written", "bytes_reused",
             "bytes_unwritten", "bytes_deferred", "chunks_total", "chunks_reused", "bytes_reverified", "chunks_reverified",
             "chunks_damaged", "staging_bytes", "bytes_uploaded", "bytes_upload_reused", "write_bytes_per_s",
             "upload_bytes_per_s", "yielded_s", "step_stall_s", "slowdown_s", "cost_s", "overhead_pct", "step_time_s",
             "time_to_first_durable_s", "recovered", "upload_tries")
STEP_KEYS = ("step_stall_s", "slowdown_s", "cost_s", "overhead_pct", "step_time_s")  # known once a save's cost is final


def load_records(path_or_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Metrics records from a checkpoint directory (its ``metrics.jsonl``) or a JSON-lines file.

    Local paths and ``file://`` URLs only for now (the one place to add remote tiers). Raises
    :class:`CheckpointConfigError` when the path does not exist or names another scheme; a
    directory without metrics gives ``[]``. Lines that are not JSON objects are skipped.
    """
    text = os.fspath(path_or_dir)
    if "://" in text:
        scheme, rest = text.split("://", 1)
        if scheme != "file":
            raise CheckpointConfigError(f"{text}: reading metrics from {scheme}:// is not supported yet; "
                                        f"copy {METRICS_NAME} to a local directory and report on that")
        text = rest
    path = Path(text)
    if path.is_dir():
        path = path / METRICS_NAME
    elif not path.exists() and not path.is_symlink():
        raise CheckpointConfigError(f"{text}: no such checkpoint directory or metrics file")
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return []
    if not stat.S_ISREG(mode):  # a symlink (perhaps out of the directory), a FIFO, a device: never followed or opened
        raise CheckpointConfigError(f"{path} is not a regular file (a directory, symlink, FIFO or device): not read; "
                                    f"remove it (a save writes a new {METRICS_NAME})")
    return [r for r in read_jsonl(path) if isinstance(r, dict)]


def number(rec: Record, key: str) -> float | None:
    """The record's finite number at `key`; None when absent, not a number (or a bool), NaN or infinite."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def succeeded(rec: Record) -> bool:
    """The record's ``ok``; for records without one, whether it has no ``error``."""
    ok = rec.get("ok")
    return ok if isinstance(ok, bool) else rec.get("error") is None


def current(records: Sequence[Record]) -> list[Record]:
    """The records, each save's record on each rank once: each later try of a failed upload wrote another record of
    its save (the same step, rank, world size and time; ``upload_tries`` > 1); the one with the most tries replaces
    the others, in the first one's place. The step fields (STEP_KEYS) it lacks, it takes from the first (the
    two are written in either order when the retry ends while the save's cost is not final yet). A record a later
    process wrote for a save as `recovered` (from its manifest) is left out when the save's own record is there too
    (`stands_in`: two nodes' files merged, save/metrics_copy.py)."""
    records = [r for r in records if not stands_in(r, records)]
    latest: dict[tuple, Record] = {}
    for r in records:
        k = _retry_key(r)
        if k is not None and _tries(r) > 1 and (k not in latest or _tries(r) >= _tries(latest[k])):
            latest[k] = r
    if not latest:
        return list(records)
    out: list[Record] = []
    placed: dict[tuple, int] = {}
    for r in records:
        k = _retry_key(r)
        if k not in latest:
            out.append(r)
            continue
        if k not in placed:
            placed[k] = len(out)
            out.append(dict(latest[k]))
        into = out[placed[k]]
        for key in STEP_KEYS:
            if into.get(key) is None and r.get(key) is not None:
                into[key] = r[key]  # type: ignore[index]
    return out


def stands_in(rec: Record, among: Sequence[Record]) -> bool:
    """`rec` is a recovered record of a save whose own record is `among` the records: the same step, rank and world size,
    not recovered, made within SAME_SAVE_S of it (a recovered record's time is its COMMIT's)."""
    if rec.get("recovered") is not True or (t := number(rec, "time")) is None:
        return False
    key = (rec.get("step"), rec.get("rank", 0), rec.get("world_size"))
    return any(o.get("recovered") is not True and (o.get("step"), o.get("rank", 0), o.get("world_size")) == key
               and (u := number(o, "time")) is not None and abs(t - u) <= SAME_SAVE_S for o in among)


def _tries(rec: Record) -> int:
    t = rec.get("upload_tries")
    return t if isinstance(t, int) and not isinstance(t, bool) else 1


def _retry_key(rec: Record) -> tuple | None:
    """What one save's records on one rank share; None: a record that cannot be told apart from others'."""
    step, rank, t = rec.get("step"), rec.get("rank", 0), number(rec, "time")
    if not isinstance(step, int) or isinstance(step, bool) or t is None:
        return None
    return step, rank if isinstance(rank, int) else 0, rec.get("world_size") if isinstance(rec.get("world_size"), int) else None, t


def by_save(records: Sequence[Record]) -> list[list[Record]]:
    """The records grouped into saves, in the order the saves first appear, each save's records by rank.

    Ranks that share a directory append one record each per save, in the order they finish, so one
    save's records may interleave with the next one's. A record joins the save of its step (and world
    size) that lacks its rank and began nearest in `time`, within SAME_SAVE_S (without times: the
    oldest such save); else it begins a save: a step saved again by a later run is another save, and
    so is a save some rank wrote no record of (it failed inside save(), or was killed). A record
    without a rank is rank 0's; one without a step is a save of its own. A record a later one replaced (`current`)
    is left out."""
    return _group(current(records))


def _group(records: Sequence[Record]) -> list[list[Record]]:
    """by_save() of records `current` already folded."""
    groups: list[list[Record]] = []
    open_saves: dict[tuple, list[int]] = {}
    for r in records:
        step, rank, world = r.get("step"), r.get("rank"), r.get("world_size")
        if not isinstance(step, int) or isinstance(step, bool):
            groups.append([r])
            continue
        rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
        key, t = (step, world if isinstance(world, int) else None), number(r, "time")
        lacking = [g for g in open_saves.get(key, []) if all((x.get("rank") or 0) != rank for x in groups[g])]
        began = {g: number(groups[g][0], "time") for g in lacking}
        if t is not None and all(v is not None for v in began.values()):
            lacking = sorted((g for g in lacking if abs(t - began[g]) <= SAME_SAVE_S), key=lambda g: abs(t - began[g]))  # type: ignore[operator]
        if lacking:
            groups[lacking[0]].append(r)
        else:
            open_saves.setdefault(key, []).append(len(groups))
            groups.append([r])
    return [sorted(g, key=lambda r: number(r, "rank") or 0.0) for g in groups]


def _scalar(v: Any) -> Any:
    """A JSON scalar as is; anything else (lists, objects, NaN, infinities) as None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if v is None or isinstance(v, (bool, int, float, str)) else None


def recorded(records: Sequence[Record], key: str) -> bool:
    """Some record has a number at `key` (the report shows a column for it)."""
    return any(number(r, key) is not None for r in records)


def _save_cost(rec: Record) -> float | None:
    """stall (without waiting for the previous save: a symptom of the current interval, not a cost
    of a save at the advised one) + slowdown when recorded."""
    stall = number(rec, "stall_s")
    if stall is None and number(rec, "step_stall_s") is not None:
        stall = max(0.0, number(rec, "step_stall_s") - (number(rec, "wait_prev_s") or 0.0))  # type: ignore[operator]
    return None if stall is None else stall + (number(rec, "slowdown_s") or 0.0)


@dataclasses.dataclass(frozen=True)
class Spread:
    """Percentiles (linear interpolation between order statistics), max and mean of a sample."""

    p50: float
    p90: float
    p99: float
    max: float
    mean: float

    @staticmethod
    def of(values: Iterable[float]) -> "Spread | None":
        xs = sorted(values)
        if not xs:
            return None

        def pct(p: float) -> float:
            pos = p / 100 * (len(xs) - 1)
            lo = math.floor(pos)
            hi = min(lo + 1, len(xs) - 1)
            return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

        return Spread(pct(50), pct(90), pct(99), xs[-1], statistics.fmean(xs))


@dataclasses.dataclass(frozen=True)
class Summary:
    """Over successful saves (failed ones are only counted; the bytes and the cost also count saves
    committed locally whose upload failed). Spreads are None without data.
    saves, ok, failed count saves (:func:`by_save`: the records of a save's ranks are one save, ok
    when every rank's is); in the spreads each rank's record counts as one sample.

    stall_s, total_s: from SaveStats. step_stall_s, slowdown_s, overhead_pct: from step accounting,
    when recorded. cost_s: per save stall_s + slowdown_s (the C of checkpointing.advice).
    write/upload_bytes_per_s: mean of the per-save throughputs > 0. bytes_written, bytes_reused:
    sums. step_time_s: median recorded step time. time_to_first_durable_s: of the newest run that
    recorded one (manager created -> first save durable). advice: present when an MTBF was given.
    """

    saves: int
    ok: int
    failed: int
    stall_s: Spread | None
    total_s: Spread | None
    cost_s: Spread | None
    step_stall_s: Spread | None
    slowdown_s: Spread | None
    overhead_pct: Spread | None
    write_bytes_per_s: float | None
    upload_bytes_per_s: float | None
    bytes_written: int
    bytes_reused: int
    step_time_s: float | None
    time_to_first_durable_s: float | None
    advice: advice.IntervalAdvice | None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["advice"] = self.advice.as_dict() if self.advice is not None else None
        return d


def summarize(records: Sequence[Record], mtbf_s: float | None = None, restart_s: float = 0.0) -> Summary:
    """Summary of ``records``; with ``mtbf_s`` (seconds) also the recommended interval for a cost
    of the median per-save ``stall_s + slowdown_s``. Raises CheckpointConfigError for a bad MTBF."""
    records = current(records)
    good = [r for r in records if succeeded(r)]
    saves = _group(records)
    good_saves = sum(all(succeeded(r) for r in save) for save in saves)
    local = [r for r in records if succeeded(r) or r.get("committed") is True]  # an upload that failed: the loop paid all the same

    def col(key: str, among: Sequence[Record] = good) -> list[float]:
        return [v for v in (number(r, key) for r in among) if v is not None]

    def mean_pos(key: str) -> float | None:
        xs = [v for v in col(key) if v > 0]
        return statistics.fmean(xs) if xs else None

    costs = [c for c in (_save_cost(r) for r in local) if c is not None]
    step_times = col("step_time_s")
    step_time = statistics.median(step_times) if step_times else None
    ttfd = [v for v in (number(r, "time_to_first_durable_s") for r in records) if v is not None]
    rec_advice = None
    if mtbf_s is not None:
        if not costs:
            raise CheckpointConfigError("no successful save with a recorded stall: cannot estimate the checkpoint cost")
        rec_advice = advice.advise(statistics.median(costs), mtbf_s, step_time_s=step_time, restart_s=restart_s)
    return Summary(
        saves=len(saves), ok=good_saves, failed=len(saves) - good_saves,
        stall_s=Spread.of(col("stall_s")), total_s=Spread.of(col("total_s")), cost_s=Spread.of(costs),
        step_stall_s=Spread.of(col("step_stall_s")), slowdown_s=Spread.of(col("slowdown_s")),
        overhead_pct=Spread.of(col("overhead_pct")),
        write_bytes_per_s=mean_pos("write_bytes_per_s"), upload_bytes_per_s=mean_pos("upload_bytes_per_s"),
        bytes_written=int(sum(col("bytes_written", local))), bytes_reused=int(sum(col("bytes_reused", local))),
        step_time_s=step_time, time_to_first_durable_s=ttfd[-1] if ttfd else None, advice=rec_advice,
    )


def to_json(records: Sequence[Record], mtbf_s: float | None = None, *, source: str | None = None,
            plot_path: str | None = None) -> dict[str, Any]:
    """The report as a JSON-ready dict with stable keys.

    ``{"schema": "checkpointing.report/1", "source": str|null, "plot": str|null,
    "saves": [{k: value|null for k in SAVE_KEYS}], "summary": Summary.as_dict() without "advice",
    "advice": IntervalAdvice.as_dict()|null}``. "saves" has a row per record, ordered as :func:`by_save`. Spreads are ``{"p50","p90","p99","max","mean"}``
    or null; times in seconds, sizes in bytes, throughputs in bytes/s, ``overhead_pct`` in percent.
    """
    summary = summarize(records, mtbf_s).as_dict()
    adv = summary.pop("advice")
    saves = []
    for r in (r for save in by_save(records) for r in save):
        row: dict[str, Any] = {k: (number(r, k) if k.endswith(("_s", "_pct")) else _scalar(r.get(k))) for k in SAVE_KEYS}
        row["ok"] = succeeded(r)
        saves.append(row)
    return {"schema": JSON_SCHEMA, "source": source, "plot": plot_path, "saves": saves, "summary": summary, "advice": adv}
