"""`checkpointing report DIR`: what saves cost, shown as tables and a plot (layer: cli).

The records and their numbers (loading, percentiles, the Young/Daly advice, the JSON document) are
checkpointing/observe/summary.py; this module shows them: a rich table of saves (:func:`saves_table`;
an optional field gets a column only when some record has it), a summary table
(:func:`summary_table`), a PNG (:func:`plot`, needs the ``checkpointing[plot]`` extra), and the
command (:func:`add_arguments`, :func:`run`). Throughputs are shown as MB/s (1 MB = 1e6 B).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from checkpointing.cli import fmt
from checkpointing.errors import CheckpointConfigError
from checkpointing.format.naming import METRICS_NAME
from checkpointing.observe.summary import Record, Summary, load_records, number, recorded, succeeded, summarize, to_json

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from checkpointing.observe.steptime import StepSample

__all__ = ["add_arguments", "plot", "run", "saves_table", "summary_table"]


# (record key, header, formatter); a column is shown when some record has the key
_COLUMNS: tuple[tuple[str, str, Callable[[float | None], str]], ...] = (
    ("wait_prev_s", "wait prev", fmt.seconds), ("stall_s", "stall", fmt.seconds), ("step_stall_s", "step stall", fmt.seconds),
    ("slowdown_s", "slowdown", fmt.seconds), ("snapshot_s", "snapshot", fmt.seconds), ("write_s", "write", fmt.seconds),
    ("commit_s", "commit", fmt.seconds), ("upload_s", "upload", fmt.seconds), ("total_s", "total", fmt.seconds),
    ("write_bytes_per_s", "write MB/s", fmt.mb_per_s), ("upload_bytes_per_s", "upload MB/s", fmt.mb_per_s),
    ("bytes_written", "written", fmt.size), ("bytes_reused", "reused", fmt.size),
    ("overhead_pct", "overhead", fmt.percent),
)


def saves_table(records: Sequence[Record], title: str = "saves") -> Table:
    """One row per save: step, phases, throughput per tier, bytes, overhead, ok/error."""
    cols = [c for c in _COLUMNS if recorded(records, c[0])]
    tiers = any(isinstance(r.get("tier"), str) for r in records)
    ranks = any((number(r, "world_size") or 1) > 1 or (number(r, "rank") or 0) > 0 for r in records)
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
        row = [escape(str(r.get("step", "")))] + ([escape(str(r.get("rank", "")))] if ranks else [])
        row += [escape(str(r.get("tier") or ""))] if tiers else []
        row += [show(number(r, key)) for key, _, show in cols]
        err = r.get("error")
        row.append("[green]ok[/green]" if succeeded(r) else f"[red]error[/red] {escape(str(err))}" if err else "[red]error[/red]")
        table.add_row(*row)
    return table


def summary_table(summary: Summary) -> Table:
    """Percentiles of the per-save times, then totals and (with an MTBF) the advice."""
    table = Table(title=f"summary: {summary.saves} saves, {summary.ok} ok, {summary.failed} failed")
    for name in ("", "p50", "p90", "p99", "max", "mean"):
        table.add_column(name, justify="left" if not name else "right")
    rows = (("stall", summary.stall_s, fmt.seconds), ("step stall", summary.step_stall_s, fmt.seconds),
            ("slowdown", summary.slowdown_s, fmt.seconds), ("cost (stall+slowdown)", summary.cost_s, fmt.seconds),
            ("total (to durable)", summary.total_s, fmt.seconds), ("overhead", summary.overhead_pct, fmt.percent))
    for label, spread, show in rows:
        if spread is not None and (label != "cost (stall+slowdown)" or summary.slowdown_s is not None):
            table.add_row(label, *(show(getattr(spread, k)) for k in ("p50", "p90", "p99", "max", "mean")))
    extra = [("mean write MB/s", fmt.mb_per_s(summary.write_bytes_per_s)), ("mean upload MB/s", fmt.mb_per_s(summary.upload_bytes_per_s)),
             ("bytes written", fmt.size(summary.bytes_written)), ("bytes reused", fmt.size(summary.bytes_reused)),
             ("median step time", fmt.seconds(summary.step_time_s)),
             ("time to first durable save", fmt.seconds(summary.time_to_first_durable_s))]
    a = summary.advice
    if a is not None:
        extra += [("checkpoint cost C (median)", fmt.seconds(a.cost_s)), ("MTBF", f"{a.mtbf_s / 3600:.2f} h"),
                  ("Young interval sqrt(2CM)", fmt.seconds(a.young_s)), ("Daly interval (recommended)", fmt.seconds(a.daly_s)),
                  ("expected lost time at Daly", fmt.percent(a.lost_fraction * 100) if a.lost_fraction is not None else ""),
                  ("save every", f"{a.every_steps} steps" if a.every_steps is not None else "")]
    for label, value in extra:
        if value:
            table.add_row(label, value, "", "", "", "")
    return table


_COLORS = {"wait_prev_s": "#9e9e9e", "stall_s": "#d62728", "slowdown_s": "#ff9896", "snapshot_s": "#1f77b4",
           "write_s": "#2ca02c", "commit_s": "#9467bd", "upload_s": "#ff7f0e"}
_LANES = ("wait_prev_s", "stall_s", "snapshot_s", "write_s", "commit_s", "upload_s")
_LOOP_STACK = ("wait_prev_s", "stall_s", "slowdown_s")
_DURABLE_STACK = ("snapshot_s", "write_s", "commit_s", "upload_s")


def plot(records: Sequence[Record], out_png: str | os.PathLike, step_times: Sequence[StepSample | tuple[float, float]] | None = None) -> Path:
    """Draw a 1200x700 px PNG (12 x 7 in at 100 dpi) and return its path.

    Top: a timeline (x = seconds since the first record or step) of step times, when
    ``step_times`` is given as ``(begin, seconds)`` pairs or :class:`~checkpointing.observe.steptime.StepSample`
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
    fig = Figure(figsize=(12, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_b = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 2]})
    _draw_timeline(ax_t, records, steps)
    _draw_phase_bars(ax_b, records)
    out = Path(out_png)
    fig.savefig(out, dpi=100, format="png")
    return out


