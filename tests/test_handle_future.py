"""SaveHandle as a future (concurrent.futures.Future's methods, as DCP's async_save returns)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from checkpointing import CheckpointError, CheckpointManager, CheckpointSaveError, CheckpointTimeoutError, SaveStats


def test_result_done_and_callbacks(tmp_path):
    fired: list[tuple[int, bool]] = []
    called = threading.Event()
    with CheckpointManager(tmp_path) as mgr:
        h = mgr.save(1, {"w": torch.randn(1 << 20)})
        assert h.cancel() is False and h.cancelled() is False

        def on_done(handle):
            fired.append((handle.step, handle.done()))
            called.set()

        h.add_done_callback(on_done)
        stats = h.result(timeout=120)
        assert isinstance(stats, SaveStats) and stats.step == 1 and stats.ok
        assert h.done() and not h.running() and h.exception() is None
        assert called.wait(60) and fired == [(1, True)]
        # on a finished save the callback runs at once, on the caller's thread
        here = []
        h.add_done_callback(lambda handle: here.append(threading.current_thread()))
        assert here == [threading.current_thread()]
        # a callback that raises is logged and does not disturb the manager
        h.add_done_callback(lambda handle: 1 / 0)
        mgr.save(2, {"w": torch.zeros(4)}).result()
        # result() from another thread, as executors and framework callbacks call it
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert pool.submit(h.result).result().step == 1


def test_a_failed_save_raises_from_result_every_time_and_not_again_at_the_next_save(tmp_path):
    ck = tmp_path / "ck"
    with CheckpointManager(ck, keep_local=None) as mgr:
        mgr.save(5, {"w": torch.ones(8)}).wait()
        (ck / "step-0000000007").write_text("a file where the step directory goes\n")
        try:
            h = mgr.save(7, {"w": torch.ones(8)})
        except CheckpointSaveError:
            pytest.skip("this platform failed the save inside save() (acceptable): no handle to test")
        done, _ = concurrent.futures.wait([h], timeout=120, return_when=concurrent.futures.FIRST_EXCEPTION)
        assert done == {h}  # the Future's own state finished with the error
        for _ in range(2):
            with pytest.raises(CheckpointSaveError, match="7"):
                h.result()
        assert isinstance(h.exception(), CheckpointSaveError) and h.done()
        for _ in range(2):  # the handle's own wait() too, after exception() (a Future query does not use it up)
            with pytest.raises(CheckpointSaveError, match="7"):
                h.wait()
        mgr.save(8, {"w": torch.ones(8)}).wait()  # reported through the handle: not raised again here
        assert mgr.steps() == [5, 8]


def test_timeout_error_is_a_timeout_error():
    assert issubclass(CheckpointTimeoutError, TimeoutError)


def test_a_handle_is_a_future_that_wait_as_completed_and_asyncio_accept(tmp_path):
    import asyncio

    with CheckpointManager(tmp_path) as mgr:
        handles = [mgr.save(step, {"w": torch.full((1 << 18,), float(step))}) for step in (1, 2, 3)]
        assert all(isinstance(h, concurrent.futures.Future) for h in handles)
        done, not_done = concurrent.futures.wait(handles, timeout=120)
        assert done == set(handles) and not not_done
        assert sorted(h.result().step for h in concurrent.futures.as_completed(handles, timeout=120)) == [1, 2, 3]

        async def durable(handle):
            return await asyncio.wrap_future(handle)

        assert asyncio.run(durable(mgr.save(4, {"w": torch.zeros(8)}))).step == 4
        with pytest.raises(RuntimeError, match="finishes with its save"):
            handles[0].set_result(None)


def test_a_read_only_manager_starts_no_thread_and_a_writing_one_only_at_its_first_save(tmp_path):
    """`CheckpointManager(d, read_only=True).steps()`, unclosed, as a script that only looks would write it, leaves no thread
    behind (each left a ckpt-io thread running until the interpreter exited)."""
    import threading

    def io_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "ckpt-io")

    before = io_threads()  # other tests' unclosed managers may hold some
    with CheckpointManager(tmp_path) as mgr:
        assert io_threads() <= before  # nothing saved yet
        mgr.save(1, {"w": torch.arange(4.0)}).wait()
        assert io_threads() == before + 1
    assert io_threads() <= before
    for _ in range(3):
        assert CheckpointManager(tmp_path, read_only=True).steps() == [1]
    assert io_threads() <= before


@pytest.mark.parametrize("saved_before", [True, False])
def test_a_save_racing_close_on_another_thread_raises_instead_of_hanging(tmp_path, saved_before):
    """A shutdown path calls close() while the training thread is inside save() (here: in the state's iteration, as a
    slow state_dict() would be): save() raises that the manager was closed, the step is not written, and nothing hangs
    (its job went to the stopped ckpt-io thread, and save() waited for it for ever)."""
    import collections.abc

    entered, release = threading.Event(), threading.Event()

    class SlowState(collections.abc.Mapping):
        def __init__(self, d: dict) -> None:
            self.d = d

        def __getitem__(self, k):
            return self.d[k]

        def __len__(self) -> int:
            return len(self.d)

        def __iter__(self):
            entered.set()
            release.wait(60)
            return iter(self.d)

    mgr = CheckpointManager(tmp_path)
    if saved_before:
        mgr.save(0, {"w": torch.zeros(64)}).wait()  # the ckpt-io thread runs
    outcome: list[BaseException | str] = []

    def saver() -> None:
        try:
            mgr.save(1, SlowState({"w": torch.ones(64)})).wait()
            outcome.append("saved")
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    t = threading.Thread(target=saver, daemon=True)
    t.start()
    assert entered.wait(60)
    mgr.close()
    release.set()
    t.join(120)
    assert not t.is_alive(), "save() still blocked after close()"
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointError) and "closed" in str(outcome[0]), outcome
    with CheckpointManager(tmp_path, read_only=True) as ro:
        assert ro.steps() == ([0] if saved_before else [])
