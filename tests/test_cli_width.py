"""`ls`, `inspect` and `report` fit a terminal: at 80 and 120 columns the default views keep every line
within the width, cut nothing ("…"), say each unit once in a header, and show every number their
--json twin has; a column left out is named (--wide shows it). --wide shows every column. Piped
output (not a terminal) carries the same text as a terminal's, without colour codes.

The checkpoint is a real run's: incremental saves with metrics on a local tier and a file:// remote
tier, tensors with long keys, and the run's metrics.jsonl (plus one failed save's record with a
long error message, as a failed upload writes it)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console

from _models import child_env
from checkpointing import CheckpointManager
from checkpointing.cli import fmt, tables
from checkpointing.observe.metrics import SaveStats, append_jsonl
from test_report import table_columns

SCALE = {"ms": 1e-3, "s": 1.0, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "%": 1.0, "MB/s": 1e6}
LONG_KEY = "transformer.encoder.layers.11.self_attention.query_key_value.weight"  # with "model/": 74 characters
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    """A local tier (keep_local=3) and a file:// remote tier after 5 incremental saves with metrics."""
    base = tmp_path_factory.mktemp("width")
    remote = f"file://{base / 'remote'}"
    frozen = torch.randn(1 << 15)
    with CheckpointManager(base / "local", remote=remote, keep_local=3) as mgr:
        for step in range(1, 6):
            state = {"model": {LONG_KEY: frozen, "head.bias": torch.full((256,), float(step))},
                     "optim": {"state": {LONG_KEY: {"exp_avg": torch.full((64,), step / 10)}}}, "lr": 0.001}
            mgr.save(step * 100, state, metrics={"loss": 1 / step, "grad_norm": 0.123456 * step}).wait()
    failed = SaveStats(step=600, ok=False, error="CheckpointUploadError: upload of step 600 to " + remote + "/step-0000000600/"
                       "r00000.pack failed after 5 attempts: [Errno 28] No space left on device", wait_prev_s=0.0,
                       stall_s=0.002, guard_wait_s=0.0, snapshot_s=0.001, write_s=0.01, commit_s=0.002, total_s=0.02,
                       bytes_total=10**5, bytes_written=10**5, bytes_reused=0, write_bytes_per_s=1e7, staging_bytes=10**5,
                       time=1.0)
    append_jsonl(base / "local" / "metrics.jsonl", failed)
    return base / "local", remote


def lines_of(text: str) -> list[str]:
    return text.rstrip("\n").split("\n")


def assert_fits(text: str, width: int) -> None:
    too_long = [line for line in lines_of(text) if cell_len(line) > width]
    assert not too_long, f"{len(too_long)} line(s) wider than {width}:\n" + "\n".join(too_long)
    assert "…" not in text and "\x1b[" not in text, text


def header_unit(header: str) -> tuple[str, float]:
    """("stall ms") -> ("stall", 1e-3), ("committed UTC") -> ("committed", 1.0); a header without a unit -> (header, 1.0)."""
    name, _, unit = header.rpartition(" ")
    return (name, SCALE.get(unit, 1.0)) if (unit in SCALE or unit == "UTC") and name else (header, 1.0)


def assert_close(cell: str, scale: float, value: float | None, what: str) -> None:
    """`cell` is `value` in the column's unit, rounded to the decimals it shows."""
    if value is None:
        assert cell == "", (what, cell)
        return
    decimals = len(cell.partition(".")[2])
    assert abs(float(cell) * scale - value) <= 0.5 * 10**-decimals * scale * 1.0001 + 1e-12, (what, cell, value)


