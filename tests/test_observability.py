"""Observability and preemption on real training loops: step accounting consistent across stats(),
metrics.jsonl, the callback and `checkpointing report`; interval="auto"; SIGTERM delivered to a
real training process at random moments and mid-save."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import select
import signal
import statistics
import subprocess
import sys
import textwrap
import shutil
import time

import pytest
import torch

from _dist import run_ranks
from _models import CrashNet, child_env, crash_const, crash_expected
from checkpointing import CheckpointConfigError, CheckpointManager, CheckpointUploadError
from checkpointing.plan import advice
from checkpointing.cli.app import main
from checkpointing.plan.schedule import SaveSchedule


def mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(64, 256)).pow(2).mean().backward()
    opt.step()  # the manager's optimizer pre-hook marks the step boundary
    opt.zero_grad()


def test_step_accounting_is_the_same_in_stats_metrics_callback_and_report(tmp_path, one_torch_thread, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # the report's content is checked here, not how it fits 80 columns
    model, opt = mlp()
    state = {"model": model, "optim": opt, "step": 0}
    records = []
    ck = tmp_path / "ck"
    with CheckpointManager(ck, keep_local=2, on_metrics=records.append) as mgr:
        for step in range(1, 41):
            train_step(model, opt)
            state["step"] = step
            if step % 8 == 0:
                mgr.save(step, state)
    stats = mgr.stats()  # after close(): every save durable and its cost final
    summary = mgr.summary()
    assert [s.step for s in stats] == [8, 16, 24, 32, 40]
    for s in stats:
        assert None not in (s.step_stall_s, s.slowdown_s, s.cost_s, s.overhead_pct, s.step_time_s), s
        # the stall inside the step is what save() and the guard blocked, including waiting for the previous save
        assert s.step_stall_s == pytest.approx(s.wait_prev_s + s.stall_s, abs=1e-9)
        assert s.cost_s == pytest.approx(s.step_stall_s + s.slowdown_s)
        # (overhead_pct is not bounded by 100: on a busy machine a save can cost more than the steps between saves)
        assert s.slowdown_s >= 0 and s.overhead_pct > 0 and s.step_time_s > 0
    assert stats[0].time_to_first_durable_s > 0 and all(s.time_to_first_durable_s is None for s in stats[1:])
    # one complete line per save in metrics.jsonl, and the same dicts, in order, to the callback
    lines = [json.loads(x) for x in (ck / "metrics.jsonl").read_text().splitlines()]
    assert lines == [s.as_dict() for s in stats] == records
    # the run: 40 optimizer steps are 39 ended steps (the last one is still open at close)
    assert summary.steps == 39 and summary.saves == 5 and summary.pending == 0
    assert summary.cost_s == pytest.approx(sum(s.cost_s for s in stats))
    assert summary.overhead_pct == pytest.approx(summary.cost_s / summary.wall_s * 100)
    assert summary.time_to_first_durable_s == stats[0].time_to_first_durable_s
    # the report reads the same numbers
    capsys.readouterr()
    assert main(["report", str(ck), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for row, s in zip(doc["saves"], stats, strict=True):
        for key in ("step", "wait_prev_s", "stall_s", "step_stall_s", "slowdown_s", "cost_s", "overhead_pct", "step_time_s"):
            assert row[key] == pytest.approx(s[key]), key
    assert doc["summary"]["time_to_first_durable_s"] == pytest.approx(summary.time_to_first_durable_s)
    assert doc["summary"]["slowdown_s"]["max"] == pytest.approx(max(s.slowdown_s for s in stats))
    assert main(["report", str(ck)]) == 0
    text = capsys.readouterr().out
    assert "step stall" in text and "slowdown" in text and "overhead" in text and "time to first durable save" in text


def test_explicit_steps_measure_the_loops_own_step_time(tmp_path):
    """mgr.step() in a loop without an optimizer, as a call and as a context manager."""
    work = 0.02
    with CheckpointManager(tmp_path / "a") as mgr:
        for step in range(1, 21):
            mgr.step(step)  # the bare call: step `step` begins, the previous one ends
            time.sleep(work)
            if step % 5 == 0:
                mgr.save(step, {"w": torch.full((1 << 16,), float(step))})
    stats = mgr.stats()
    assert mgr.summary().steps == 19
    for s in stats:
        assert s.step_time_s == pytest.approx(work, rel=0.5)  # sleep-bound steps: the median is the sleep
    with CheckpointManager(tmp_path / "b") as mgr:
        for step in range(1, 11):
            with mgr.step(step):
                time.sleep(work)
                if step == 5:
                    mgr.save(step, {"w": torch.zeros(1 << 16)})
        assert mgr.summary().steps == 10
    [s] = mgr.stats()
    assert s.step_time_s == pytest.approx(work, rel=0.5) and s.step_stall_s == pytest.approx(s.wait_prev_s + s.stall_s)


def test_only_the_first_optimizer_marks_steps(tmp_path, one_torch_thread):
    """A loop with two optimizers (a GAN) has one step per iteration, not two."""
    g, d = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    with CheckpointManager(tmp_path) as mgr:
        for _ in range(12):
            d(g(torch.randn(4, 8))).sum().backward()
            od.step()
            og.step()
        assert mgr.summary().steps == 11


def test_without_marked_steps_records_have_no_step_fields(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        s = mgr.save(1, {"w": torch.zeros(10)}).wait()
        assert s.step_stall_s is None and s.slowdown_s is None and s.time_to_first_durable_s > 0
        # written before wait() returned, as it always was when no step is open
        assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1


def test_a_failing_callback_is_logged_and_saving_goes_on(tmp_path, caplog):
    calls = []

    def broken(record):
        calls.append(record["step"])
        raise RuntimeError("dashboard down")

    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        with CheckpointManager(tmp_path, on_metrics=broken) as mgr:
            for step in (1, 2, 3):
                assert mgr.save(step, {"w": torch.zeros(10)}).wait().ok
    assert calls == [1, 2, 3] and mgr.steps() == [2, 3]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert caplog.text.count("RuntimeError: dashboard down") == 1 and "raised 3 times" in caplog.text


def test_a_callback_that_blocks_holds_back_no_line_of_metrics_jsonl(tmp_path, one_torch_thread):
    """A slow on_metrics (a network logger) delays neither the lines of metrics.jsonl nor the saves: every record whose
    cost is final is in the file while the callback still blocks on the first one (a process killed then has written
    them; the next manager could not recover a step retention removed). close() delivers the rest, in order."""
    import threading

    release, calls = threading.Event(), []

    def stuck(record):
        calls.append(record["step"])
        release.wait(300)

    model, opt = mlp()
    ck = tmp_path / "ck"
    mgr = CheckpointManager(ck, keep_local=2, on_metrics=stuck)
    try:
        for step in range(1, 26):
            train_step(model, opt)  # the optimizer hook marks steps: records are finished at these boundaries
            if step % 4 == 0:
                mgr.save(step, {"model": model, "optim": opt}).wait()
        final = [s.step for s in mgr.stats() if s.cost_s is not None]
        assert final[:5] == [4, 8, 12, 16, 20], final

        def written() -> list[int]:
            path = ck / "metrics.jsonl"
            return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []

        deadline = time.monotonic() + 120  # a bound for a hang, not a timing
        while written() != final and time.monotonic() < deadline:
            time.sleep(0.02)
        assert written() == final and calls == [4]  # the callback is still on the first record
    finally:
        release.set()
        mgr.close()
    assert calls == [4, 8, 12, 16, 20, 24] and written() == calls


@pytest.mark.parametrize("kwargs, option", [
    ({"interval": 0}, "interval"), ({"interval": "sometimes"}, "interval"), ({"interval": True}, "interval"),
    ({"interval": "auto"}, "mtbf_s"), ({"interval": "auto", "mtbf_s": -1.0}, "mtbf_s"), ({"mtbf_s": 3600.0}, "mtbf_s"),
    ({"on_metrics": "wandb"}, "on_metrics"),
    ({"interval": "auto", "mtbf_s": 1e308}, "mtbf_s"), ({"interval": "auto", "mtbf_s": 10**400}, "mtbf_s"),  # inf; past a float
    ({"background_yield_s": 10**400}, "background_yield_s"), ({"reverify_bytes_per_s": 10**400}, "reverify_bytes_per_s"),
    ({"upload_bytes_per_s": 10**400, "remote": "memory://bad-options"}, "upload_bytes_per_s"),
])
def test_bad_options_name_the_option(tmp_path, kwargs, option):
    with pytest.raises(CheckpointConfigError, match=option):
        CheckpointManager(tmp_path, **kwargs)


def test_should_save_every_n_steps_and_without_a_schedule(tmp_path):
    with CheckpointManager(tmp_path, interval=3) as mgr:
        assert [s for s in range(1, 13) if mgr.should_save(s)] == [3, 6, 9, 12]
        assert mgr.interval_steps == 3
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointConfigError, match="interval"):
            mgr.should_save(1)
        assert mgr.interval_steps is None


def test_auto_schedule_by_hand():
    """SaveSchedule on hand-computed numbers: C = 0.5 s, M = 1800 s: Young sqrt(2 * 0.5 * 1800) = 42.43 s;
    Daly = 42.43 * (1 + sqrt(0.5/3600)/3 + (0.5/3600)/9) - 0.5 = 42.10 s = 421 steps of 0.1 s."""
    sched = SaveSchedule("auto", 1800.0)
    assert sched.due(7)  # no save yet in this run: the first opportunity
    sched.saved(7)
    assert not sched.due(8) and not sched.due(10_000)  # not measured yet: wait for the measurement
    assert sched.observe(0.5, None) is None  # no step time yet
    assert sched.observe(0.5, 0.1) == 421
    assert sched.advice.daly_s == pytest.approx(42.1, abs=0.01)
    assert not sched.due(7 + 420) and sched.due(7 + 421)
    sched.observe(2.0, 0.1)  # median of (0.5, 0.5, 2.0) is still 0.5: one slow save does not move it
    assert sched.every_steps == 421
    follower = SaveSchedule("auto", 1800.0, follow=False)  # a rank that takes rank 0's value
    follower.saved(0)
    follower.observe(0.5, 0.1)
    assert follower.proposed == 421 and follower.every_steps is None and not follower.due(500)
    follower.adopt(421, from_step=450)
    assert not follower.due(449) and follower.due(450)
    assert SaveSchedule(4).due(8) and not SaveSchedule(4).due(9)
    failing = SaveSchedule("auto", 1800.0)  # the first save failed before it was measured: the next opportunity saves
    failing.saved(3)
    failing.failed()
    assert failing.due(4)
    sched.failed()  # with an interval in use, a failure keeps it
    assert sched.every_steps == 421 and not sched.due(7 + 420)


def test_interval_auto_keeps_saving_while_every_upload_fails(tmp_path):
    """Each step is committed locally while its upload fails (the remote URL comes to lie under a regular
    file once the manager started: refused at start): the loop pays for the saves all the same, so they are
    measured, and the interval holds."""
    saves, raised = [], 0
    with CheckpointManager(tmp_path / "ck", interval="auto", mtbf_s=0.2, remote=f"file://{tmp_path / 'blocked' / 'r'}") as mgr:
        shutil.rmtree(tmp_path / "blocked", ignore_errors=True)
        (tmp_path / "blocked").write_text("a file where the remote tier's directory should be")
        for step in range(1, 3001):
            with mgr.step(step):
                time.sleep(0.01)
                if mgr.should_save(step):
                    try:
                        mgr.save(step, {"w": torch.full((1 << 16,), float(step))})
                    except CheckpointUploadError:
                        raised += 1  # the upload before last failed: reported here, as documented
                    saves.append(step)
            if len(saves) == 5:
                break
        with pytest.raises(CheckpointUploadError):
            mgr.wait()
    assert len(saves) == 5 and mgr.interval_steps is not None, (saves, mgr.interval_steps)
    assert raised >= 1 and all(not s.ok and s.committed and s.tier == "local" for s in mgr.stats()), mgr.stats()


def test_interval_auto_saves_at_once_then_at_dalys_interval(tmp_path):
    mtbf = 0.2  # seconds: Daly's interval is at most M, so at most 20 steps of 10 ms here
    saves, intervals = [], []
    with CheckpointManager(tmp_path, interval="auto", mtbf_s=mtbf) as mgr:
        # until six saves: the second comes only once the first is durable and measured, which on a
        # busy machine (its threads at SCHED_IDLE behind other processes) can take many 10 ms steps
        for step in range(1, 3001):
            with mgr.step(step):
                time.sleep(0.01)
                if mgr.should_save(step):
                    intervals.append(mgr.interval_steps)
                    saves.append(step)
                    mgr.save(step, {"w": torch.full((1 << 18,), float(step))})
            if len(saves) == 6:
                break
    stats, k = mgr.stats(), mgr.interval_steps  # after close(): the last save's cost is in too
    assert saves[0] == 1 and intervals[0] is None  # the first opportunity, before any measurement
    assert intervals[1] is not None  # the second waits for the first's measured cost
    # Daly's interval is at most M = 0.2 s and a step takes at least its 10 ms sleep, so the interval
    # in use is 1..20 steps however busy the machine is (a busy machine makes steps longer: more saves)
    assert all(1 <= every <= 20 for every in intervals[1:]), intervals
    for prev, step, every in zip(saves[1:], saves[2:], intervals[2:]):
        assert step - prev >= 1 and every is not None
    assert len(saves) == 6, saves  # the count cannot collapse: gaps stay near an interval of at most 20 steps
    # the interval in use is Daly's for the median cost of the measured saves (as the report computes it)
    costs = [s.step_stall_s - s.wait_prev_s + s.slowdown_s for s in stats if s.slowdown_s is not None][-15:]
    expected = advice.advise(statistics.median(costs), mtbf, step_time_s=stats[-1].step_time_s).every_steps
    assert k == expected


def auto_interval_worker(rank: int, world: int, directory: str) -> tuple[list[int], int | None]:
    """Ranks in lockstep (an all-reduce per step, like data-parallel training) with interval="auto"."""
    import torch.distributed as dist

    saves = []
    with CheckpointManager(directory, interval="auto", mtbf_s=0.3) as mgr:  # at most 0.3 s: a save every few steps
        for step in range(1, 3001):  # until four saves (every rank gets the same answers, so all stop together)
            with mgr.step(step):
                time.sleep(0.005 * (1 + 2 * rank))  # the ranks measure different numbers of their own
                dist.all_reduce(torch.ones(1))
                if mgr.should_save(step):
                    saves.append(step)
                    mgr.save(step, {"w": torch.full((1 << 17,), float(step))})
            if len(saves) == 4:
                break
        return saves, mgr.interval_steps


def test_ranks_agree_on_the_auto_interval(tmp_path):
    (saves0, k0), (saves1, k1) = run_ranks(auto_interval_worker, 2, str(tmp_path / "ck"), tmp=tmp_path)
    assert saves0 == saves1 and k0 == k1 and k0 is not None, (saves0, saves1, k0, k1)
    assert saves0[0] == 1 and len(saves0) == 4, saves0


# ---------------------------------------------------------------------- preemption


def preempted_worker(rank: int, world: int, directory: str, signal_at: int) -> dict:
    """Rank 0 alone gets SIGTERM during step `signal_at`; rank 1 must stop at the same step."""
    import torch.distributed as dist

    state = {"w": torch.zeros(1 << 18), "step": 0}
    mgr = CheckpointManager(directory, interval=5)
    mgr.handle_preemption(state, grace_s=30.0)
    done = []
    try:
        for step in range(1, 10_000):
            dist.all_reduce(torch.ones(1))
            mgr.wait_staged()
            state["w"].fill_(float(step))
            state["step"] = step
            if rank == 0 and step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if mgr.should_save(step):
                mgr.save(step, state)
            done.append(step)
    except SystemExit as exc:
        return {"code": exc.code, "last_done": done[-1], "steps": mgr.steps()}
    return {"code": None, "last_done": done[-1], "steps": mgr.steps()}


def test_sigterm_to_one_rank_stops_every_rank_at_one_saved_step(tmp_path):
    ck = str(tmp_path / "ck")
    r0, r1 = run_ranks(preempted_worker, 2, ck, 12, tmp=tmp_path, timeout=120.0)
    assert r0["code"] == r1["code"] == 128 + signal.SIGTERM, (r0, r1)
    # rank 0 proposed step 13 (its step at the signal + 1): both finished step 12 and stopped at step 13's should_save
    assert r0["last_done"] == r1["last_done"] == 12, (r0, r1)
    assert r0["steps"] == r1["steps"] and r0["steps"][-1] == 13, (r0, r1)
    with CheckpointManager(ck) as mgr:  # saved on 2 ranks, restored here on 1
        state = {"w": torch.zeros(1 << 18), "step": 0}
        assert mgr.restore(state) == 13 and state["step"] == 13 and torch.equal(state["w"], torch.full((1 << 18,), 13.0))


GRACE_S = 20.0

PREEMPT_CHILD = textwrap.dedent(r"""
    import sys
    import torch
    torch.set_num_threads(1)
    from checkpointing import CheckpointManager
    from _models import crash_expected, crash_state, resume_crash_child

    ck, mode, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
    net, const, state = crash_state()
    mgr = CheckpointManager(ck, keep_local=3, interval=2)
    mgr.handle_preemption(state, grace_s=grace)
    start = resume_crash_child(mgr, net, const, state)

    def work(s):
        mgr.wait_staged()  # the async snapshot of the previous save may still read the parameters
        vals = crash_expected(s)
        with torch.no_grad():
            for k, t in net.state_dict().items():
                t.copy_(vals[k])
        state["meta"] = {"step": s, "tag": "crash"}

    s = start + 1
    while True:
        if mode == "should_save":
            work(s)
            if mgr.should_save(s):  # a safe point: after the signal it saves step s and exits
                print(f"SAVING {s}", flush=True)
                mgr.save(s, state, eager=s % 4 == 0)
        else:
            with mgr.step(s):  # its end is a safe point
                work(s)
                if s % 2 == 0:
                    print(f"SAVING {s}", flush=True)
                    mgr.save(s, state)
        print(f"DONE {s}", flush=True)
        s += 1
