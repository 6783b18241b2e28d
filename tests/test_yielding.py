"""background_yield_s: a save's background threads give the CPU to the training loop until something waits.

Checked on the threads' real scheduling policy (os.sched_getscheduler on their kernel thread ids), in
a real training loop with a real CheckpointManager: at normal priority for the copy (the guard waits
for it), low (SCHED_IDLE) once the snapshot is staged and while nothing waits for the save, normal
again when anything waits for it (handle.wait(), wait(), the next save(), close()) or the deadline
passes; the tensors saved meanwhile are the ones restored.
Where the process may not raise a priority back (a child process without CAP_SYS_NICE), nothing is
lowered and saves report yielded_s None.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn as nn

from checkpointing import CheckpointManager, load
from checkpointing.errors import CheckpointConfigError
from checkpointing.save.job import SaveOutcome
from checkpointing.save.yielding import CpuYield, can_yield

from _models import child_env

needs_yield = pytest.mark.skipif(not can_yield(), reason="this process may not raise a thread's priority back (SCHED_IDLE)")
IDLE, OTHER = getattr(os, "SCHED_IDLE", -1), getattr(os, "SCHED_OTHER", -1)


def _policy(name: str, among: set[threading.Thread] | None = None) -> int | None:
    """The scheduling policy of the live thread called `name`, not one of `among` (threads that
    were there before: managers of earlier tests may not have been closed) (None: no such thread)."""
    for t in threading.enumerate():
        if t.name == name and t.native_id is not None and (among is None or t not in among):
            try:
                return os.sched_getscheduler(t.native_id)
            except OSError:
                return None
    return None


def _until(cond, what: str, timeout: float = 120.0) -> None:
    """Wait for `cond()` (a condition, not a timing: the timeout only keeps a broken build from hanging)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.005)


class _Worker:
    """A thread registered with a CpuYield, kept alive until stopped."""

    def __init__(self, cpu: CpuYield) -> None:
        self.cpu, self.stop, self.ready = cpu, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="test-yield-worker", daemon=True)
        self.thread.start()
        self.ready.wait()

    def _run(self) -> None:
        self.cpu.enter()
        self.ready.set()
        self.stop.wait()
        self.cpu.leave()

    def policy(self) -> int:
        return os.sched_getscheduler(self.thread.native_id)

    def end(self) -> None:
        self.stop.set()
        self.thread.join()


@needs_yield
def test_lower_and_hurry_move_registered_threads_between_idle_and_normal():
    cpu = CpuYield(60.0)
    w = _Worker(cpu)
    try:
        assert w.policy() == OTHER
        cpu.lower()
        assert w.policy() == IDLE and cpu.low
        late = _Worker(cpu)  # a thread entering while low is lowered too
        assert late.policy() == IDLE
        cpu.hurry()
        assert w.policy() == OTHER and late.policy() == OTHER and not cpu.low
        late.end()
        cpu.lower()
        assert w.policy() == IDLE
        assert cpu.committed() >= 0.0  # the deadline is dropped, the thread stays low
        assert w.policy() == IDLE and cpu.low
        cpu.close()
        assert w.policy() == OTHER
    finally:
        cpu.hurry()
        w.end()
    # a thread that left is not touched again (its id may belong to another thread by then)
    assert late.thread.native_id not in cpu._tids and w.thread.native_id not in cpu._tids


@needs_yield
def test_a_job_waited_for_is_not_lowered_and_a_thread_that_ended_is_forgotten():
    """A waiter marks its job before hurry(): a lower() that comes after (the snapshot staged, an
    upload starting) leaves the threads at normal priority. A pool thread that ended without
    leave() is dropped, never set again (its id may name another thread by then)."""
    cpu = CpuYield(60.0)
    w = _Worker(cpu)
    waited = [False]
    cpu.waited = lambda: waited[0]
    try:
        cpu.lower()
        assert w.policy() == IDLE and cpu.low
        waited[0] = True  # SaveOutcome.wait() / UploadJob.wait(): marked, then hurry()
        cpu.hurry()
        cpu.lower()
        assert w.policy() == OTHER and not cpu.low
        waited[0] = False  # the next job
        gone = threading.Thread(target=cpu.enter)  # registers, then ends without leave()
        gone.start()
        gone.join()
        assert gone.native_id in cpu._tids
        cpu.lower()
        assert w.policy() == IDLE and gone.native_id not in cpu._tids
    finally:
        cpu.close()
        w.end()