def notes_name(text: str, names: list[str]) -> None:
    """Each column name is a column of the table or named after "--wide adds:" (with its unit)."""
    shown = [header_unit(h)[0] for h in table_columns(text)]
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if line.startswith("--wide adds: ")), None)
    note = ""
    if at is not None:  # the note goes on over the lines that do not start a table, a title or a message
        end = next((j for j in range(at + 1, len(lines)) if not lines[j] or lines[j][0] in " ┏┃│└" or lines[j].startswith("no ")),
                   len(lines))
        note = " ".join(line.strip() for line in lines[at:end]).removeprefix("--wide adds: ")
    hidden = [header_unit(h.strip())[0] for h in note.split(", ")] if note else []
    for name in names:
        assert name in shown or name in hidden, (name, shown, hidden)


# ---------------------------------------------------------------------------------------------- ls


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("with_remote", [False, True])
def test_ls_fits_and_shows_every_number(run, run_cli, columns, with_remote):
    local, remote = run
    extra = ["--remote", remote] if with_remote else []
    code, text = run_cli("ls", str(local), *extra, columns=columns)
    assert code == 0, text
    assert_fits(text, columns)
    rows = json.loads(run_cli("ls", str(local), *extra, "--json")[1])
    cols = table_columns(text, "metrics")
    must = ["step", "state"] + (["tier"] if with_remote else [])
    assert list(cols)[: len(must)] == must and "metrics" in cols, list(cols)
    assert any(h.startswith("size ") for h in cols) and ("committed UTC" in cols or columns < 120), list(cols)
    assert cols["step"] == [str(r["step"]) for r in rows]
    assert cols["state"] == [r["state"] for r in rows]
    for header in [h for h in cols if h.split()[0] in ("size", "new")]:
        name, scale = header_unit(header)
        for cell, r in zip(cols[header], rows):
            assert_close(cell, scale, r.get({"size": "bytes"}.get(name, name)), header)
    assert cols["metrics"] == [" ".join(f"{k}={v:.4g}" for k, v in sorted(r.get("metrics", {}).items())) for r in rows]
    assert all(c.startswith(r["committed_at"][:16].replace("T", " ")) for c, r in zip(cols.get("committed UTC", []), rows) if c)
    notes_name(text, ["size", "new", "unique", "shared", "tensors", "committed"])
    if columns == 120:  # room for everything the default view has
        assert [h.split()[0] for h in cols] == must + ["size", "new", "committed", "metrics"]


def test_ls_wide_shows_every_column(run, run_cli):
    local, remote = run
    code, text = run_cli("ls", str(local), "--remote", remote, "--wide", columns=80)
    assert code == 0 and "…" not in text, text
    cols = table_columns(text, "metrics")
    assert [h.split()[0] for h in cols] == ["step", "state", "tier", "size", "new", "unique", "shared", "tensors", "committed",
                                             "metrics"]
    rows = json.loads(run_cli("ls", str(local), "--remote", remote, "--json")[1])
    assert cols["committed UTC"] == [r.get("committed_at", "") for r in rows]  # the full time stamp
    assert cols["tensors"] == [str(r.get("tensors", "")) for r in rows]
    for header in [h for h in cols if h.split()[0] in ("unique", "shared")]:
        name, scale = header_unit(header)
        for cell, r in zip(cols[header], rows):
            assert_close(cell, scale, r.get(name), header)
    assert "--wide adds" not in text


# ----------------------------------------------------------------------------------------- inspect


@pytest.mark.parametrize("columns", [80, 120])
def test_inspect_fits_wrapping_long_keys(run, run_cli, columns):
    local, _ = run
    code, text = run_cli("inspect", str(local), columns=columns)
    assert code == 0, text
    assert_fits(text, columns)
    doc = json.loads(run_cli("inspect", str(local), "--json")[1])
    cols = table_columns(text, "key", joiner="")
    assert list(cols) == ["key", "dtype", "shape", "size", "chunks"]
    assert cols["key"] == [t["key"] for t in doc["tensors"]]  # wrapped after "/" or ".", never cut
    assert cols["chunks"] == [str(t["chunks"]) for t in doc["tensors"]]
    assert cols["shape"] == ["x".join(map(str, t["shape"])) for t in doc["tensors"]]
    for cell, t in zip(cols["size"], doc["tensors"]):  # a size per cell: tensors span bytes to gigabytes
        value, unit = cell.split()
        assert_close(value, SCALE[unit], t["bytes"], t["key"])
    if columns == 80:
        assert any(len(t["key"]) > 40 for t in doc["tensors"]) and "lr = 0.001" in text
    assert "--wide adds: shards, files" in " ".join(text.split())


