"""`checkpointing report DIR`: what saves cost, shown as tables and a plot (layer: cli).

The records and their numbers (loading, percentiles, the Young/Daly advice, the JSON document) are
checkpointing/observe/summary.py; this module shows them: a rich table of saves (:func:`saves_view`,
:func:`saves_table`: the columns that matter, fitted to the terminal by cli/tables.py, every
recorded one with ``--wide``; an optional field gets a column only when some record has it; each
column's unit in its header), a summary table (:func:`summary_table`), a PNG (:func:`plot`, needs
the ``tiered-checkpointing[plot]`` extra), and the command (:func:`add_arguments`, :func:`run`).
Throughputs are shown as MB/s (1 MB = 1e6 B).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.text import Text

from checkpointing.cli import fmt, tables
from checkpointing.cli.targets import add_target, open_target
from checkpointing.errors import CheckpointConfigError
from checkpointing.format.naming import METRICS_NAME
from checkpointing.observe.metrics import MAX_METRICS_BYTES, parse_jsonl
from checkpointing.observe.summary import Record, Summary, by_save, load_records, number, recorded, succeeded, summarize, to_json

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from checkpointing.observe.steptime import StepSample

__all__ = ["add_arguments", "plot", "run", "saves_table", "saves_view", "summary_table", "summary_view"]


# (record key, header, unit kind, drop): a column shows when some record has the key; drop None: only with
# --wide, else the order in which the default view gives columns up to a narrow terminal (highest first)
_COLUMNS: tuple[tuple[str, str, str, int | None], ...] = (
    ("wait_prev_s", "wait prev", "s", None), ("stall_s", "stall", "s", 1), ("step_stall_s", "step stall", "s", None),
    ("slowdown_s", "slowdown", "s", 4), ("snapshot_s", "snapshot", "s", None), ("write_s", "write", "s", None),
    ("commit_s", "commit", "s", None), ("upload_s", "upload", "s", 2), ("total_s", "total", "s", 1),
    ("write_bytes_per_s", "write", "MB/s", None), ("upload_bytes_per_s", "upload", "MB/s", None),
    ("bytes_written", "written", "B", 2), ("bytes_reused", "reused", "B", None),
    ("overhead_pct", "overhead", "%", 3),
)
_NOTES = {"stall_s": "stall: the loop blocked by the save", "slowdown_s": "slowdown: steps slowed while it ran",
          "upload_s": "upload: local commit to durable on the remote tier", "total_s": "total: save() to committed locally",
          "overhead_pct": "overhead: wait prev + stall + slowdown in % of the training time since the previous save"}
_PERCENTILES = ("p50", "p90", "p99", "max", "mean")


def _unit(kind: str, values: list[float | None]) -> fmt.Unit:
    """The column's unit: ms or s for times, B..TB for bytes, MB/s, %."""
    if kind == "s":
        return fmt.time_unit(values)
    if kind == "B":
        return fmt.size_unit(values)
    return fmt.MB_PER_S if kind == "MB/s" else fmt.PERCENT


