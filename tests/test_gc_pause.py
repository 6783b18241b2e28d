"""The cyclic collector is paused while a manifest is built or read (checkpointing/format/gcpause.py):
off inside, back as it was after, across overlapping blocks in several threads; and a real save's
merge and a restore's decode run inside such a block."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import checkpointing.dist.coordinator as coordinator
from checkpointing import CheckpointManager
from checkpointing.format.gcpause import gc_paused


@pytest.fixture(autouse=True)
def _gc_enabled_around():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_off_inside_on_after():
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_process_that_turned_it_off_keeps_it_off():
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_error_inside_still_turns_it_back_on():
    with pytest.raises(ValueError):
        with gc_paused():
            raise ValueError("boom")
    assert gc.isenabled()


def test_overlapping_blocks_in_two_threads_turn_it_on_after_the_last():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with gc_paused():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with gc_paused():
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"after the first left": False}
    assert gc.isenabled()


def test_a_save_merges_with_the_collector_paused_and_leaves_it_on(tmp_path, monkeypatch):
    states = []
    real = coordinator.merge_parts

    def spy(*args, **kwargs):
        states.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(coordinator, "merge_parts", spy)
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"model": model}).wait()
    assert states == [False]
    assert gc.isenabled()


def test_a_save_is_written_and_committed_with_the_collector_paused(tmp_path, monkeypatch):
    """The save's objects die young by reference counting instead of being promoted by collections
    while they live (which set off full collections of the whole heap every few dozen saves)."""
    import checkpointing.save.worker as worker

    states = []
    real_write, real_commit = worker.run_save, coordinator.merge_parts

    def write(*args, **kwargs):
        states.append(("write", gc.isenabled()))
        return real_write(*args, **kwargs)

    def merge(*args, **kwargs):
        states.append(("merge", gc.isenabled()))
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(worker, "run_save", write)
    monkeypatch.setattr(coordinator, "merge_parts", merge)
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(tmp_path / "ck") as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": model}).wait()
    assert gc.isenabled()  # on again once the saves are done (wait() returns before the worker retires old steps)
    assert states == [("write", False), ("merge", False)] * 2
    gc.disable()  # a process that runs without the collector keeps it off across saves
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(3, {"model": model}).wait()
    assert not gc.isenabled()


def test_a_restore_decodes_the_manifest_with_the_collector_paused(tmp_path, monkeypatch):
    """Every restore decodes the manifest it reads (a 10 MB manifest at 256 ranks: millions of
    objects); decode_manifest runs paused wherever it is called from, and leaves the collector on."""
    import checkpointing.format.decode as decode
    import checkpointing.tier.catalog as catalog

    states = []
    real = decode._decode_manifest

    def spy(*args, **kwargs):
        states.append(gc.isenabled())
        return real(*args, **kwargs)

    model = torch.nn.Linear(8, 8)
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"model": model}).wait()
    monkeypatch.setattr(decode, "_decode_manifest", spy)
    monkeypatch.setattr(catalog, "_decoded", type(catalog._decoded)(8))  # as a resumed job: no manifest decoded yet
    fresh = torch.nn.Linear(8, 8)
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.restore({"model": fresh})
    assert states and not any(states)
    assert gc.isenabled()
    assert torch.equal(fresh.weight, model.weight)
