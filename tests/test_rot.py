"""Bounded exposure to rot (finding 3): chunks that incremental saves borrow are read back within
`reverify_every` saves, a damaged one is written anew by the next save (logged, counted), and a
restore that found damage never leaves that step as the next save's base.

Real pack files with real flipped bits; the selection rule (plan/scrub.py) as a property test."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile import flip_bits
from _models import assert_tree_equal, clone_tree
from checkpointing import CheckpointConfigError, CheckpointCorruptError, CheckpointManager
from checkpointing.format import naming
from checkpointing.format.manifest import ChunkRef
from checkpointing.observe.metrics import read_jsonl
from checkpointing.plan import scrub
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog
from checkpointing.tier.verify import verify_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK = 4096


# ----------------------------------------------------------------------------- the selection rule (pure)
def _ref(i: int, length: int) -> ChunkRef:
    return ChunkRef(f"step-{i % 3:010d}/r0.pack", i * 1000, length, f"d{i}")


@settings(max_examples=300, deadline=None)
@given(
    every=st.integers(1, 8),
    pool=st.lists(st.integers(1, 50), min_size=1, max_size=30),  # chunk lengths
    rounds=st.lists(st.tuples(st.sets(st.integers(0, 29)), st.booleans()), min_size=1, max_size=40),
)
def test_every_candidate_is_read_within_every_rounds(every, pool, rounds):
    """Whatever the candidates do from round to round, and whether the next save is waiting (the
    optional reads dropped), a chunk that is a candidate in `every` consecutive rounds is read in
    at least one of them; the optional reads never go past the round's quota."""
    chunks = [_ref(i, n) for i, n in enumerate(pool)]
    since: dict = {}
    streak: dict = {}  # chunk -> consecutive candidate rounds without a read
    for r, (members, busy) in enumerate(rounds):
        candidates = [chunks[i] for i in sorted(members) if i < len(chunks)]
        sel = scrub.select(candidates, since, r, every)
        quota = -(-sum(c.length for c in candidates) // every)
        assert set(sel.must) | set(sel.extra) <= set(candidates)
        assert not set(sel.must) & set(sel.extra)
        if sel.extra:  # optional reads are added only while the round is under its quota
            assert sum(c.length for c in sel.must) + sum(c.length for c in sel.extra[:-1]) < quota
        read = list(sel.must) + ([] if busy else list(sel.extra))
        since = scrub.advance(since, candidates, r, read)
        streak = {c: (0 if c in read else streak.get(c, 0) + 1) for c in candidates}
        assert all(n < every for n in streak.values()), (r, streak)


@settings(max_examples=100, deadline=None)
@given(every=st.integers(1, 12), pool=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=60), rounds=st.integers(1, 40))
def test_a_steady_set_is_read_evenly(every, pool, rounds):
    """With the same candidates every round, a round reads about 1/every of their bytes (at most
    the quota plus one chunk, plus what fell due), and every chunk once per `every` rounds."""
    chunks = [_ref(i, n) for i, n in enumerate(pool)]
    total, biggest = sum(pool), max(pool)
    quota = -(-total // every)
    since: dict = {}
    seen: list = []
    for r in range(rounds):
        sel = scrub.select(chunks, since, r, every)
        assert sel.nbytes <= quota + 2 * biggest, (r, sel.nbytes, quota)
        since = scrub.advance(since, chunks, r, sel.must + sel.extra)
        seen.append(set(sel.must + sel.extra))
    for r in range(every - 1, rounds):
        assert set.union(*seen[r - every + 1 : r + 1]) == set(chunks)


@given(reads=st.lists(st.tuples(st.integers(0, 1 << 24), st.floats(0, 0.5)), max_size=30), rate=st.floats(1e3, 1e10))
def test_pacing_keeps_reads_within_the_budget(reads, rate):
    """A read starts only once the bytes read before it fit the budget for the time elapsed."""
    clock, done = 0.0, 0
    for nbytes, work_s in reads:
        clock += scrub.pace(done, clock, rate)
        assert done <= rate * clock * (1 + 1e-9) + 1
        done += nbytes
        clock += work_s


def test_options_are_checked():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(CheckpointConfigError, match="reverify_every"):
            CheckpointManager("unused-dir-never-created", reverify_every=bad)
    with pytest.raises(CheckpointConfigError, match="reverify_bytes_per_s"):
        CheckpointManager("unused-dir-never-created", reverify_bytes_per_s=0)


# ----------------------------------------------------------------------------- real files, real bit flips
class FrozenBaseNet(nn.Module):
    """A frozen 1 MB base (64 chunks of 4 KiB per weight) and a small trained head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        self.base.requires_grad_(False)
        self.head = nn.Linear(256, 16)

    def forward(self, x):
        return self.head(torch.relu(self.base(x)))


def frozen_run(seed: int = 0):
    net = FrozenBaseNet(seed)
    return net, torch.optim.AdamW(net.head.parameters(), lr=1e-2)


def state_of(net, opt, step):
    return {"model": net, "optim": opt, "meta": {"step": step}}


def save_steps(mgr, net, opt, gen, steps) -> dict:
    snaps = {}
    for step in steps:
        x = torch.randn(8, 256, generator=gen)
        opt.zero_grad(set_to_none=True)
        net(x).pow(2).mean().backward()
        opt.step()
        mgr.save(step, state_of(net, opt, step)).wait()
        snaps[step] = clone_tree({"model": net.state_dict(), "optim": opt.state_dict(), "meta": {"step": step}})
    return snaps


def restore_and_check(mgr, step, snaps) -> None:
    net, opt = frozen_run(seed=12345)
    state = state_of(net, opt, -1)
    assert mgr.restore(state, step=step) == step
    assert_tree_equal({"model": net.state_dict(), "optim": opt.state_dict(), "meta": state["meta"]}, snaps[step], f"step {step}")


def refs_of(storage, step, suffix) -> list[ChunkRef]:
    m = catalog.load_manifest(storage, step)
    [entry] = [t for t in m.tensors if t.key.endswith(suffix)]
    return [c for s in entry.shards for c in s.chunks]


def all_refs(storage, step) -> set[tuple[str, int]]:
    m = catalog.load_manifest(storage, step)
    return {(c.file, c.offset) for t in m.tensors for s in t.shards for c in s.chunks}


def victim_of(storage, step: int) -> ChunkRef:
    """A chunk of base.1.weight that `step` borrows from step 1's pack."""
    refs = refs_of(storage, step, "base.1.weight")
    victim = refs[len(refs) // 2]
    assert victim.file.startswith(naming.step_dir(1) + "/"), victim
    return victim


def test_a_flipped_bit_in_a_borrowed_chunk_is_found_within_every_saves_and_rewritten(tmp_path, caplog):
    every = 3
    ck = tmp_path / "ck"
    storage = LocalStorage(ck, direct=False)
    net, opt = frozen_run()
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        with CheckpointManager(ck, keep_local=None, chunk_bytes=CHUNK, reverify_every=every) as mgr:
            snaps = save_steps(mgr, net, opt, gen, [1, 2])  # step 2 borrows the frozen base from step 1's pack
            victim = victim_of(storage, 2)
            flip_bits(ck / victim.file, victim.offset + 1000)
            snaps.update(save_steps(mgr, net, opt, gen, range(3, 3 + every + 2)))
            stats = {s.step: s for s in mgr.stats()}
            newest = 3 + every + 1
            restore_and_check(mgr, newest, snaps)
    # the rounds after saves 2, 3 and 4 (counted in the records of saves 3, 4 and 5) read every chunk step 2 borrowed
    assert sum(stats[s].chunks_reverified for s in range(3, 3 + every)) >= stats[2].chunks_reused > 0
    assert sum(stats[s].bytes_reverified for s in range(3, 3 + every)) >= stats[2].bytes_reused
    # the flip came after save 2, maybe just after the round that followed it read that chunk:
    # at most `every` saves (3, 4, 5) take the damaged chunk, and the one after writes it anew
    [fixed] = [s for s in range(3, 3 + every + 1) if stats[s].chunks_damaged]
    assert stats[fixed].chunks_damaged == 1 and all(stats[s].chunks_damaged == 0 for s in stats if s != fixed)
    kept = catalog.list_steps(storage).committed
    for s in range(3, fixed):  # the saves before it took the damaged chunk, unaware
        assert s not in kept or (victim.file, victim.offset) in all_refs(storage, s)
    for s in kept:
        if s >= fixed:
            assert (victim.file, victim.offset) not in all_refs(storage, s)
            assert verify_step(storage, s).ok, s
    place = refs_of(storage, fixed, "base.1.weight")[len(refs_of(storage, fixed, "base.1.weight")) // 2]
    assert place.file.startswith(naming.step_dir(fixed) + "/")  # written anew by that save
    records = {r["step"]: r for r in read_jsonl(ck / naming.METRICS_NAME)}
    assert records[fixed]["chunks_damaged"] == 1 and records[fixed]["chunks_reverified"] >= 1
    warned = [r.getMessage() for r in caplog.records if "re-verification" in r.getMessage()]
    assert len(warned) == 1 and victim.file in warned[0] and f"{victim.offset}..{victim.offset + victim.length}" in warned[0], warned


def test_reverify_off_reads_nothing(tmp_path):
    net, opt = frozen_run()
    gen = torch.Generator().manual_seed(0)
    with CheckpointManager(tmp_path / "ck", chunk_bytes=CHUNK, reverify_every=None) as mgr:
        save_steps(mgr, net, opt, gen, [1, 2, 3, 4])
        assert [s.chunks_reverified for s in mgr.stats()] == [0, 0, 0, 0]
        assert mgr.stats()[-1].chunks_reused > 0


def test_a_restore_that_fell_back_to_the_remote_tier_is_not_the_next_base(tmp_path):
    ck, remote = tmp_path / "ck", f"file://{tmp_path / 'remote'}"
    storage = LocalStorage(ck, direct=False)
    net, opt = frozen_run()
    gen = torch.Generator().manual_seed(0)
    with CheckpointManager(ck, remote=remote, keep_local=None, chunk_bytes=CHUNK) as mgr:
        snaps = save_steps(mgr, net, opt, gen, [1, 2])
        mgr.wait()
    victim = victim_of(storage, 2)
    flip_bits(ck / victim.file, victim.offset + 7)
    net2, opt2 = frozen_run(seed=5)
    with CheckpointManager(ck, remote=remote, keep_local=None, chunk_bytes=CHUNK) as mgr:
        state = state_of(net2, opt2, -1)
        assert mgr.restore(state) == 2  # the damaged shard read from the remote tier instead
        assert_tree_equal({"model": net2.state_dict(), "optim": opt2.state_dict(), "meta": state["meta"]}, snaps[2], "step 2")
        snaps.update(save_steps(mgr, net2, opt2, gen, [3]))
        first = mgr.stats()[-1]
        assert first.bytes_reused == 0 and first.bytes_written >= first.bytes_total, first
        assert all(f.startswith(naming.step_dir(3) + "/") for f, _ in all_refs(storage, 3))
        snaps.update(save_steps(mgr, net2, opt2, gen, [4]))  # and incremental again, from step 3
        assert mgr.stats()[-1].bytes_reused > 0
        mgr.wait()
    with CheckpointManager(ck, keep_local=None) as mgr:  # the local tier alone
        restore_and_check(mgr, 3, snaps)
        restore_and_check(mgr, 4, snaps)


def test_a_restore_that_found_damage_leaves_no_base(tmp_path):
    """Without a remote tier the damaged restore fails; the save after it writes everything
    instead of taking chunks from the step it had just saved (which uses the damaged chunk)."""
    ck = tmp_path / "ck"
    storage = LocalStorage(ck, direct=False)
    net, opt = frozen_run()
    gen = torch.Generator().manual_seed(0)
    with CheckpointManager(ck, keep_local=None, chunk_bytes=CHUNK) as mgr:
        snaps = save_steps(mgr, net, opt, gen, [1, 2])
        victim = victim_of(storage, 2)
        flip_bits(ck / victim.file, victim.offset + 3)
        with pytest.raises(CheckpointCorruptError):
            mgr.restore(state_of(*frozen_run(seed=9), -1), step=2)
        snaps.update(save_steps(mgr, net, opt, gen, [3]))
        st3 = mgr.stats()[-1]
        assert st3.bytes_reused == 0 and st3.bytes_written >= st3.bytes_total, st3
        assert verify_step(storage, 3).ok
        restore_and_check(mgr, 3, snaps)


def test_the_bound_holds_when_saves_come_back_to_back(tmp_path):
    """No time between saves (each save() is queued while the previous round would read): the
    optional reads are dropped, the chunks whose window ends are still read, so the flip is found
    within `every` saves all the same."""
    every = 2
    ck = tmp_path / "ck"
    storage = LocalStorage(ck, direct=False)
    net, opt = frozen_run()
    gen = torch.Generator().manual_seed(0)
    with CheckpointManager(ck, keep_local=None, chunk_bytes=CHUNK, reverify_every=every) as mgr:
        snaps = save_steps(mgr, net, opt, gen, [1, 2])
        victim = victim_of(storage, 2)
        flip_bits(ck / victim.file, victim.offset + 2000)
        for step in range(3, 3 + every + 1):
            mgr.save(step, state_of(net, opt, step))  # no training, no wait: the same bytes, saved back to back
        mgr.wait()
        stats = {s.step: s for s in mgr.stats()}
        snaps[3 + every] = clone_tree({"model": net.state_dict(), "optim": opt.state_dict(), "meta": {"step": 3 + every}})
        restore_and_check(mgr, 3 + every, snaps)
    [fixed] = [s for s in stats if stats[s].chunks_damaged]
    assert fixed <= 3 + every, stats  # at most `every` saves after the flip take the damaged chunk
    for s in range(fixed, 3 + every + 1):
        assert (victim.file, victim.offset) not in all_refs(storage, s)
        assert verify_step(storage, s).ok


def test_a_save_queued_behind_the_previous_ones_re_verification_counts_it_as_wait_prev(tmp_path, monkeypatch):
    """The ckpt-io thread re-verifies after a save's `done`; the next save() waits for it (it is
    queued behind it). That wait is the previous save's work: wait_prev_s, not this save's stall."""
    import threading

    from checkpointing.save.scrub import Reverifier

    entered, release, calls = threading.Event(), threading.Event(), []
    real = Reverifier._check

    def blocking_check(self, step, ref):
        calls.append(step)
        if len(calls) == 1:
            entered.set()
            release.wait(30)
        return real(self, step, ref)

    monkeypatch.setattr(Reverifier, "_check", blocking_check)
    net, opt = frozen_run()
    gen = torch.Generator().manual_seed(0)
    with CheckpointManager(tmp_path / "ck", keep_local=None, chunk_bytes=CHUNK) as mgr:
        save_steps(mgr, net, opt, gen, [1, 2])  # step 2 borrows the frozen base's chunks: its round reads some back
        assert entered.wait(30)
        timer = threading.Timer(0.3, release.set)
        timer.start()
        mgr.save(3, state_of(net, opt, 3)).wait()
        timer.join()
        stats = {s.step: s for s in mgr.stats()}
    assert stats[3].wait_prev_s >= 0.25  # held by the re-verification for at least the timer's 0.3 s
    assert stats[2].chunks_reused > 0