def saves_view(records: Sequence[Record], title: str = "saves", *, wide: bool = False, width: int | None = None) -> tables.View:
    """One row per save (and rank, ordered by save then rank): step, the phases that matter (--wide: all), bytes,
    overhead, ok/error, fitted to `width`."""
    records = [r for save in by_save(records) for r in save]
    cols = [c for c in _COLUMNS if recorded(records, c[0])]
    tier_names = {r.get("tier") for r in records if isinstance(r.get("tier"), str)}
    ranks = any((number(r, "world_size") or 1) > 1 or (number(r, "rank") or 0) > 0 for r in records)
    columns = [tables.Column("step")]
    columns += [tables.Column("rank")] if ranks else []  # ranks sharing a directory append to one file: one row per rank and save
    if tier_names:  # where each save is durable: worth a default column once a save reached another tier
        columns.append(tables.Column("tier", justify="left", default=tier_names != {"local"}, drop=5))
    units = [_unit(kind, [number(r, key) for r in records]) for key, _, kind, _ in cols]
    columns += [tables.Column(header, unit.name, default=drop is not None, drop=drop or 0, note=_NOTES.get(key, ""))
                for (key, header, _, drop), unit in zip(cols, units)]
    recovered = any(r.get("recovered") is True for r in records)
    columns.append(tables.Column("result", justify="left", flex=True, breaks=" /", min_width=30,
                                 note="recovered: committed by a process killed before recording it (its times unknown)" if recovered else ""))
    rows = []
    for r in records:
        row: list[tables.Cell] = [escape(str(r.get("step", "")))] + ([escape(str(r.get("rank", "")))] if ranks else [])
        row += [Text(str(r.get("tier") or ""))] if tier_names else []
        row += [unit(number(r, key)) for (key, _, _, _), unit in zip(cols, units)]
        err, mark = r.get("error"), " (recovered)" if r.get("recovered") is True else ""
        tries = r.get("upload_tries")
        if isinstance(tries, int) and not isinstance(tries, bool) and tries > 1:
            mark += f" (uploaded at try {tries})" if succeeded(r) else f" (upload try {tries})"
        row.append(Text("ok" + mark, style="green") if succeeded(r) else Text.assemble(("error", "red"), f" {err}" if err else "", mark))
        rows.append(row)
    return tables.fit(columns, rows, width=width, wide=wide, title=title)


def saves_table(records: Sequence[Record], title: str = "saves", *, wide: bool = False, width: int | None = None) -> RenderableType:
    """The saves of `saves_view`, as a renderable."""
    return saves_view(records, title, wide=wide, width=width).renderable


def summary_view(summary: Summary, *, width: int | None = None) -> tables.View:
    """Percentiles of the per-save times (a unit per row), then totals and (with an MTBF) the advice."""
    spreads = (("stall", "", summary.stall_s), ("step stall", "", summary.step_stall_s), ("slowdown", "", summary.slowdown_s),
               ("cost", " (stall + slowdown)", summary.cost_s if summary.slowdown_s is not None else None),
               ("total", " (to committed)", summary.total_s))
    rows: list[list[tables.Cell]] = []
    for label, suffix, spread in spreads:
        if spread is not None:
            values = [getattr(spread, k) for k in _PERCENTILES]
            unit = fmt.time_unit(values)
            rows.append([Text(f"{label} {unit.name}{suffix}")] + [unit(v) for v in values])
    if summary.overhead_pct is not None:
        rows.append([Text("overhead %")] + [fmt.PERCENT(getattr(summary.overhead_pct, k)) for k in _PERCENTILES])
    columns = [tables.Column("per save", justify="left", flex=True, min_width=10)] + [tables.Column(k) for k in _PERCENTILES]
    spread_view = tables.fit(columns, rows, width=width,
                             title=f"summary: {summary.saves} saves, {summary.ok} ok, {summary.failed} failed")
    extra = [("mean write MB/s", fmt.mb_per_s(summary.write_bytes_per_s)), ("mean upload MB/s", fmt.mb_per_s(summary.upload_bytes_per_s)),
             ("bytes written", fmt.size(summary.bytes_written)), ("bytes reused", fmt.size(summary.bytes_reused)),
             ("median step time", fmt.seconds(summary.step_time_s)),
             ("time to first durable save", fmt.seconds(summary.time_to_first_durable_s))]
    a = summary.advice
    if a is not None:
        extra += [("checkpoint cost C (median)", fmt.seconds(a.cost_s)), ("MTBF", f"{a.mtbf_s / 3600:.2f} h"),
                  ("Young interval sqrt(2CM)", fmt.seconds(a.young_s)), ("Daly interval (recommended)", fmt.seconds(a.daly_s)),
                  ("expected lost time at Daly", fmt.percent(a.lost_fraction * 100) if a.lost_fraction is not None else ""),
                  ("save every", (f"{a.every_steps} step" + ("s" if a.every_steps != 1 else "")) if a.every_steps is not None else "")]
    totals = [[Text(label), Text(value)] for label, value in extra if value]
    if not totals:
        return spread_view
    totals_view = tables.fit([tables.Column("totals", justify="left", flex=True, min_width=10), tables.Column("")], totals, width=width)
    return tables.View(Group(spread_view.renderable, totals_view.renderable), max(spread_view.width, totals_view.width), ())


