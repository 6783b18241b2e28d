"""A training process forks (DataLoader workers, multiprocessing's "fork", os.fork) and gets Ctrl-C: the child of a
process with a manager never waits for the parent's saves, never writes into the checkpoint directory, holds no
writer lock and keeps no preemption handler; a KeyboardInterrupt inside save() leaves no save that never runs
(save/live.py, tier/lock.py, training/preemption.py, save/issue.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from _models import child_env

_PRELUDE = """
import json, os, signal, sys, time
import torch
from checkpointing import CheckpointManager
root = sys.argv[1]
model = torch.nn.Linear(1024, 1024)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optim": optimizer}
def step():
    model(torch.randn(4, 1024)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
def wait_child(pid, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"
"""


def _run(tmp_path, body: str) -> dict:
    script = tmp_path / "script.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], env=child_env(), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_forked_child_exits_at_once_writes_nothing_and_steps_its_optimizer(tmp_path):
    out = _run(tmp_path, """
        mgr = CheckpointManager(root)
        step()
        mgr.save(1, state).wait()
        step()
        mgr.save(2, state)  # in flight at the fork
        pid = os.fork()
        if pid == 0:  # the child trains a step (the parent's snapshot may still be copying), then exits normally
            step()
            sys.exit(0)
        child = wait_child(pid)
        mgr.close()
        lines = open(os.path.join(root, "metrics.jsonl")).read().splitlines()
        print(json.dumps({"child": child, "steps": CheckpointManager(root, read_only=True).steps(),
                          "records": [json.loads(l)["step"] for l in lines]}))
    """)
    assert out["child"] == 0  # it did not wait for the parent's save (it hung there for ever)
    assert out["steps"] == [1, 2]
    assert out["records"] == [1, 2]  # the child's exit wrote no record of the parent's saves


def test_a_forked_child_holds_no_writer_lock(tmp_path):
    out = _run(tmp_path, """
        mgr = CheckpointManager(root)
        mgr.save(1, state).wait()
        pid = os.fork()
        if pid == 0:
            time.sleep(30)  # a DataLoader worker, still alive
            os._exit(0)
        mgr.close()
        try:
            with CheckpointManager(root) as again:  # refused while the child held the lock
                again.save(2, state).wait()
            opened = again.steps()
        except Exception as exc:
            opened = f"{type(exc).__name__}: {exc}"
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print(json.dumps({"opened": opened}))
    """)
    assert out["opened"] == [1, 2], out


def test_a_child_forked_after_handle_preemption_dies_of_sigterm(tmp_path):
    out = _run(tmp_path, """
        mgr = CheckpointManager(root)
        mgr.handle_preemption(state, grace_s=10)
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        child = wait_child(pid, timeout=20)
        mgr.close()
        print(json.dumps({"child": child}))
    """)
    assert out["child"] == -15, out  # it kept the parent's flag-only handler: alive until SIGKILL


@pytest.mark.parametrize("handler", ["python's", "the program's own"])
def test_ctrl_c_as_a_save_is_handed_to_its_thread_leaves_no_save_that_never_runs(tmp_path, handler):
    out = _run(tmp_path, """
        import threading
        from checkpointing.save import worker
        def stopping(signum, frame):  # a program's own handler: log, then stop
            raise KeyboardInterrupt("stopping")
        # (set explicitly: a background job starts with SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler if HANDLER == "python's" else stopping)
        mgr = CheckpointManager(root, keep_local=None)
        mgr.save(1, state).wait()
        target = worker.SaveWorker.submit.__code__
        def tracer(frame, event, arg):  # Ctrl-C arrives just as the save is handed over
            if event == "call" and frame.f_code is target:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)
        sys.settrace(tracer)
        try:
            mgr.save(2, state)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        sys.settrace(None)
        later = threading.Thread(target=lambda: mgr.save(3, state).wait(), daemon=True)
        later.start()
        later.join(60)
        hung = later.is_alive()
        if not hung:
            mgr.close()
        print(json.dumps({"interrupted": interrupted, "hung": hung, "steps": [] if hung else CheckpointManager(root, read_only=True).steps()}))
        if hung:
            os._exit(0)
    """.replace("HANDLER", repr(handler)))
    assert out == {"interrupted": True, "hung": False, "steps": [1, 2, 3]}, out


def test_children_forked_while_managers_open_and_close_never_hold_the_writer_lock(tmp_path):
    """A thread forks (a DataLoader started from a helper thread) while the main thread opens and closes managers: a
    child forked between the lock's open and its registration (or between unregistering and closing) kept it."""
    out = _run(tmp_path, """
        import threading
        stop, children = threading.Event(), []
        def forker():
            while not stop.is_set():
                pid = os.fork()
                if pid == 0:  # exit 1 when this child holds a descriptor of the WRITER file
                    held = any(os.readlink(f"/proc/self/fd/{fd}").endswith("/WRITER") for fd in os.listdir("/proc/self/fd")
                               if os.path.islink(f"/proc/self/fd/{fd}"))
                    os._exit(1 if held else 0)
                children.append(pid)
                time.sleep(0.005)
        thread = threading.Thread(target=forker)
        thread.start()
        for _ in range(40):
            CheckpointManager(root).close()  # a child forked a moment ago may hold a copy: given a moment
        stop.set()
        thread.join()
        codes = [wait_child(pid) for pid in children]
        print(json.dumps({"children": len(codes), "holding": sum(1 for c in codes if c != 0)}))
    """)
    assert out["children"] > 0 and out["holding"] == 0, out


def test_in_a_forked_child_waiting_for_the_parents_save_returns_at_once(tmp_path):
    out = _run(tmp_path, """
        mgr = CheckpointManager(root)
        handle = mgr.save(1, {"w": torch.randn(16 << 20)})  # 64 MiB: in flight at the fork
        pid = os.fork()
        if pid == 0:
            mgr.wait()
            try:
                handle.wait()
                os._exit(3)
            except Exception as exc:
                os._exit(0 if "forked from" in str(exc) else 4)
        child = wait_child(pid, timeout=30)
        handle.wait()
        mgr.close()
        print(json.dumps({"child": child}))
    """)
    assert out["child"] == 0, out  # it hung (killed: "hung")