def _save_starts(records: Sequence[Record]) -> tuple[list[float], bool]:
    """Each save's ``time``; or, when any record lacks one, cumulative positions (and True)."""
    times = [number(r, "time") for r in records]
    if all(t is not None and t > 0 for t in times):
        return times, False  # type: ignore[return-value]
    acc, out = 0.0, []
    for r in records:
        out.append(acc)
        acc += sum(number(r, k) or 0.0 for k in ("wait_prev_s", "total_s", "upload_s"))
    return out, True


def _phase_spans(records: Sequence[Record], starts: list[float], origin: float) -> dict[str, list[tuple[float, float]]]:
    """Per phase lane, the (start, seconds) of each save's phase, on the timeline's x axis."""
    spans: dict[str, list[tuple[float, float]]] = {k: [] for k in _LANES}
    for r, t in zip(records, starts):
        wp, snap, write, commit = (number(r, k) or 0.0 for k in ("wait_prev_s", "snapshot_s", "write_s", "commit_s"))
        x = t - origin  # save() entry; then wait_prev, stall and snapshot (overlapping), write, commit, upload
        at = dict(zip(_LANES, (x, x + wp, x + wp, x + wp + snap, x + wp + snap + write, x + wp + snap + write + commit)))
        spans.update({k: spans[k] + [(at[k], d)] for k in _LANES if (d := number(r, k))})
    return spans