""")


class Child:
    """A training child process and the lines it printed."""

    def __init__(self, script, ck, mode, tmp_path, i):
        self.err_path = tmp_path / f"child{i}.err"
        self.err = open(self.err_path, "w")
        self.p = subprocess.Popen([sys.executable, str(script), str(ck), mode, str(GRACE_S)], stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, env=child_env())
        self.done: list[int] = []
        self.started: int | None = None

    def read(self, timeout: float, until: str | None = None) -> bool:
        """Read lines for up to `timeout` s (0: what is there now); True when a line starts with `until`."""
        end = time.monotonic() + timeout
        while True:
            r, _, _ = select.select([self.p.stdout], [], [], max(0.0, end - time.monotonic()))
            if not r:
                return False
            line = self.p.stdout.readline()
            if not line:
                return False
            word, _, arg = line.strip().partition(" ")
            if word == "RESUME_MISMATCH":
                raise AssertionError(f"the child resumed a wrong state: {line.strip()}")
            if word == "READY":
                self.started = int(arg)
            elif word == "DONE":
                self.done.append(int(arg))
            if until is not None and word == until:
                return True

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.p.stdout.close()
        self.err.close()


def committed_and_incomplete(ck):
    dirs = [d for d in ck.iterdir() if d.is_dir() and d.name.startswith("step-")]
    return (sorted(int(d.name[5:]) for d in dirs if (d / "COMMIT").exists()),
            sorted(int(d.name[5:]) for d in dirs if not (d / "COMMIT").exists()))


def test_sigterm_at_random_moments_saves_the_latest_step_and_exits(tmp_path, capsys):
    rng = random.Random(20261121)
    ck = tmp_path / "ck"
    script = tmp_path / "preempt_child.py"
    script.write_text(PREEMPT_CHILD)
    latest = None
    log = []
    for i in range(6):
        mode = ("should_save", "step")[i % 2]
        mid_save = i % 3 == 1  # as save() begins: the signal lands while that save is in flight
        child = Child(script, ck, mode, tmp_path, i)
        try:
            assert child.read(60.0, until="READY"), f"child {i} not ready:\n{child.err_path.read_text()}"
            assert child.started == (latest or 0), f"child {i} resumed at {child.started}, the latest step was {latest}"
            child.read(rng.uniform(0.1, 0.8))
            if mid_save:
                assert child.read(10.0, until="SAVING")
            child.read(0.0)
            assert child.p.poll() is None, child.err_path.read_text()
            in_flight = committed_and_incomplete(ck)[1]
            last_done = child.done[-1] if child.done else child.started
            t0 = time.monotonic()
            child.p.send_signal(signal.SIGTERM)
            rc = child.p.wait(GRACE_S + 10)
            took = time.monotonic() - t0
            child.read(1.0)
        finally:
            child.close()
        err = child.err_path.read_text()
        in_flight = bool(in_flight) or "finishing the in-flight save" in err
        assert rc == 128 + signal.SIGTERM, f"child {i} exited with {rc}:\n{err}"
        assert took < GRACE_S, f"child {i} took {took:.1f} s to exit"
        committed, incomplete = committed_and_incomplete(ck)
        assert not incomplete, f"an in-flight save was left incomplete: {incomplete}"
        with CheckpointManager(ck, keep_local=3) as mgr:  # the next start restores it, bit for bit
            net = CrashNet()
            restored = {"model": net, "const": torch.zeros(512, 1024), "meta": {}}
            step = mgr.restore(restored)
        assert step == committed[-1] and step >= last_done, f"restored {step}, the child had finished step {last_done}"
        assert step <= max(child.done, default=child.started) + 1  # never a step the child had not reached
        assert restored["meta"] == {"step": step, "tag": "crash"} and torch.equal(restored["const"], crash_const())
        assert all(torch.equal(net.state_dict()[k], v) for k, v in crash_expected(step).items())
        assert main(["verify", str(ck)]) == 0, capsys.readouterr().out
        latest = step
        log.append((mode, mid_save, in_flight, last_done, step, round(took, 2)))
    print("deliveries (mode, sent after SAVING, save in flight, last done, restored, exit s):", log)
    assert sum(1 for entry in log if entry[2]) >= 2, f"fewer than two signals landed during a save: {log}"


def test_verify_and_gc_show_a_progress_bar_on_a_terminal_only(tmp_path, monkeypatch, capsys):
    import io

    from checkpointing.cli import app as cli

    with CheckpointManager(tmp_path, keep_local=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((1 << 12,), float(step))})
    (tmp_path / "step-0000000009").mkdir()  # an incomplete step: garbage for gc
    (tmp_path / "step-0000000009" / "r00000.x.pack").write_bytes(b"x" * 10)
    screen = io.StringIO()
    real = cli.Console
    monkeypatch.setattr(cli, "Console", lambda **kw: real(file=screen, force_terminal=True, width=100, **kw))
    assert main(["verify", str(tmp_path)]) == 0
    assert main(["gc", str(tmp_path), "--min-age-s", "0"]) == 0
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # without the terminal's colour codes
    assert "verifying steps" in drawn and "3/3" in drawn and "removing" in drawn and "all 3 step(s) verified" in drawn
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 0  # not a terminal: the plain lines, no bar
    out = capsys.readouterr().out
    assert "verifying steps" not in out and "\x1b[" not in out and out.count("ok") == 3 and "all 3 step(s) verified" in out


def test_stats_keeps_the_newest_records_and_metrics_jsonl_keeps_all(tmp_path, monkeypatch):
    from checkpointing.save import records

    monkeypatch.setattr(records, "KEPT", 3)  # 10,000 in use: a long run's stats() must not grow without bound
    state = {"w": torch.zeros(64)}
    with CheckpointManager(tmp_path) as mgr:
        for step in range(1, 6):
            state["w"] += 1
            mgr.save(step, state).wait()
        mgr.wait()
        assert [s.step for s in mgr.stats()] == [3, 4, 5]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5]


_KILLED_AFTER_COMMIT = textwrap.dedent(r"""
    import sys, time, torch
    from pathlib import Path
    from checkpointing import CheckpointManager
    local, remote = sys.argv[1], (sys.argv[2] or None)
    mgr = CheckpointManager(local, remote=remote, upload_bytes_per_s=1e6 if remote else None)
    w = torch.zeros(1 << 20)
    for step in (1, 2):
        mgr.step(step)  # marked steps: a record waits for the steps after its save
        w += 1
        h = mgr.save(step, {"w": w})
        if step == 1:
            h.wait()
            for s in (2, 3):  # the steps after save 1 end: its record is final and written
                mgr.step(100 + s)
            mgr.step(200)
    while not (Path(local) / "step-0000000002" / "COMMIT").exists():
        time.sleep(0.01)
    print("committed", flush=True)  # step 2's record is not final yet (and, with a remote tier, its upload not done)
    time.sleep(120)