def summary_table(summary: Summary, *, width: int | None = None) -> RenderableType:
    """The tables of `summary_view`, as a renderable."""
    return summary_view(summary, width=width).renderable


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
    have a red edge. Raises ImportError naming the ``tiered-checkpointing[plot]`` extra without matplotlib.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'tiered-checkpointing[plot]'") from exc
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
    ax.set_title("timeline: step times and save phases" if steps else "timeline: save phases (no step times recorded)")
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
    """Arguments of ``checkpointing report``: ``DIR [--json] [--plot PNG] [--mtbf HOURS] [--last N] [--wide]``."""
    add_target(parser)  # a directory, its metrics.jsonl, or a tier URL
    parser.add_argument("--json", action="store_true", help="machine-readable output (schema checkpointing.report/1)")
    parser.add_argument("--plot", metavar="PNG", default=None, help="also draw a timeline and phase chart to this PNG")
    parser.add_argument("--mtbf", metavar="HOURS", type=float, default=None,
                        help="mean time between failures of the job, in hours: recommends a checkpoint interval")
    parser.add_argument("--last", metavar="N", type=int, default=None, help="only the last N saves")
    parser.add_argument("--wide", action="store_true", help="every recorded column (each phase, throughputs, reused bytes), however wide")


def _records(target: str, option_pairs: list[str]) -> list[dict[str, Any]]:
    """The records of a directory, a metrics file or a file:// URL (read locally), or of another tier URL:
    the copy of rank 0's metrics.jsonl its uploads keep there (save/uploader.py)."""
    if "://" not in target or target.startswith("file://"):
        if option_pairs:
            raise CheckpointConfigError("--storage-option applies to URLs (s3://bucket/prefix), not to a directory")
        return load_records(target)
    storage = open_target(target, option_pairs)
    try:
        data = storage.get(METRICS_NAME, max_bytes=MAX_METRICS_BYTES)
    except FileNotFoundError:
        return []
    return [r for r in parse_jsonl(data) if isinstance(r, dict)]


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``checkpointing report``. Exit codes: 0 fine, 2 bad usage or nothing to show (the error on stderr)."""
    try:
        saves = by_save(_records(args.dir, args.storage_option))
        if args.last is not None:
            if args.last < 1:
                raise fmt.CommandFailed(f"--last must be >= 1, got {args.last}")
            saves = saves[-args.last:]  # the last saves, every rank's record of each
        records = [r for save in saves for r in save]
        if not records:
            raise fmt.CommandFailed(f"{args.dir}: no save metrics recorded ({METRICS_NAME} is missing or empty)")
        if args.mtbf is not None and not args.mtbf > 0:
            raise fmt.CommandFailed(f"--mtbf is the mean time between failures in hours: pass a number > 0, got {args.mtbf}")
        mtbf_s = args.mtbf * 3600.0 if args.mtbf is not None else None
        summary = summarize(records, mtbf_s)
        path = str(plot(records, args.plot)) if args.plot else None
    except (CheckpointConfigError, ImportError, OSError) as exc:
        raise fmt.CommandFailed(str(exc)) from None
    if args.json:
        doc = to_json(records, mtbf_s, source=str(args.dir), plot_path=path)
        console.print(json.dumps(doc, indent=2), markup=False, highlight=False, soft_wrap=True)
        return 0
    tables.show(console, saves_view(records, f"saves in {args.dir}", wide=args.wide, width=console.width))
    tables.show(console, summary_view(summary, width=console.width))
    if path:
        console.print(f"plot written to {path}", markup=False)
    return 0
