"""Crash safety: a child process saving every step is SIGKILLed at random points; after
each kill a fresh manager must see only complete steps, restore them bit-exactly, and
committed steps may only disappear through retention."""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from checkpointing import CheckpointManager

from _models import CrashNet, child_env, crash_const, crash_expected, step_dir_name

KEEP = 2

CHILD = textwrap.dedent(r"""
    import sys
    import torch
    torch.set_num_threads(1)
    from checkpointing import CheckpointManager
    from _models import crash_expected, crash_state, resume_crash_child

    ck = sys.argv[1]
    net, const, state = crash_state()
    mgr = CheckpointManager(ck, keep_local=%(keep)d)
    start = resume_crash_child(mgr, net, const, state)
    s = start + 1
    while True:
        vals = crash_expected(s)
        with torch.no_grad():
            for k, t in net.state_dict().items():
                t.copy_(vals[k])
        state["meta"] = {"step": s, "tag": "crash"}
        eager = s %% 3 == 0
        h = mgr.save(s, state, eager=eager)
        if not eager:
            h.wait_staged()   # after this, in-place writes to the params are safe
        s += 1
""") % {"keep": KEEP}


def _read_ready(p, timeout=60.0):
    t0 = time.monotonic()
    buf = ""
    while time.monotonic() - t0 < timeout:
        r, _, _ = select.select([p.stdout], [], [], 0.5)
        if r:
            line = p.stdout.readline()
            if not line:
                return None
            buf += line
            if line.startswith("READY "):
                return int(line.split()[1])
            if line.startswith("RESUME_MISMATCH"):
                raise AssertionError(f"child resumed wrong state: {line.strip()}")
        elif p.poll() is not None:
            return None
    raise AssertionError(f"child not ready after {timeout}s: {buf}")


def _check_dir(ck, prev_steps, prev_latest):
    """Invariants after a kill. Returns (steps, latest, had_incomplete)."""
    names = sorted(d.name for d in ck.iterdir() if d.is_dir() and d.name.startswith("step-"))
    incomplete = [n for n in names if not (ck / n / "COMMIT").exists()]
    with CheckpointManager(ck, keep_local=KEEP) as mgr:
        steps = mgr.steps()
        latest = mgr.latest_step()
        on_disk = sorted(int(d.name[5:]) for d in ck.iterdir()
                         if d.is_dir() and d.name.startswith("step-") and (d / "COMMIT").exists())
        assert steps == sorted(steps)
        assert set(steps) <= set(on_disk), f"steps() lists uncommitted steps: {steps} vs {on_disk}"
        assert steps == on_disk, f"steps() {steps} != committed dirs on disk {on_disk}"
        assert latest == (steps[-1] if steps else None)
        if prev_latest is not None:
            assert latest is not None and latest >= prev_latest, f"latest went back: {prev_latest} -> {latest}"
        for s in prev_steps:
            if s not in steps:
                newer = [t for t in steps if t > s]
                assert len(newer) >= KEEP, f"committed step {s} vanished without retention (now {steps})"
        assert len(steps) <= KEEP + 1, f"retention not applied: {steps}"
        # every listed step restores bit-exactly (never a half step)
        for s in steps:
            net = CrashNet()
            const = torch.zeros(512, 1024)
            st = {"model": net, "const": const, "meta": {"step": -1, "tag": ""}}
            assert mgr.restore(st, step=s) == s
            exp = crash_expected(s)
            sd = net.state_dict()
            for k, v in exp.items():
                assert torch.equal(sd[k], v), f"step {s}: {k} differs from what was saved at {s}"
            assert torch.equal(const, crash_const()), f"step {s}: const differs"
            assert st["meta"] == {"step": s, "tag": "crash"}, st["meta"]
        if steps:  # the default restore picks the newest
            st = {"model": CrashNet(), "const": torch.zeros(512, 1024), "meta": {"step": -1, "tag": ""}}
            assert mgr.restore(st) == latest
    return steps, latest, bool(incomplete)


@pytest.mark.slow
def test_sigkill_at_random_points(tmp_path):
    torch.set_num_threads(1)
    rng = random.Random(1234567)
    ck = tmp_path / "ck"
    script = tmp_path / "crash_child.py"
    script.write_text(CHILD)
    env = child_env()
    kills = 16
    prev_steps, prev_latest = [], None
    mid_write = 0
    progress = []
    for i in range(kills):
        errf = open(tmp_path / f"child{i}.err", "w")
        p = subprocess.Popen([sys.executable, str(script), str(ck)], stdout=subprocess.PIPE,
                             stderr=errf, text=True, env=env)
        try:
            started = _read_ready(p)
            if started is None:
                p.wait(10)
                raise AssertionError(f"child {i} died before READY rc={p.returncode}:\n"
                                     + (tmp_path / f"child{i}.err").read_text())
            assert started == (prev_latest or 0), f"child resumed at {started}, latest was {prev_latest}"
            kind = rng.random()
            if kind < 0.3:
                delay = rng.uniform(0.0, 0.05)
            elif kind < 0.7:
                delay = rng.uniform(0.05, 0.3)
            else:
                delay = rng.uniform(0.3, 0.8)
            time.sleep(delay)
            assert p.poll() is None, f"child {i} exited on its own rc={p.returncode}:\n" + \
                (tmp_path / f"child{i}.err").read_text()
            os.kill(p.pid, signal.SIGKILL)
            p.wait(30)
            assert p.returncode == -signal.SIGKILL
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            errf.close()
            p.stdout.close()
        prev_steps, prev_latest, incomplete = _check_dir(ck, prev_steps, prev_latest)
        mid_write += incomplete
        progress.append((round(delay, 3), prev_latest, incomplete))
    print(f"kills={kills} mid_write={mid_write} progress={progress}")
    assert prev_latest is not None and prev_latest >= kills // 2, f"too little progress: {progress}"
    assert mid_write >= 1, f"no kill landed during a write; the test did not exercise anything: {progress}"