def _draw_timeline(ax: Axes, records: Sequence[Record], steps: list[tuple[float, float]]) -> None:
    """The top panel: step times over the save phases' lanes (all of the panel without step times)."""
    starts, sequential = _save_starts(records)
    if sequential:
        origin, steps = 0.0, [(b - steps[0][0], d) for b, d in steps]
    else:
        origin = min(starts + [b for b, _ in steps], default=0.0)
    lane_h = (0.38 if steps else 0.95) / len(_LANES)  # the lanes take the bottom 40 % under step times
    ends = [b - origin + d for b, d in steps]
    spans = _phase_spans(records, starts, origin)
    for i, k in enumerate(_LANES):
        ends += [x + d for x, d in spans[k]]
        if spans[k]:
            ax.broken_barh(spans[k], (0.01 + i * lane_h, lane_h * 0.8), transform=ax.get_xaxis_transform(),
                           color=_COLORS[k], label=k[:-2])
    if steps:
        ys = [d for _, d in steps]
        ax.plot([b - origin for b, _ in steps], ys, color="0.2", lw=0.8, marker=".", ms=2, label="step time")
        lo, hi = min(ys), max(ys)
        span = (hi - lo) / 0.55 if hi > lo else max(hi, 1e-3)
        ax.set_ylim(lo - 0.4 * span, hi + 0.05 * span)  # step times above the lanes
        ax.set_yticks([y for y in ax.get_yticks() if lo - 1e-9 <= y <= hi + 0.05 * span] or [lo])
        ax.set_ylabel("step time (s)")
    else:
        ax.set_yticks([])
    ax.set_xlim(0.0, max(ends, default=1.0) * 1.02 or 1.0)
    note = " (save times not recorded: saves laid out in sequence)" if sequential and records else ""
    ax.set_xlabel("seconds since first record" + note)
    ax.set_title("timeline: step times and save phases")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")


def _draw_phase_bars(ax: Axes, records: Sequence[Record]) -> None:
    """The bottom panel, per save: what the loop paid (left bar) beside the way to durable (right bar)."""
    shown = {k for k in _LOOP_STACK + _DURABLE_STACK if recorded(records, k)}
    for i, r in enumerate(records):
        for dx, keys in ((-0.2, _LOOP_STACK), (0.2, _DURABLE_STACK)):
            bottom = 0.0
            for k in keys:
                v = number(r, k) or 0.0
                ax.bar(i + dx, v, 0.38, bottom=bottom, color=_COLORS[k], edgecolor="none" if succeeded(r) else "red",
                       label=k[:-2] if i == 0 and k in shown else None)
                bottom += v
    if records:
        top = max(sum(number(r, k) or 0.0 for k in ks) for r in records for ks in (_LOOP_STACK, _DURABLE_STACK))
        ax.set_ylim(0.0, top * 1.05 or 1.0)
        ticks = range(0, len(records), math.ceil(len(records) / 15))
        ax.set_xticks(list(ticks), [str(records[i].get("step", i)) for i in ticks])
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    else:
        ax.text(0.5, 0.5, "no saves recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("save (step): left bar = paid by the loop, right bar = way to durable")
    ax.set_ylabel("seconds")
    ax.set_title("phase costs per save")


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
    try:
        records = load_records(args.dir)
        if args.last is not None:
            if args.last < 1:
                return fmt.fail(console, f"--last must be >= 1, got {args.last}")
            records = records[-args.last:]
        if not records:
            return fmt.fail(console, f"{args.dir}: no save metrics recorded ({METRICS_NAME} is missing or empty)")
        mtbf_s = args.mtbf * 3600.0 if args.mtbf is not None else None
        summary = summarize(records, mtbf_s)
        path = str(plot(records, args.plot)) if args.plot else None
    except (CheckpointConfigError, ImportError, OSError) as exc:
        return fmt.fail(console, str(exc))
    if args.json:
        doc = to_json(records, mtbf_s, source=str(args.dir), plot_path=path)
        console.print(json.dumps(doc, indent=2), markup=False, highlight=False, soft_wrap=True)
        return 0
    console.print(saves_table(records, title=escape(f"saves in {args.dir}")))
    console.print(summary_table(summary))
    if path:
        console.print(f"plot written to {path}", markup=False)
    return 0
