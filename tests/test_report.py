"""`checkpointing report`: table contents, summary numbers, JSON keys, the PNG, the CLI entry."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

from checkpointing.plan import advice
from checkpointing.cli import fmt, report
from checkpointing.observe import summary
from checkpointing.errors import CheckpointConfigError
from checkpointing.observe.metrics import SaveStats, append_jsonl
from checkpointing.observe.steptime import StepClock

T0 = 1_700_000_000.0


def stats(step: int, stall: float, *, ok: bool = True, t: float | None = None) -> SaveStats:
    return SaveStats(
        step=step, ok=ok, error=None if ok else "OSError: disk full", wait_prev_s=0.0, stall_s=stall,
        guard_wait_s=0.01, snapshot_s=0.15, write_s=1.5, commit_s=0.05, total_s=1.7, bytes_total=10**9,
        bytes_written=8 * 10**8 if ok else 0, bytes_reused=2 * 10**8 if ok else 0,
        write_bytes_per_s=5.3e8 if ok else 0.0, staging_bytes=10**9, time=T0 + 20 * step if t is None else t,
    )


@pytest.fixture
def records() -> list[dict]:
    """Four good saves with stalls 0.1..0.4 s and one failed save."""
    out = [stats(i, 0.1 * (i + 1)).as_dict() for i in range(4)]
    out.insert(2, stats(99, 9.0, ok=False).as_dict())
    return out


def render(renderable) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def table_columns(text: str, wrapped: str | None = None, joiner: str = " ") -> dict[str, list[str]]:
    """The first rich table in `text` as {header: its cells, top to bottom}: a header's lines (name, then
    unit) joined by a space; a line where only the `wrapped` column has text continues the row above
    (its text joined with `joiner`)."""
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    heads: list[list[str]] = []
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("┃"):
            heads.append([c.strip() for c in line.strip("┃").split("┃")])
        elif line.startswith("│"):
            rows.append([c.strip() for c in line.strip("│").split("│")])
        elif line.startswith("└"):
            break
    headers = [" ".join(filter(None, col)) for col in zip(*heads)]
    if wrapped is not None:
        at = headers.index(wrapped)
        joined: list[list[str]] = []
        for cells in rows:
            if joined and not any(c for i, c in enumerate(cells) if i != at):
                joined[-1][at] += joiner + cells[at]
            else:
                joined.append(cells)
        rows = joined
    return {h: [r[i] for r in rows] for i, h in enumerate(headers)}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_saves_table_shows_phases_throughput_bytes_and_result(records):
    text = render(report.saves_table(records, wide=True))
    cols = table_columns(text)  # --wide: every recorded field; a unit per column, in its header
    assert list(cols) == ["step", "tier", "wait prev ms", "stall s", "snapshot ms", "write s", "commit ms", "total s",
                          "write MB/s", "written MB", "reused MB", "result"]
    assert cols["step"] == ["0", "1", "99", "2", "3"]
    assert cols["stall s"] == ["0.10", "0.20", "9.00", "0.30", "0.40"]  # the failed save's 9 s puts the column in seconds
    assert set(cols["snapshot ms"]) == {"150.0"} and set(cols["write s"]) == {"1.50"} and set(cols["commit ms"]) == {"50.0"}
    assert set(cols["total s"]) == {"1.70"} and set(cols["wait prev ms"]) == {"0"}
    assert cols["write MB/s"] == ["530.0", "530.0", "0", "530.0", "530.0"]
    assert cols["written MB"] == ["800.0", "800.0", "0", "800.0", "800.0"] and cols["reused MB"] == ["200.0", "200.0", "0", "200.0", "200.0"]
    assert cols["result"] == ["ok", "ok", "error OSError: disk full", "ok", "ok"]
    bracketed = dict(records[2], error="ValueError: bad [red]tag[/red]")
    assert "bad [red]tag[/red]" in render(report.saves_table([bracketed]))  # printed, not styled
    assert cols["tier"] == ["local"] * 5  # SaveStats always records its tier
    for absent in ("upload", "slowdown", "overhead"):  # columns only for fields some record has
        assert absent not in text
    default = render(report.saves_table(records))  # the default view: what a user needs first; --wide names the rest
    assert list(table_columns(default)) == ["step", "stall s", "total s", "written MB", "result"]
    assert "--wide adds: tier, wait prev ms, snapshot ms, write s, commit ms, write MB/s, reused MB" in default


def test_optional_fields_get_columns():
    rec = stats(7, 0.2).as_dict() | {"upload_s": 3.0, "upload_bytes_per_s": 2.0e8, "slowdown_s": 0.45,
                                      "step_stall_s": 0.21, "overhead_pct": 12.5, "tier": "remote"}
    cols = table_columns(render(report.saves_table([rec], wide=True)))
    for header, value in (("upload s", "3.00"), ("upload MB/s", "200.0"), ("slowdown ms", "450.0"),
                          ("step stall ms", "210.0"), ("overhead %", "12.50"), ("tier", "remote")):
        assert cols[header] == [value], (header, cols)
    default = table_columns(render(report.saves_table([rec])))  # a tier other than local, upload, slowdown, overhead: shown
    assert list(default) == ["step", "tier", "stall ms", "slowdown ms", "upload s", "total s", "written MB", "overhead %", "result"]


def test_a_rank_column_when_several_ranks_share_the_file():
    recs = [stats(5, 0.1 + 0.1 * r).as_dict() | {"rank": r, "world_size": 2} for r in range(2)]
    cols = table_columns(render(report.saves_table(recs)))
    assert cols["rank"] == ["0", "1"] and cols["stall ms"] == ["100.0", "200.0"]
    assert [row["rank"] for row in summary.to_json(recs)["saves"]] == [0, 1]
    assert "rank" not in render(report.saves_table([stats(5, 0.1).as_dict()]))


def test_unknown_missing_and_malformed_fields_are_tolerated():
    recs = [{"step": 1, "stall_s": "fast", "from_the_future": [1, 2], "bytes_total": float("nan")}, {"step": 2},
            {"stall_s": 0.3, "ok": "yes?", "tier": ["x"], "error": None}]
    text = render(report.saves_table(recs, wide=True))
    assert table_columns(text) == {"step": ["1", "2", ""], "stall ms": ["", "", "300.0"], "result": ["ok", "ok", "ok"]}
    assert "from_the_future" not in text
    s = summary.summarize(recs)
    assert s.saves == 3 and s.ok == 3 and s.stall_s.p50 == pytest.approx(0.3)
    rows = summary.to_json(recs)["saves"]
    assert rows[0]["stall_s"] is None and rows[1]["total_s"] is None and rows[2]["step"] is None
    assert rows[0]["bytes_total"] is None and rows[2]["tier"] is None  # no NaN or nested values in the JSON
    json.dumps(summary.to_json(recs), allow_nan=False)
    with pytest.raises(CheckpointConfigError, match="cost"):
        summary.summarize([{"step": 1}], mtbf_s=3600.0)


def test_percentiles_by_hand():
    # sorted 0.1 0.2 0.3 0.4; p50 at rank 1.5 -> 0.25; p90 at 2.7 -> 0.3 + 0.7*0.1 = 0.37;
    # p99 at 2.97 -> 0.397; max 0.4; mean 0.25
    s = summary.Spread.of([0.4, 0.1, 0.3, 0.2])
    assert (s.p50, s.p90, s.p99, s.max, s.mean) == pytest.approx((0.25, 0.37, 0.397, 0.4, 0.25))
    assert summary.Spread.of([]) is None
    assert summary.Spread.of([2.0]) == summary.Spread(2.0, 2.0, 2.0, 2.0, 2.0)


def test_summary_counts_good_saves_and_advises_from_the_median_cost(records):
    s = summary.summarize(records)
    assert (s.saves, s.ok, s.failed) == (5, 4, 1)
    assert s.stall_s.max == pytest.approx(0.4)  # the failed save's 9 s stall is only counted
    assert s.total_s.p50 == pytest.approx(1.7)
    assert s.write_bytes_per_s == pytest.approx(5.3e8)
    assert (s.bytes_written, s.bytes_reused) == (32 * 10**8, 8 * 10**8)
    assert s.advice is None and s.slowdown_s is None
    # with slowdown and step time: costs 0.1+0.5, 0.2+0.5, 0.3+0.5, 0.4+0.5 -> median 0.75 s
    for r in records:
        r.update(slowdown_s=0.5, step_time_s=0.25)
    s = summary.summarize(records, mtbf_s=24 * 3600.0)
    assert s.cost_s.p50 == pytest.approx(0.75)
    assert s.advice == advice.advise(s.cost_s.p50, 86400.0, step_time_s=0.25)
    # Young: sqrt(2 * 0.75 * 86400) = sqrt(129600) = 360 s; Daly just below
    assert s.advice.young_s == pytest.approx(360.0)
    assert s.advice.daly_s < 360.0 and s.advice.every_steps == round(s.advice.daly_s / 0.25)
    text = render(report.summary_table(s))
    for value in ("5 saves, 4 ok, 1 failed", "750.0 ms", "360.00 s", f"{s.advice.daly_s:.2f} s", "24.00 h",
                  f"{s.advice.every_steps} steps", "3.2 GB", "530.0"):
        assert value in text
    spreads = table_columns(text)  # a unit per row, in its label
    assert spreads["per save"] == ["stall ms", "slowdown ms", "cost ms (stall + slowdown)", "total s (to committed)"]
    assert spreads["p50"] == ["250.0", "500.0", "750.0", "1.70"] and spreads["max"][0] == "400.0"


def test_cost_uses_step_stall_without_the_wait_for_the_previous_save():
    rec = {"step": 1, "ok": True, "wait_prev_s": 0.3, "step_stall_s": 0.5, "slowdown_s": 0.1}
    assert summary.summarize([rec], mtbf_s=100.0).advice.cost_s == pytest.approx(0.2 + 0.1)


def test_a_save_whose_upload_failed_still_counts_its_bytes_and_cost():
    """Committed locally, its upload failed: the loop paid for it and its bytes are on the local tier."""
    rec = {"step": 1, "ok": False, "committed": True, "error": "CheckpointUploadError: ...", "wait_prev_s": 0.0,
           "stall_s": 0.2, "step_stall_s": 0.2, "slowdown_s": 0.1, "bytes_written": 1000, "bytes_reused": 10}
    s = summary.summarize([rec], mtbf_s=100.0)
    assert (s.ok, s.failed, s.bytes_written, s.bytes_reused) == (0, 1, 1000, 10)
    assert s.advice.cost_s == pytest.approx(0.3)
    lost = dict(rec, committed=False, error="OSError: disk full")
    assert summary.summarize([lost]).bytes_written == 0


def test_a_later_record_of_a_save_whose_upload_succeeded_on_a_later_try_replaces_the_first_in_either_order():
    """SaveStats.upload_tries: the second record of a save (same step, rank, world size, time) replaces the first where
    the first was; step fields it lacks come from the first; another rank's record and another save of the step stay."""
    failed = dict(stats(2, 0.2, ok=False).as_dict(), committed=True, tier="local", upload_s=0.5, upload_tries=1,
                  step_stall_s=0.25, slowdown_s=0.05, cost_s=0.3)
    later = dict(failed, ok=True, error=None, tier="local+remote", upload_s=9.0, upload_tries=2, step_stall_s=None,
                 slowdown_s=None, cost_s=None)
    other_rank = dict(failed, rank=1, world_size=2)
    rerun = dict(failed, time=failed["time"] + 3600)  # a later run's save of step 2: a save of its own
    one, three = stats(1, 0.1).as_dict(), stats(3, 0.3).as_dict()
    for recs in ([one, failed, three, later, other_rank, rerun], [one, later, three, failed, other_rank, rerun]):
        got = summary.current(recs)
        assert [(r["step"], r.get("rank", 0), r["ok"], r.get("upload_tries")) for r in got] == [
            (1, 0, True, None), (2, 0, True, 2), (3, 0, True, None), (2, 1, False, 1), (2, 0, False, 1)]
        assert (got[1]["upload_s"], got[1]["step_stall_s"], got[1]["slowdown_s"], got[1]["error"]) == (9.0, 0.25, 0.05, None)
        s = summary.summarize(recs)
        assert (s.saves, s.ok, s.failed) == (5, 3, 2)
        rows = summary.to_json(recs)["saves"]
        assert [(r["step"], r["ok"], r["upload_tries"]) for r in rows if r["rank"] in (0, None)] == [
            (1, True, None), (2, True, 2), (3, True, None), (2, False, 1)]
    assert summary.current([one, failed]) == [one, failed]  # nothing to fold: the records as they are
    # a later process's recovered record of a save whose own record is there too (two nodes' files merged): left out
    stand_in = dict(three, recovered=True, time=three["time"] + 2.0, stall_s=None)
    again = dict(three, recovered=True, time=three["time"] + 3600)  # a later save of step 3: kept
    assert summary.current([one, stand_in, three, again]) == [one, three, again]
    assert (summary.summarize([one, stand_in, three]).saves, summary.summarize([stand_in]).saves) == (2, 1)