""")


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_a_save_committed_by_a_killed_process_is_recorded_by_the_next_one(tmp_path, remote, capsys, monkeypatch):
    local, url = tmp_path / "ck", (tmp_path / "remote").as_uri() if remote else ""
    child = subprocess.Popen([sys.executable, "-c", _KILLED_AFTER_COMMIT, str(local), url], stdout=subprocess.PIPE, text=True,
                             env=child_env())
    try:
        assert child.stdout.readline().strip() == "committed"
    finally:
        child.kill()
        child.wait()
    lines = [json.loads(x) for x in (local / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1]  # the killed process recorded step 1 only
    with CheckpointManager(local, remote=url or None) as mgr:
        mgr.wait()  # with a remote tier: the resumed upload of step 2
        assert mgr.tiers()[2] == ("local+remote" if remote else "local")
    lines = [json.loads(x) for x in (local / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["recovered"]) for r in lines] == [(1, False), (2, True)]
    rec = lines[1]
    assert rec["ok"] and rec["committed"] and rec["tier"] == ("local+remote" if remote else "local")
    assert rec["bytes_total"] == 4 << 20 and rec["bytes_written"] >= 4 << 20 and rec["stall_s"] is None and rec["total_s"] is None
    assert (rec["upload_s"] is not None) == remote
    with CheckpointManager(local, remote=url or None) as mgr:  # a third start records nothing again
        pass
    assert len((local / "metrics.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["report", str(local)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the notes wrap
    assert "ok (recovered)" in out and "recovered: committed by a process killed" in out


_PRUNED_THEN_KILLED = textwrap.dedent(r"""
    import os, signal, sys, torch
    from checkpointing import CheckpointManager
    phase, local, remote = sys.argv[1:4]
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # optimizer.step() marks steps
    mgr = CheckpointManager(local, remote=remote, keep_local=1, keep_remote=None, upload_bytes_per_s=2e6)
    state = {"model": model, "optim": opt}
    start = mgr.restore(state) or 0
    for s in range(start + 1, start + 4):
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        opt.zero_grad()
        h = mgr.save(s, state)
        if phase == "kill" and s == start + 2:  # durable on both tiers, then killed before a step ends its cost
            h.add_done_callback(lambda _: os.kill(os.getpid(), signal.SIGKILL))
    mgr.close()