@needs_yield
def test_a_thread_started_by_a_lowered_one_follows_hurry():
    """The write-behind thread is started by ckpt-io, possibly while it is low: it inherits
    SCHED_IDLE, and must still be raised by hurry()."""
    cpu = CpuYield(60.0)
    cpu.lower()
    seen: list[int] = []
    child: list[_Worker] = []

    def lowered_maker() -> None:
        cpu.enter()
        seen.append(os.sched_getscheduler(0))
        child.append(_Worker(cpu))  # inherits this thread's SCHED_IDLE
        cpu.leave()

    t = threading.Thread(target=lowered_maker)
    t.start()
    t.join()
    try:
        assert seen == [IDLE] and child[0].policy() == IDLE
        cpu.hurry()
        assert child[0].policy() == OTHER
    finally:
        child[0].end()


@needs_yield
def test_the_deadline_raises_the_priority_back_without_any_waiter():
    cpu = CpuYield(0.05)
    w = _Worker(cpu)
    try:
        cpu.lower()
        _until(lambda: w.policy() == OTHER, "the timer hurried the thread")
        assert not cpu.low and cpu.committed() > 0.0
        _until(lambda: not any(t.name == "ckpt-yield-timer" for t in threading.enumerate()), "the timer thread ended")
    finally:
        w.end()


def test_off_or_not_allowed_changes_nothing():
    cpu = CpuYield(None)
    w = _Worker(cpu)
    try:
        cpu.lower()
        assert not cpu.enabled and not cpu.low
        assert os.sched_getscheduler(w.thread.native_id) == OTHER
    finally:
        w.end()


@needs_yield
def test_a_thread_with_the_users_own_policy_is_left_alone():
    cpu = CpuYield(60.0)
    done, seen = threading.Event(), []

    def batch() -> None:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        cpu.enter()
        cpu.lower()
        seen.append(os.sched_getscheduler(0))
        cpu.hurry()
        seen.append(os.sched_getscheduler(0))
        cpu.leave()
        done.set()

    t = threading.Thread(target=batch)
    t.start()
    t.join()
    assert seen == [os.SCHED_BATCH, os.SCHED_BATCH]


def test_waiting_for_a_save_hurries_it():
    outcome, calls = SaveOutcome(), []
    outcome.hurry = lambda: calls.append(1)
    assert outcome.wait(0.01) is False and calls == [1]
    outcome.done.set()
    assert outcome.wait() is True and calls == [1]  # done: nothing to hurry


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "30"])
def test_background_yield_s_is_checked(tmp_path, value):
    with pytest.raises(CheckpointConfigError, match="background_yield_s"):
        CheckpointManager(tmp_path, background_yield_s=value)


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


@needs_yield
def test_a_training_loop_save_yields_until_waited_for_and_restores_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 512)
    before = set(threading.enumerate())
    # a bound the test never reaches, even on a busy machine: the thread must still be low when checked
    mgr = CheckpointManager(tmp_path / "ck", write_block_bytes=1 << 20, background_yield_s=600)
    try:
        _train(model, opt, x)
        handle = mgr.save(1, {"model": model, "optim": opt})
        expect = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _train(model, opt, x)  # the guard waits for the copy; the live tensors change after it
        _until(handle.done, "step 1 committed")  # done() does not wait: the thread is still low
        assert _policy("ckpt-io", before) == IDLE
        stats = handle.wait()
        assert stats.yielded_s is not None and stats.yielded_s > 0.0
        mgr.wait()  # waiting hurries: the thread is back at normal priority
        assert _policy("ckpt-io", before) == OTHER
        handle2 = mgr.save(2, {"model": model, "optim": opt})
        _train(model, opt, x)
        assert handle2.wait().yielded_s is not None
        assert mgr.stats()[-1].step == 2
    finally:
        mgr.close()
    assert _policy("ckpt-io", before) is None  # the thread ended
    got = load(tmp_path / "ck", step=1)
    for k, v in expect.items():
        assert torch.equal(got["model"][k], v), k


