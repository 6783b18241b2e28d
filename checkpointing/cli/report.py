"""`checkpointing report DIR`: what saves cost, from the metrics records beside the checkpoints.

Input is a list of metrics records: dicts as ``SaveStats.as_dict()`` writes them to
``DIR/metrics.jsonl`` (:func:`load_records`), one per save, written once the save's step cost is
final. Optional fields that newer writers add (``upload_s``, ``upload_bytes_per_s``, ``tier``,
``step_stall_s``, ``slowdown_s``, ``cost_s``, ``overhead_pct``, ``step_time_s``,
``time_to_first_durable_s``; see :mod:`checkpointing.steptime`) get a column only when some record
has them; unknown fields are ignored and missing or non-numeric ones read as absent.

Outputs: a rich table of saves (:func:`saves_table`), a summary with percentiles and, given an
MTBF, the Young/Daly interval (:func:`summarize`, :func:`summary_table`), a JSON document
(:func:`to_json`) and a PNG (:func:`plot`, needs the ``checkpointing[plot]`` extra).
Times are in seconds, sizes in bytes, throughputs in bytes per second (shown as MB/s, 1 MB = 1e6 B).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from checkpointing.plan import advice
from checkpointing.errors import CheckpointConfigError
from checkpointing.format.naming import METRICS_NAME
from checkpointing.observe.metrics import read_jsonl

__all__ = ["JSON_SCHEMA", "SAVE_KEYS", "Spread", "Summary", "add_arguments", "load_records", "plot", "run",
           "saves_table", "summarize", "summary_table", "to_json"]

JSON_SCHEMA = "checkpointing.report/1"
# every save row of to_json() has exactly these keys (null when the record lacks the field)
SAVE_KEYS = ("step", "rank", "world_size", "ok", "error", "time", "tier", "wait_prev_s", "stall_s", "guard_wait_s", "snapshot_s",
             "write_s", "commit_s", "upload_s", "total_s", "bytes_total", "bytes_written", "bytes_reused",
             "write_bytes_per_s", "upload_bytes_per_s", "step_stall_s", "slowdown_s", "cost_s", "overhead_pct", "step_time_s",
             "time_to_first_durable_s")
_COLORS = {"wait_prev_s": "#9e9e9e", "stall_s": "#d62728", "slowdown_s": "#ff9896", "snapshot_s": "#1f77b4",
           "write_s": "#2ca02c", "commit_s": "#9467bd", "upload_s": "#ff7f0e"}


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
    elif not path.exists():
        raise CheckpointConfigError(f"{text}: no such checkpoint directory or metrics file")
    return [r for r in read_jsonl(path) if isinstance(r, dict)]


def _num(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _ok(rec: dict[str, Any]) -> bool:
    ok = rec.get("ok")
    return ok if isinstance(ok, bool) else rec.get("error") is None


def _scalar(v: Any) -> Any:
    """A JSON scalar as is; anything else (lists, objects, NaN, infinities) as None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if v is None or isinstance(v, (bool, int, float, str)) else None


def _has(records: Sequence[dict[str, Any]], key: str) -> bool:
    return any(_num(r, key) is not None for r in records)