""")


def test_a_killed_process_s_saves_that_local_retention_removed_are_recovered_from_the_remote_tier(tmp_path):
    local, remote = tmp_path / "ck", (tmp_path / "remote").as_uri()

    def run(phase: str) -> int:
        return subprocess.run([sys.executable, "-c", _PRUNED_THEN_KILLED, phase, str(local), remote], env=child_env(),
                              timeout=300).returncode

    assert run("clean") == 0  # steps 1-3, each recorded
    assert run("kill") == -signal.SIGKILL  # steps 4 and 5 durable on both tiers, unrecorded; keep_local=1 left 5 (or 6) locally
    assert run("resume") == 0
    lines = [json.loads(x) for x in (local / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((r["step"], r["recovered"]) for r in lines)
    assert [s for s, _ in steps] == sorted({s for s, _ in steps}) and {4, 5} <= {s for s, rec in steps if rec}, steps
    assert all(r["tier"] == "local+remote" and r["ok"] for r in lines if r["step"] in (4, 5))


def test_a_signal_handler_installed_before_that_returns_lets_training_go_on(tmp_path):
    """The emergency save of step 20 calls the earlier handler, which returns: the loop goes on, should_save(20)
    does not save step 20 again, and close() after the grace period waits for the saves as usual."""
    seen: list[int] = []
    earlier = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        state = {"w": torch.zeros(4)}
        with CheckpointManager(tmp_path / "ck", interval=10) as mgr:
            mgr.handle_preemption(state, grace_s=0.2, signals=(signal.SIGUSR1,))
            for step in range(1, 41):
                state["w"] += 1
                if step == 20:
                    os.kill(os.getpid(), signal.SIGUSR1)  # just before the safe point of step 20
                if mgr.should_save(step):
                    mgr.save(step, state)
            time.sleep(0.3)  # past the grace period
        assert seen == [signal.SIGUSR1]
        with CheckpointManager(tmp_path / "ck", read_only=True) as mgr:
            assert mgr.steps() == [30, 40]  # keep_local=2; 10 and 20 were saved once each
    finally:
        signal.signal(signal.SIGUSR1, earlier)


TWICE_CHILD = textwrap.dedent(r"""
    import sys, time
    import torch
    from checkpointing import CheckpointManager

    state = {"w": torch.zeros(4)}
    try:
        with CheckpointManager(sys.argv[1], interval=5) as mgr:
            mgr.handle_preemption(state, grace_s=20)
            for step in range(1, 10**6):
                state["w"] += 1
                if mgr.should_save(step):
                    mgr.save(step, state)
                print(f"DONE {step}", flush=True)
                time.sleep(0.01)
    finally:
        print("CLEANUP", flush=True)
        time.sleep(1.0)  # the launcher forwards the signal again meanwhile
        print("CLEANED", flush=True)
""")


def test_a_second_sigterm_during_the_exit_is_ignored(tmp_path):
    """A launcher forwards the signal the process group already got: the process still exits 143, its
    finally clauses run."""
    script = tmp_path / "twice.py"
    script.write_text(TWICE_CHILD)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck")], stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        lines = []
        for line in p.stdout:
            lines.append(line.strip())
            if line.startswith("DONE 7"):
                p.send_signal(signal.SIGTERM)
            if line.startswith("CLEANUP"):
                p.send_signal(signal.SIGTERM)
                break
        rc = p.wait(60)
        lines += [line.strip() for line in p.stdout]
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()
    assert rc == 128 + signal.SIGTERM and lines[-1] == "CLEANED", (rc, lines[-3:])
