"""Uploads to the remote tier yield the CPU (background_yield_s) until something waits for them.

A real CheckpointManager uploads to a moto S3 server on 127.0.0.1 through s3fs. The remote tier runs
on an event loop of its own (thread `ckpt-remote-io`, storage/ioloop.py), so every thread doing an
upload's work is ours: that thread, the transfer pool's (`ckpt-upload_N`) and the upload thread
(`ckpt-upload`). Checked on their real scheduling policies (os.sched_getscheduler): SCHED_IDLE while
an upload runs and nothing waits for it, normal again as soon as something waits (wait(), the
handle's wait()); the step then restores bit-exact from the remote tier alone. The upload is held
in flight by a gate around the real filesystem's UploadPart calls (the requests still go to the server).
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import fsspec.asyn
import pytest
import torch
import torch.nn as nn

from checkpointing import CheckpointManager
from checkpointing.save.yielding import can_yield
from checkpointing.storage import FsspecStorage

from s3_server import new_bucket, s3_bucket, s3_endpoint  # noqa: F401 - fixtures
from test_yielding import _until

needs_yield = pytest.mark.skipif(not can_yield(), reason="this process may not raise a thread's priority back (SCHED_IDLE)")
IDLE, OTHER = getattr(os, "SCHED_IDLE", -1), getattr(os, "SCHED_OTHER", -1)
MiB = 1 << 20
UPLOAD_THREADS = ("ckpt-upload", "ckpt-remote-io", "ckpt-upload_0")


class Gate:
    """Wraps a real fsspec filesystem: UploadPart calls wait until `open()` (everything else passes)."""

    def __init__(self, fs: Any) -> None:
        self._fs, self.opened, self.waiting = fs, threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part":
            self.waiting.set()
            self.opened.wait(120)
        return self._fs.call_s3(method, *args, **kwargs)

    def open(self) -> None:
        self.opened.set()


def _policies(among: set[threading.Thread]) -> dict[str, int | None]:
    """The scheduling policy of each upload thread started since `among` was taken (None: absent)."""
    out: dict[str, int | None] = {name: None for name in UPLOAD_THREADS}
    for t in threading.enumerate():
        if t.name in out and t not in among and t.native_id is not None:
            try:
                out[t.name] = os.sched_getscheduler(t.native_id)
            except OSError:
                pass
    return out


def _pool_policies(among: set[threading.Thread]) -> dict[str, int]:
    """The scheduling policy of each thread of the remote tier's event loop executor started since `among` was taken."""
    out = {}
    for t in threading.enumerate():
        if t.name.startswith("ckpt-remote-io-pool") and t not in among and t.native_id is not None and t.is_alive():
            try:
                out[t.name] = os.sched_getscheduler(t.native_id)
            except OSError:
                pass
    return out


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))  # 8 MiB of fp32
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return model, opt


@needs_yield
@pytest.mark.parametrize("waiter", ["manager", "handle"])
def test_an_upload_yields_until_waited_for_and_restores_bit_exact(tmp_path, s3_bucket, waiter):  # noqa: F811
    url, options = s3_bucket
    model, opt = _model()
    expect = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = set(threading.enumerate())
    mgr = CheckpointManager(tmp_path / "local", remote=url, storage_options=options, upload_part_bytes=5 * MiB,
                            background_yield_s=600)  # a bound the test never reaches: still low when checked
    gate = Gate(mgr.remote_storage.endpoint.fs)
    mgr.remote_storage.endpoint.fs = gate
    try:
        handle = mgr.save(1, {"model": model, "optim": opt})
        _until(gate.waiting.is_set, "a part upload is in flight")
        _until(lambda: _policies(before) == {name: IDLE for name in UPLOAD_THREADS}, "every upload thread at SCHED_IDLE")
        # the loop's executor threads too, also one started before the first upload (the first requests' DNS lookups)
        _until(lambda: set(_pool_policies(before).values()) <= {IDLE}, "every I/O pool thread at SCHED_IDLE")
        waited = threading.Thread(target=mgr.wait if waiter == "manager" else handle.wait, daemon=True)
        waited.start()  # something waits: back at normal priority before the upload may go on
        _until(lambda: _policies(before) == {name: OTHER for name in UPLOAD_THREADS}, "every upload thread at normal priority")
        gate.open()
        waited.join(120)
        assert not waited.is_alive()
        stats = handle.wait()
        assert stats.tier == "local+remote" and stats.bytes_uploaded > 0
    finally:
        gate.open()
        mgr.close()
    assert _policies(before)["ckpt-upload"] is None  # the upload thread ended
    torch.manual_seed(1)
    target = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    with CheckpointManager(tmp_path / "empty", remote=url, storage_options=options) as fresh:  # the remote tier alone
        assert fresh.tiers() == {1: "remote"}
        assert fresh.restore({"model": target, "optim": torch.optim.SGD(target.parameters(), lr=0.1)}, step=1) == 1
    for k, v in expect.items():
        assert torch.equal(target.state_dict()[k], v), k


def test_background_yield_s_none_uploads_at_normal_priority(tmp_path, s3_bucket):  # noqa: F811
    url, options = s3_bucket
    model, opt = _model()
    before = set(threading.enumerate())
    mgr = CheckpointManager(tmp_path / "local", remote=url, storage_options=options, upload_part_bytes=5 * MiB,
                            background_yield_s=None)
    gate = Gate(mgr.remote_storage.endpoint.fs)
    mgr.remote_storage.endpoint.fs = gate
    try:
        handle = mgr.save(1, {"model": model, "optim": opt})
        _until(gate.waiting.is_set, "a part upload is in flight")
        assert _policies(before) == {name: OTHER for name in UPLOAD_THREADS}
        gate.open()
        assert handle.wait().upload_s is not None
    finally:
        gate.open()
        mgr.close()


def test_the_remote_tier_runs_on_a_loop_of_its_own_that_ends_with_the_storage(s3_endpoint):  # noqa: F811
    url, options = new_bucket()
    shared = FsspecStorage(url, options)
    own = FsspecStorage(url, options, own_loop=True)
    try:
        assert shared.fs.loop is fsspec.asyn.get_loop()  # the default: fsspec's loop, shared by the process
        assert own.fs.loop is not fsspec.asyn.get_loop()
        thread = own.endpoint.ioloop.thread
        assert thread.name == "ckpt-remote-io" and thread.is_alive()
        on: list[str] = []
        own.on_io_thread(lambda: on.append(threading.current_thread().name))
        assert on == ["ckpt-remote-io"]  # run on the loop's thread at once
        own.put("a", b"x" * 100)
        assert shared.get("a") == b"x" * 100
        own.close()
        assert own.get("a") == b"x" * 100  # close() stops the transfer threads; the storage stays usable
        del own
        gc.collect()
        _until(lambda: not thread.is_alive(), "the loop's thread ended with its storage")
    finally:
        shared.close()