@needs_yield
def test_a_done_callback_or_a_futures_watcher_does_not_hurry_a_yielding_save(tmp_path):
    """Frameworks (the Lightning and HF plugins) add a done callback to every save: that is not a wait."""
    import concurrent.futures

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = set(threading.enumerate())
    mgr = CheckpointManager(tmp_path / "ck", write_block_bytes=1 << 20, background_yield_s=600)
    try:
        _train(model, opt, torch.randn(16, 512))
        handle = mgr.save(1, {"model": model, "optim": opt})
        called = threading.Event()
        handle.add_done_callback(lambda h: called.set())
        _until(handle.done, "step 1 committed")
        assert _policy("ckpt-io", before) == IDLE  # neither the callback nor the Future's own watcher hurried it
        assert concurrent.futures.wait([handle], timeout=120).done == {handle}
        assert called.wait(120) and handle.result().yielded_s > 0.0
    finally:
        mgr.close()


def test_background_yield_s_none_never_lowers(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = set(threading.enumerate())
    mgr = CheckpointManager(tmp_path / "ck", background_yield_s=None)
    try:
        _train(model, opt, torch.randn(4, 256))
        handle = mgr.save(1, {"model": model, "optim": opt})
        _until(handle.done, "step 1 committed")
        assert _policy("ckpt-io", before) == OTHER
        assert handle.wait().yielded_s is None
    finally:
        mgr.close()


CHILD = textwrap.dedent("""
    import ctypes, json, sys
    # drop CAP_SYS_NICE from this process (RLIMIT_NICE stays 0): it may lower a thread's priority, never raise it
    libc = ctypes.CDLL(None, use_errno=True)
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    header, data = Header(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(header), data) == 0
    for field in ("effective", "permitted", "inheritable"):
        setattr(data[0], field, getattr(data[0], field) & ~(1 << 23))  # CAP_SYS_NICE
    assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
    import torch, torch.nn as nn
    from checkpointing import CheckpointManager, load
    from checkpointing.save.yielding import can_yield
    torch.manual_seed(0)
    m = nn.Linear(300, 300)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 300)).sum().backward()
    opt.step()
    mgr = CheckpointManager(sys.argv[1])
    stats = mgr.save(1, {"model": m, "optim": opt}).wait()
    mgr.close()
    same = torch.equal(load(sys.argv[1], step=1)["model"]["weight"], m.weight.detach())
    print("RESULT " + json.dumps({"can_yield": can_yield(), "yielded_s": stats.yielded_s, "same": same}))
""")


def _nice_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NICE)[0]


@pytest.mark.skipif(not can_yield() or _nice_limit() >= 20, reason="needs CAP_SYS_NICE to drop (and RLIMIT_NICE < 20)")
def test_a_process_that_could_not_raise_a_priority_back_never_lowers_one(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], env=child_env(), capture_output=True, text=True, timeout=120)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child failed rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out == {"can_yield": False, "yielded_s": None, "same": True}, out


@needs_yield
def test_threads_that_outlive_a_save_do_not_inherit_its_low_priority(tmp_path):
    """A thread inherits its maker's policy: the on_metrics thread (and the deadline timer) must be
    made by a thread at normal priority, never by a lowered ckpt-io thread."""
    got: list[dict] = []
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = set(threading.enumerate())
    mgr = CheckpointManager(tmp_path / "ck", on_metrics=got.append, background_yield_s=600)
    try:
        for step in (1, 2):
            _train(model, opt, torch.randn(4, 256))
            handle = mgr.save(step, {"model": model, "optim": opt})
            _train(model, opt, torch.randn(4, 256))
            _until(handle.done, f"step {step} committed")
            assert _policy("ckpt-io", before) == IDLE
            assert _policy("ckpt-metrics", before) == OTHER
        mgr.wait()
    finally:
        mgr.close()  # delivers every record
    assert [r["step"] for r in got] == [1, 2] and all(r["yielded_s"] is not None for r in got), got