def test_inspect_wide_shows_every_column_and_whole_keys(run, run_cli):
    local, _ = run
    code, text = run_cli("inspect", str(local), "--wide", columns=80)
    assert code == 0 and "…" not in text, text
    cols = table_columns(text)
    assert list(cols) == ["key", "dtype", "shape", "size", "chunks", "shards", "files"]
    assert f"model/{LONG_KEY}" in cols["key"] and set(cols["shards"]) == {"1"}


# ------------------------------------------------------------------------------------------ report


@pytest.mark.parametrize("columns", [80, 120])
def test_report_fits_and_shows_every_number(run, run_cli, columns):
    local, _ = run
    code, text = run_cli("report", str(local), columns=columns)
    assert code == 0, text
    assert_fits(text, columns)
    saves = json.loads(run_cli("report", str(local), "--json")[1])["saves"]
    cols = table_columns(text, "result")
    assert {"step", "result"} <= set(cols) and any(h.startswith("stall ") for h in cols) and any(h.startswith("total ") for h in cols)
    assert cols["step"] == [str(s["step"]) for s in saves]
    keys = {"stall": "stall_s", "slowdown": "slowdown_s", "upload": "upload_s", "total": "total_s", "written": "bytes_written",
            "overhead": "overhead_pct"}
    for header in cols:
        name, scale = header_unit(header)
        if name in keys:
            for cell, s in zip(cols[header], saves):
                assert_close(cell, scale, s[keys[name]], header)
    assert cols["result"][:-1] == ["ok"] * (len(saves) - 1)
    assert cols["result"][-1].replace(" ", "") == ("error " + saves[-1]["error"]).replace(" ", "")  # wrapped, whole
    assert "summary: 6 saves, 5 ok, 1 failed" in text and "time to first durable save" in text
    notes_name(text, ["tier", "wait prev", "stall", "snapshot", "write", "commit", "upload", "total", "written", "reused"])
    if columns == 120:
        assert [header_unit(h)[0] for h in cols] == ["step", "tier", "stall", "upload", "total", "written", "result"]


def test_report_wide_shows_every_recorded_column(run, run_cli):
    local, _ = run
    code, text = run_cli("report", str(local), "--wide", columns=80)
    assert code == 0 and "…" not in text, text
    names = [header_unit(h)[0] for h in table_columns(text)]
    assert names == ["step", "tier", "wait prev", "stall", "snapshot", "write", "commit", "upload", "total", "write", "upload",
                     "written", "reused", "result"]
    assert "MB/s" in table_columns(text) or any(h.endswith("MB/s") for h in table_columns(text))
    assert "--wide adds" not in text


