"""The README's demo, quick and without the s3 extra: `examples/demo.py --quick --remote none` crashes a
child mid-save, resumes, and ends with a directory that `checkpointing report` explains and `ls`
lists with each step's loss; s3fs and botocore cannot be imported by any of its processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.cells import cell_len

from _models import child_env
from test_packaging import BLOCK_S3
from test_report import table_columns

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


@pytest.mark.timeout(240)
def test_the_quick_demo_ends_with_a_directory_report_explains(tmp_path):
    shim = tmp_path / "no_s3"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(BLOCK_S3)  # every process the demo starts: its crashing child too
    env = child_env()
    env["PYTHONPATH"] = f"{shim}:{env['PYTHONPATH']}"
    env.pop("COLUMNS", None)
    ckpt = tmp_path / "run" / "ckpt"
    r = subprocess.run([sys.executable, str(DEMO), "--quick", "--remote", "none", "--dir", str(ckpt)], env=env,
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = " ".join(r.stdout.split())
    assert "run 1 died" in out and "mgr.restore() ->" in out and "max |loss difference| = 0.00e+00" in out, r.stdout[-3000:]
    assert f"checkpointing report {ckpt}" in out and f"checkpointing ls {ckpt}" in out, r.stdout[-1500:]
    assert " nan " not in f" {out} ", r.stdout[-3000:]  # a recovered save's unknown times are "-", never nan

    def cli(*argv: str) -> str:  # piped, as `checkpointing report DIR | cat` runs
        done = subprocess.run([sys.executable, "-m", "checkpointing", *argv], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        if "--json" not in argv:  # a table: 80 columns off a terminal, nothing cut
            assert all(cell_len(line) <= 80 for line in done.stdout.splitlines()) and "…" not in done.stdout, done.stdout
        return done.stdout

    text = cli("report", str(ckpt))
    saves = json.loads(cli("report", str(ckpt), "--json"))["saves"]
    cols = table_columns(text, "result")
    assert cols["step"] == [str(s["step"]) for s in saves] and {9, 12} <= {s["step"] for s in saves}  # run 2's saves at least
    assert set(cols["result"]) == {"ok"} and any(h.startswith("stall ") for h in cols), text
    assert f"summary: {len(saves)} saves, {len(saves)} ok, 0 failed" in text
    listed = table_columns(cli("ls", str(ckpt)), "metrics")
    assert listed["step"] == ["6", "9", "12"] and all(m.startswith("loss=") for m in listed["metrics"]), listed