def test_json_has_stable_documented_keys(records):
    doc = summary.to_json(records, mtbf_s=3600.0, source="ckpt")
    assert list(doc) == ["schema", "source", "plot", "saves", "summary", "advice"]
    assert doc["schema"] == "checkpointing.report/1" and doc["source"] == "ckpt" and doc["plot"] is None
    assert all(tuple(row) == summary.SAVE_KEYS for row in doc["saves"])
    # field for field: every SaveStats field (chunks_damaged, to alert on, among them)
    assert set(summary.SAVE_KEYS) == {f.name for f in dataclasses.fields(SaveStats)}
    assert [row["ok"] for row in doc["saves"]] == [True, True, False, True, True]
    assert set(doc["summary"]) == {"saves", "ok", "failed", "stall_s", "total_s", "cost_s", "step_stall_s", "slowdown_s",
                                   "overhead_pct", "write_bytes_per_s", "upload_bytes_per_s", "bytes_written",
                                   "bytes_reused", "step_time_s", "time_to_first_durable_s"}
    assert set(doc["summary"]["stall_s"]) == {"p50", "p90", "p99", "max", "mean"}
    assert doc["advice"]["young_s"] == pytest.approx(advice.young_interval(0.25, 3600.0))
    assert json.loads(json.dumps(doc)) == doc
    assert summary.to_json(records)["advice"] is None