def _save_cost(rec: dict[str, Any]) -> float | None:
    """stall (without waiting for the previous save: a symptom of the current interval, not a cost
    of a save at the advised one) + slowdown when recorded."""
    stall = _num(rec, "stall_s")
    if stall is None and _num(rec, "step_stall_s") is not None:
        stall = max(0.0, _num(rec, "step_stall_s") - (_num(rec, "wait_prev_s") or 0.0))  # type: ignore[operator]
    return None if stall is None else stall + (_num(rec, "slowdown_s") or 0.0)


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
    """Over successful saves (failed ones are only counted). Spreads are None without data.
    Records of several ranks (``rank``/``world_size`` fields) each count as one sample.

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


def summarize(records: Sequence[dict[str, Any]], mtbf_s: float | None = None, restart_s: float = 0.0) -> Summary:
    """Summary of ``records``; with ``mtbf_s`` (seconds) also the recommended interval for a cost
    of the median per-save ``stall_s + slowdown_s``. Raises CheckpointConfigError for a bad MTBF."""
    good = [r for r in records if _ok(r)]

    def col(key: str) -> list[float]:
        return [v for v in (_num(r, key) for r in good) if v is not None]

    def mean_pos(key: str) -> float | None:
        xs = [v for v in col(key) if v > 0]
        return statistics.fmean(xs) if xs else None

    costs = [c for c in (_save_cost(r) for r in good) if c is not None]
    step_times = col("step_time_s")
    step_time = statistics.median(step_times) if step_times else None
    ttfd = [v for v in (_num(r, "time_to_first_durable_s") for r in records) if v is not None]
    rec_advice = None
    if mtbf_s is not None:
        if not costs:
            raise CheckpointConfigError("no successful save with a recorded stall: cannot estimate the checkpoint cost")
        rec_advice = advice.advise(statistics.median(costs), mtbf_s, step_time_s=step_time, restart_s=restart_s)
    return Summary(
        saves=len(records), ok=len(good), failed=len(records) - len(good),
        stall_s=Spread.of(col("stall_s")), total_s=Spread.of(col("total_s")), cost_s=Spread.of(costs),
        step_stall_s=Spread.of(col("step_stall_s")), slowdown_s=Spread.of(col("slowdown_s")),
        overhead_pct=Spread.of(col("overhead_pct")),
        write_bytes_per_s=mean_pos("write_bytes_per_s"), upload_bytes_per_s=mean_pos("upload_bytes_per_s"),
        bytes_written=int(sum(col("bytes_written"))), bytes_reused=int(sum(col("bytes_reused"))),
        step_time_s=step_time, time_to_first_durable_s=ttfd[-1] if ttfd else None, advice=rec_advice,
    )


# ---------------------------------------------------------------------- rendering


def fmt_s(x: float | None) -> str:
    """Seconds for people: ``"4.0 ms"`` below one second, ``"2.50 s"`` above, ``""`` for None."""
    if x is None:
        return ""
    return f"{x * 1e3:.1f} ms" if abs(x) < 1 else f"{x:.2f} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def fmt_rate(x: float | None) -> str:
    return "" if x is None else f"{x / 1e6:.1f}"


def fmt_pct(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}%"


# (record key, header, formatter); a column is shown when some record has the key
_COLUMNS: tuple[tuple[str, str, Callable[[float | None], str]], ...] = (
    ("wait_prev_s", "wait prev", fmt_s), ("stall_s", "stall", fmt_s), ("step_stall_s", "step stall", fmt_s),
    ("slowdown_s", "slowdown", fmt_s), ("snapshot_s", "snapshot", fmt_s), ("write_s", "write", fmt_s),
    ("commit_s", "commit", fmt_s), ("upload_s", "upload", fmt_s), ("total_s", "total", fmt_s),
    ("write_bytes_per_s", "write MB/s", fmt_rate), ("upload_bytes_per_s", "upload MB/s", fmt_rate),
    ("bytes_written", "written", fmt_bytes), ("bytes_reused", "reused", fmt_bytes),
    ("overhead_pct", "overhead", fmt_pct),
)


def saves_table(records: Sequence[dict[str, Any]], title: str = "saves") -> Table:
    """One row per save: step, phases, throughput per tier, bytes, overhead, ok/error."""
    cols = [c for c in _COLUMNS if _has(records, c[0])]
    tiers = any(isinstance(r.get("tier"), str) for r in records)
    ranks = any((_num(r, "world_size") or 1) > 1 or (_num(r, "rank") or 0) > 0 for r in records)
    table = Table(title=title)
    table.add_column("step", justify="right")
    if ranks:  # ranks sharing a directory append to one file: one row per rank and save
        table.add_column("rank", justify="right")
    if tiers:
        table.add_column("tier")
    for _, header, _ in cols:
        table.add_column(header, justify="right")
    table.add_column("result")
    for r in records:
        row = [str(r.get("step", ""))] + ([str(r.get("rank", ""))] if ranks else [])
        row += [str(r.get("tier") or "")] if tiers else []
        row += [fmt(_num(r, key)) for key, _, fmt in cols]
        err = r.get("error")
        row.append("[green]ok[/green]" if _ok(r) else f"[red]error[/red] {escape(str(err))}" if err else "[red]error[/red]")
        table.add_row(*row)
    return table


def summary_table(summary: Summary) -> Table:
    """Percentiles of the per-save times, then totals and (with an MTBF) the advice."""
    table = Table(title=f"summary: {summary.saves} saves, {summary.ok} ok, {summary.failed} failed")
    for name in ("", "p50", "p90", "p99", "max", "mean"):
        table.add_column(name, justify="left" if not name else "right")
    rows = (("stall", summary.stall_s, fmt_s), ("step stall", summary.step_stall_s, fmt_s),
            ("slowdown", summary.slowdown_s, fmt_s), ("cost (stall+slowdown)", summary.cost_s, fmt_s),
            ("total (to durable)", summary.total_s, fmt_s), ("overhead", summary.overhead_pct, fmt_pct))
    for label, spread, fmt in rows:
        if spread is not None and (label != "cost (stall+slowdown)" or summary.slowdown_s is not None):
            table.add_row(label, *(fmt(getattr(spread, k)) for k in ("p50", "p90", "p99", "max", "mean")))
    extra = [("mean write MB/s", fmt_rate(summary.write_bytes_per_s)), ("mean upload MB/s", fmt_rate(summary.upload_bytes_per_s)),
             ("bytes written", fmt_bytes(summary.bytes_written)), ("bytes reused", fmt_bytes(summary.bytes_reused)),
             ("median step time", fmt_s(summary.step_time_s)),
             ("time to first durable save", fmt_s(summary.time_to_first_durable_s))]
    a = summary.advice
    if a is not None:
        extra += [("checkpoint cost C (median)", fmt_s(a.cost_s)), ("MTBF", f"{a.mtbf_s / 3600:.2f} h"),
                  ("Young interval sqrt(2CM)", fmt_s(a.young_s)), ("Daly interval (recommended)", fmt_s(a.daly_s)),
                  ("expected lost time at Daly", fmt_pct(a.lost_fraction * 100) if a.lost_fraction is not None else ""),
                  ("save every", f"{a.every_steps} steps" if a.every_steps is not None else "")]
    for label, value in extra:
        if value:
            table.add_row(label, value, "", "", "", "")
    return table


def to_json(records: Sequence[dict[str, Any]], mtbf_s: float | None = None, *, source: str | None = None,
            plot_path: str | None = None) -> dict[str, Any]:
    """The report as a JSON-ready dict with stable keys.

    ``{"schema": "checkpointing.report/1", "source": str|null, "plot": str|null,
    "saves": [{k: value|null for k in SAVE_KEYS}], "summary": Summary.as_dict() without "advice",
    "advice": IntervalAdvice.as_dict()|null}``. Spreads are ``{"p50","p90","p99","max","mean"}``
    or null; times in seconds, sizes in bytes, throughputs in bytes/s, ``overhead_pct`` in percent.
    """
    summary = summarize(records, mtbf_s).as_dict()
    adv = summary.pop("advice")
    saves = []
    for r in records:
        row: dict[str, Any] = {k: (_num(r, k) if k.endswith(("_s", "_pct")) else _scalar(r.get(k))) for k in SAVE_KEYS}
        row["ok"] = _ok(r)
        saves.append(row)
    return {"schema": JSON_SCHEMA, "source": source, "plot": plot_path, "saves": saves, "summary": summary, "advice": adv}


_LANES = ("wait_prev_s", "stall_s", "snapshot_s", "write_s", "commit_s", "upload_s")
_LOOP_STACK = ("wait_prev_s", "stall_s", "slowdown_s")
_DURABLE_STACK = ("snapshot_s", "write_s", "commit_s", "upload_s")


def _save_starts(records: Sequence[dict[str, Any]]) -> tuple[list[float], bool]:
    """Each save's ``time``; or, when any record lacks one, cumulative positions (and True)."""
    times = [_num(r, "time") for r in records]
    if all(t is not None and t > 0 for t in times):
        return times, False  # type: ignore[return-value]
    acc, out = 0.0, []
    for r in records:
        out.append(acc)
        acc += sum(_num(r, k) or 0.0 for k in ("wait_prev_s", "total_s", "upload_s"))
    return out, True