def test_report_piped_and_on_a_terminal_say_the_same(run, run_cli):
    """`checkpointing report DIR | cat`: 80 columns, no colour codes, the same text as in-process at 80
    columns and as a terminal of 80 columns shows (less its colours)."""
    local, _ = run
    env = {k: v for k, v in child_env().items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TERM")}
    piped = subprocess.run([sys.executable, "-m", "checkpointing", "report", str(local)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert_fits(piped.stdout, 80)
    assert piped.stdout == run_cli("report", str(local), columns=80)[1]
    on_tty = _run_on_a_terminal([sys.executable, "-m", "checkpointing", "report", str(local)],
                                dict(env, COLUMNS="80", LINES="50", TERM="xterm-256color"))
    assert "\x1b[" in on_tty  # a terminal gets colours...
    plain = [line.rstrip() for line in lines_of(ANSI.sub("", on_tty).replace("\r\n", "\n"))]
    assert plain == [line.rstrip() for line in lines_of(piped.stdout)]  # ...and nothing else the pipe lacks


def _run_on_a_terminal(argv: list[str], env: dict[str, str]) -> str:
    """The output of `argv` run with a pseudo-terminal as its stdout."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdout=follower, stderr=subprocess.PIPE, env=env)
    os.close(follower)
    out = bytearray()
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    return out.decode()


def test_a_console_too_narrow_for_any_table_gets_it_whole(run, run_cli):
    local, _ = run
    for command in ("ls", "inspect", "report"):
        code, text = run_cli(command, str(local), columns=40)
        assert code == 0 and "…" not in text, text


# ------------------------------------------------------------------------------ the pure helpers


def test_a_column_unit_says_once_what_each_cell_leaves_out():
    assert fmt.time_unit([0.0964, 0.5, None]) == fmt.Unit("ms", 1e-3, 1) and fmt.time_unit([0.01, 2.5]).name == "s"
    assert [fmt.size_unit([v]).name for v in (0, 999, 1000, 37.8e6, 2e9, 5e12)] == ["B", "B", "KB", "MB", "GB", "TB"]
    ms, mb = fmt.time_unit([0.1]), fmt.size_unit([37.8e6])
    assert [ms(x) for x in (0.0964, 0.0, 0.00004, None)] == ["96.4", "0", "0.040", ""]
    assert [mb(x) for x in (37.8e6, 4100, 4, 0)] == ["37.8", "0.0041", "0.0000040", "0"]  # no nonzero number reads 0
    assert fmt.PERCENT(12.5) == "12.50" and fmt.MB_PER_S(5.3e8) == "530.0"


@given(st.text(alphabet="ab /._", max_size=80), st.integers(1, 30), st.sampled_from([" ", " /", "/."]))
def test_wrapping_keeps_every_character_but_the_spaces_it_breaks_at(text, width, breaks):
    lines = fmt.wrap(text, width, breaks).split("\n")
    assert all(len(line.rstrip(" ")) <= width for line in lines)
    assert "".join(lines).replace(" ", "") == text.replace(" ", "")


def test_fit_drops_the_least_needed_column_first_and_names_it():
    columns = [tables.Column("step"), tables.Column("a", "ms", drop=1), tables.Column("b", "MB", drop=2),
               tables.Column("c", default=False), tables.Column("msg", justify="left", flex=True, min_width=10)]
    rows = [["1", "12.5", "37.8", "x", "a message of some length"]]
    assert tables.fit(columns, rows, width=None).hidden == ("c",)
    assert tables.fit(columns, rows, width=None, wide=True).hidden == ()
    view = tables.fit(columns, rows, width=38)  # msg wraps to its floor before b goes
    assert view.hidden == ("c",) and view.width <= 38
    view = tables.fit(columns, rows, width=30)
    assert view.hidden == ("b MB", "c") and view.width <= 30
    console = Console(width=30, record=True)
    tables.show(console, view)
    text = console.export_text()
    assert "--wide adds: b MB, c" in " ".join(text.split()) and "…" not in text
    assert table_columns(text, "msg") == {"step": ["1"], "a ms": ["12.5"], "msg": ["a message of some length"]}


def test_keys_the_terminals_encoding_lacks_are_shown_escaped(tmp_path):
    d = tmp_path / "ck"
    with CheckpointManager(d) as mgr:
        mgr.save(1, {"模型": torch.ones(2), "v": {"ключ": 1}}).wait()
    env = {**child_env(), "PYTHONIOENCODING": "latin-1"}
    r = subprocess.run([sys.executable, "-m", "checkpointing", "inspect", str(d)], env=env, capture_output=True, text=True,
                       encoding="latin-1", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "\\u6a21\\u578b" in r.stdout and "v/\\u043a\\u043b\\u044e\\u0447 = 1" in r.stdout, r.stdout