def test_load_records_from_a_directory_a_file_or_a_file_url(tmp_path):
    for i in range(3):
        append_jsonl(tmp_path / "metrics.jsonl", stats(i, 0.1))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "torn\n42\n\n')  # a torn line and a non-object are skipped
    assert [r["step"] for r in summary.load_records(tmp_path)] == [0, 1, 2]
    assert len(summary.load_records(tmp_path / "metrics.jsonl")) == 3
    assert len(summary.load_records(f"file://{tmp_path}")) == 3
    assert summary.load_records(tmp_path / "metrics.jsonl") == summary.load_records(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert summary.load_records(empty) == []
    with pytest.raises(CheckpointConfigError, match="no such"):
        summary.load_records(tmp_path / "missing")
    with pytest.raises(CheckpointConfigError, match="s3:// is not supported yet"):
        summary.load_records("s3://bucket/run1")


def test_png_is_1200_by_700_with_and_without_step_times(tmp_path, records):
    clock = StepClock()
    for i in range(50):
        clock.begin_step(i, float(i))
        clock.end_step(i, i + 1.0 + (0.3 if i % 20 < 2 else 0.0))
    assert png_size(report.plot(records, tmp_path / "a.png", step_times=clock.step_samples())) == (1200, 700)
    pairs = [(T0 + i, 1.0) for i in range(30)]
    assert png_size(report.plot(records, tmp_path / "b.png", step_times=pairs)) == (1200, 700)
    no_time = [dict(r, time=0.0) for r in records]  # old records: saves laid out one after another
    out = report.plot(no_time, str(tmp_path / "c.png"))
    assert out == tmp_path / "c.png" and png_size(out) == (1200, 700)
    assert png_size(report.plot([], tmp_path / "d.png")) == (1200, 700)


def test_plot_without_matplotlib_names_the_extra(tmp_path, records, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what an absent package looks like to import
    with pytest.raises(ImportError, match=r"checkpointing\[plot\]"):
        report.plot(records, tmp_path / "x.png")


def test_cli_plot_without_matplotlib_exits_2_naming_the_extra(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, out = cli(str(run_dir), "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "pip install 'tiered-checkpointing[plot]'" in out


def cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="checkpointing report")
    report.add_arguments(parser)
    out = io.StringIO()
    try:
        code = report.run(parser.parse_args(list(argv)), Console(file=out, width=200))
    except fmt.CommandFailed as exc:  # main() prints it on stderr (test_report_errors_go_to_stderr)
        return exc.code, out.getvalue() + str(exc)
    return code, out.getvalue()


@pytest.fixture
def run_dir(tmp_path) -> Path:
    for i in range(4):
        append_jsonl(tmp_path / "metrics.jsonl", stats(i * 10, 0.1 * (i + 1)))
    return tmp_path


def test_cli_prints_the_tables(run_dir):
    code, out = cli(str(run_dir), "--mtbf", "24")
    assert code == 0
    assert "saves in" in out and "summary: 4 saves, 4 ok, 0 failed" in out and "Daly interval" in out
    code, out = cli(str(run_dir), "--mtbf", "-1")
    assert code != 0 and "in hours" in out and "got -1.0" in out and "3600" not in out, out


def test_cli_json_last_and_plot(run_dir, tmp_path):
    png = tmp_path / "out.png"
    code, out = cli(str(run_dir), "--json", "--last", "2", "--plot", str(png))
    assert code == 0
    doc = json.loads(out)
    assert [r["step"] for r in doc["saves"]] == [20, 30]
    assert doc["plot"] == str(png) and png_size(png) == (1200, 700)
    assert doc["advice"] is None


@pytest.mark.parametrize("argv, message", [
    (["--mtbf", "0"], "mean time between failures"),
    (["--last", "0"], "--last"),
])
def test_cli_bad_arguments_exit_2(run_dir, argv, message):
    code, out = cli(str(run_dir), *argv)
    assert code == 2 and message in out


def test_report_errors_go_to_stderr_never_into_its_json(run_dir, capsys, monkeypatch):
    from checkpointing.cli.app import main

    monkeypatch.setenv("COLUMNS", "250")
    for argv in (["--last", "0"], ["--json", "--last", "0"], ["--mtbf", "-1", "--json"]):
        assert main(["report", str(run_dir), *argv]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.startswith("error:"), (argv, out)
    assert main(["report", str(run_dir / "nope"), "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "no such checkpoint directory" in " ".join(out.err.split())


def test_cli_nothing_to_show_exits_2(tmp_path):
    code, out = cli(str(tmp_path))
    assert code == 2 and "no save metrics" in out
    code, out = cli(str(tmp_path / "nope"))
    assert code == 2 and "no such" in out


def test_step_accounting_fields_flow_into_the_report():
    clock = StepClock()
    t = 0.0
    for i in range(4):
        clock.begin_step(i, t)
        t += 1.0
        clock.end_step(i, t)
    clock.begin_step(4, t)
    t += 1.0
    clock.save_issued(4, t)
    t += 0.2
    clock.save_returned(4, t)
    clock.end_step(4, t)
    clock.begin_step(5, t)
    t += 1.3
    clock.end_step(5, t)
    clock.save_durable(4, t)
    [cost] = clock.pop_results()
    rec = stats(4, 0.2).as_dict() | cost.as_metrics()
    cols = table_columns(render(report.saves_table([rec], wide=True)))
    assert cols["step stall ms"] == ["200.0"] and cols["slowdown ms"] == ["300.0"] and "overhead %" in cols
    assert summary.summarize([rec]).cost_s.p50 == pytest.approx(0.5)


def test_a_line_torn_by_a_crash_does_not_swallow_the_next_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, stats(1, 0.1))
    with open(path, "a") as f:
        f.write('{"step": 2, "ok": tr')  # an append cut short
    append_jsonl(path, stats(3, 0.1))
    assert [r["step"] for r in summary.load_records(tmp_path)] == [1, 3]


def test_ranks_sharing_a_file_are_one_save_each_in_step_order_and_last_counts_saves(tmp_path):
    # two ranks append as they finish: rank 1's record of step 20 lands before rank 0's record of step 10
    def rec(step, rank, ok=True):
        return stats(step, 0.1 + rank / 10).as_dict() | {"rank": rank, "world_size": 2, "ok": ok,
                                                           "error": None if ok else "disk full"}
    recs = [rec(10, 1), rec(20, 1), rec(10, 0), rec(20, 0, ok=False), rec(30, 0), rec(30, 1),
            rec(10, 1), rec(10, 0)]  # a later run saved step 10 again: another save
    cols = table_columns(render(report.saves_table(recs)))
    assert list(zip(cols["step"], cols["rank"])) == [("10", "0"), ("10", "1"), ("20", "0"), ("20", "1"), ("30", "0"),
                                                    ("30", "1"), ("10", "0"), ("10", "1")]
    s = summary.summarize(recs)
    assert (s.saves, s.ok, s.failed) == (4, 3, 1)  # a save fails when one rank's record failed
    assert "4 saves, 3 ok, 1 failed" in render(report.summary_table(s))
    assert [(r["step"], r["rank"]) for r in summary.to_json(recs)["saves"]][:4] == [(10, 0), (10, 1), (20, 0), (20, 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, out = cli(str(tmp_path), "--json", "--last", "2")
    doc = json.loads(out)
    assert [(r["step"], r["rank"]) for r in doc["saves"]] == [(30, 0), (30, 1), (10, 0), (10, 1)]
    assert (doc["summary"]["saves"], doc["summary"]["ok"]) == (2, 2)


def test_a_save_one_rank_wrote_no_record_of_is_not_merged_with_a_later_runs_save_of_that_step():
    def rec(step, rank, t, ok=True):
        return {"step": step, "rank": rank, "world_size": 2, "ok": ok, "time": t, "stall_s": 0.001, "error": None if ok else "x"}
    recs = [rec(4, 0, 100), rec(4, 1, 100), rec(5, 0, 101, ok=False),  # run 1: rank 1 failed inside save(): no record
            rec(6, 0, 102), rec(6, 1, 102), rec(5, 1, 200), rec(5, 0, 200), rec(6, 0, 201), rec(6, 1, 201)]  # run 2
    saves = summary.by_save(recs)
    assert [[(r["step"], r["rank"], r["time"]) for r in save] for save in saves] == [
        [(4, 0, 100), (4, 1, 100)], [(5, 0, 101)], [(6, 0, 102), (6, 1, 102)], [(5, 0, 200), (5, 1, 200)],
        [(6, 0, 201), (6, 1, 201)]]
    s = summary.summarize(recs)
    assert (s.saves, s.ok, s.failed) == (5, 4, 1)