def plot(records: Sequence[dict[str, Any]], out_png: str | os.PathLike, step_times: Sequence[Any] | None = None) -> Path:
    """Draw a 1200x700 px PNG (12 x 7 in at 100 dpi) and return its path.

    Top: a timeline (x = seconds since the first record or step) of step times, when
    ``step_times`` is given as ``(begin, seconds)`` pairs or :class:`~checkpointing.steptime.StepSample`
    objects with ``begin`` on the records' ``time`` clock (``time.time()``), and each save's phases
    as spans in lanes below it. Records without a ``time`` are laid out back to back (step times
    then start at 0). Bottom: per save, a stacked bar of what the loop paid (wait_prev, stall,
    slowdown) beside one of the way to durability (snapshot, write, commit, upload); failed saves
    have a red edge. Raises ImportError naming the ``checkpointing[plot]`` extra without matplotlib.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'checkpointing[plot]'") from exc
    steps = [(float(s.begin_wall), float(s.seconds)) if hasattr(s, "begin_wall") else (float(s[0]), float(s[1]))
             for s in (step_times or ())]
    starts, sequential = _save_starts(records)
    if sequential:
        origin, steps = 0.0, [(b - steps[0][0], d) for b, d in steps]
    else:
        origin = min(starts + [b for b, _ in steps], default=0.0)
    fig = Figure(figsize=(12, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_b = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 2]})

    # timeline: one lane per phase, in the bottom 40 % of the panel under step times (all of it without)
    lane_h = (0.38 if steps else 0.95) / len(_LANES)
    ends = [b - origin + d for b, d in steps]
    spans: dict[str, list[tuple[float, float]]] = {k: [] for k in _LANES}
    for r, t in zip(records, starts):
        wp, snap, write, commit = (_num(r, k) or 0.0 for k in ("wait_prev_s", "snapshot_s", "write_s", "commit_s"))
        x = t - origin  # save() entry; then wait_prev, stall and snapshot (overlapping), write, commit, upload
        at = dict(zip(_LANES, (x, x + wp, x + wp, x + wp + snap, x + wp + snap + write, x + wp + snap + write + commit)))
        spans.update({k: spans[k] + [(at[k], d)] for k in _LANES if (d := _num(r, k))})
    for i, k in enumerate(_LANES):
        ends += [x + d for x, d in spans[k]]
        if spans[k]:
            ax_t.broken_barh(spans[k], (0.01 + i * lane_h, lane_h * 0.8), transform=ax_t.get_xaxis_transform(),
                             color=_COLORS[k], label=k[:-2])
    if steps:
        ys = [d for _, d in steps]
        ax_t.plot([b - origin for b, _ in steps], ys, color="0.2", lw=0.8, marker=".", ms=2, label="step time")
        lo, hi = min(ys), max(ys)
        span = (hi - lo) / 0.55 if hi > lo else max(hi, 1e-3)
        ax_t.set_ylim(lo - 0.4 * span, hi + 0.05 * span)  # step times above the lanes
        ax_t.set_yticks([y for y in ax_t.get_yticks() if lo - 1e-9 <= y <= hi + 0.05 * span] or [lo])
        ax_t.set_ylabel("step time (s)")
    else:
        ax_t.set_yticks([])
    ax_t.set_xlim(0.0, max(ends, default=1.0) * 1.02 or 1.0)
    note = " (save times not recorded: saves laid out in sequence)" if sequential and records else ""
    ax_t.set_xlabel("seconds since first record" + note)
    ax_t.set_title("timeline: step times and save phases")
    if ax_t.get_legend_handles_labels()[0]:
        ax_t.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")

    # per save: loop cost (left) beside the way to durable (right)
    shown = {k for k in _LOOP_STACK + _DURABLE_STACK if _has(records, k)}
    for i, r in enumerate(records):
        for dx, keys in ((-0.2, _LOOP_STACK), (0.2, _DURABLE_STACK)):
            bottom = 0.0
            for k in keys:
                v = _num(r, k) or 0.0
                ax_b.bar(i + dx, v, 0.38, bottom=bottom, color=_COLORS[k], edgecolor="none" if _ok(r) else "red",
                         label=k[:-2] if i == 0 and k in shown else None)
                bottom += v
    if records:
        top = max(sum(_num(r, k) or 0.0 for k in ks) for r in records for ks in (_LOOP_STACK, _DURABLE_STACK))
        ax_b.set_ylim(0.0, top * 1.05 or 1.0)
        ticks = range(0, len(records), math.ceil(len(records) / 15))
        ax_b.set_xticks(list(ticks), [str(records[i].get("step", i)) for i in ticks])
        ax_b.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    else:
        ax_b.text(0.5, 0.5, "no saves recorded", ha="center", va="center", transform=ax_b.transAxes)
    ax_b.set_xlabel("save (step): left bar = paid by the loop, right bar = way to durable")
    ax_b.set_ylabel("seconds")
    ax_b.set_title("phase costs per save")
    out = Path(out_png)
    fig.savefig(out, dpi=100, format="png")
    return out


# ---------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``checkpointing report``: ``DIR [--json] [--plot PNG] [--mtbf HOURS] [--last N]``."""
    parser.add_argument("dir", help="checkpoint directory holding metrics.jsonl (or the file itself)")
    parser.add_argument("--json", action="store_true", help="machine-readable output (schema checkpointing.report/1)")
    parser.add_argument("--plot", metavar="PNG", default=None, help="also draw a timeline and phase chart to this PNG")
    parser.add_argument("--mtbf", metavar="HOURS", type=float, default=None,
                        help="mean time between failures of the job, in hours: recommends a checkpoint interval")
    parser.add_argument("--last", metavar="N", type=int, default=None, help="only the last N saves")


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``checkpointing report``. Exit codes: 0 fine, 2 bad usage or nothing to show."""
    def fail(msg: str) -> int:
        console.print(f"[red]error:[/red] {escape(msg)}", highlight=False)
        return 2

    try:
        records = load_records(args.dir)
        if args.last is not None:
            if args.last < 1:
                return fail(f"--last must be >= 1, got {args.last}")
            records = records[-args.last:]
        if not records:
            return fail(f"{args.dir}: no save metrics recorded ({METRICS_NAME} is missing or empty)")
        mtbf_s = args.mtbf * 3600.0 if args.mtbf is not None else None
        summary = summarize(records, mtbf_s)
        path = str(plot(records, args.plot)) if args.plot else None
    except (CheckpointConfigError, ImportError, OSError) as exc:
        return fail(str(exc))
    if args.json:
        doc = to_json(records, mtbf_s, source=str(args.dir), plot_path=path)
        console.print(json.dumps(doc, indent=2), markup=False, highlight=False, soft_wrap=True)
        return 0
    console.print(saves_table(records, title=f"saves in {args.dir}"))
    console.print(summary_table(summary))
    if path:
        console.print(f"plot written to {path}", markup=False)
    return 0
