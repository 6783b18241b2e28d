"""Incremental saves in real training loops: a save writes only the chunks whose bytes changed and
refers to the rest in earlier steps' pack files; deleting steps (keep_local, collect.delete_step,
collect.apply_retention, `checkpointing gc`, a collector in another process running while the loop
saves) never removes a file that a committed step references. Every check restores bit-exactly
against clones taken when the step was saved."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile import flip_bits
from _models import assert_tree_equal, child_env, clone_tree, step_dir_name
import checkpointing
from checkpointing import CheckpointConfigError, CheckpointCorruptError, CheckpointError, CheckpointManager, CheckpointSaveError
from checkpointing.tier import catalog
from checkpointing.tier import collect, pins
from checkpointing.format import naming
from checkpointing.observe.metrics import read_jsonl
from checkpointing.plan.reuse import REWRITE_BELOW
from checkpointing.storage import LocalStorage
from checkpointing.tier.verify import verify_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE = 4096


# ----------------------------------------------------------------------------- models and helpers
class FrozenBaseNet(nn.Module):
    """A frozen 1 MB base (4 x Linear(256, 256), one chunk per tensor) and a small trained head."""

    def __init__(self, seed: int = 0, width: int = 256, layers: int = 4, out: int = 16):
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.base.requires_grad_(False)
        self.head = nn.Linear(width, out)

    def forward(self, x):
        return self.head(torch.relu(self.base(x)))


def frozen_run(seed: int = 0):
    net = FrozenBaseNet(seed)
    return net, torch.optim.AdamW(net.head.parameters(), lr=1e-2)


def frozen_bytes(net: FrozenBaseNet) -> int:
    return sum(p.numel() * p.element_size() for p in net.base.parameters())


def train_step(net: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    x = torch.randn(8, 256, generator=gen)
    loss = net(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def state_of(net, opt, step):
    return {"model": net, "optim": opt, "meta": {"step": step}}


def snapshot(net, opt, step):
    return clone_tree({"model": net.state_dict(), "optim": opt.state_dict(), "meta": {"step": step}})


def new_run(tmp_path):
    """A checkpoint directory, its storage, the frozen-base model with its optimizer, and a data seed."""
    ck = tmp_path / "ck"
    net, opt = frozen_run()
    return ck, LocalStorage(ck, direct=False), net, opt, torch.Generator().manual_seed(0)


def save_steps(mgr, net, opt, gen, steps):
    """Train one step before each save; returns {step: snapshot of what was saved}."""
    snaps = {}
    for step in steps:
        train_step(net, opt, gen)
        mgr.save(step, state_of(net, opt, step)).wait()
        snaps[step] = snapshot(net, opt, step)
    return snaps


def restore_and_check(mgr, step, snaps, make=frozen_run):
    """Restore `step` into fresh objects and compare bit-exactly with what was saved."""
    net, opt = make(seed=12345)
    state = state_of(net, opt, -1)
    assert mgr.restore(state, step=step) == step
    assert_tree_equal({"model": net.state_dict(), "optim": opt.state_dict(), "meta": state["meta"]}, snaps[step], f"step {step}")


def committed(storage) -> list[int]:
    return catalog.list_steps(storage).committed


def chunks_of(storage, step) -> set[tuple[str, int, int]]:
    m = catalog.load_manifest(storage, step)
    return {(c.file, c.offset, c.length) for t in m.tensors for s in t.shards for c in s.chunks}


def refs_of(storage, step, suffix):
    """The chunk references of the tensor whose key ends with `suffix`."""
    m = catalog.load_manifest(storage, step)
    [entry] = [t for t in m.tensors if t.key.endswith(suffix)]
    return [c for s in entry.shards for c in s.chunks]


def data_files(storage, step) -> set[str]:
    return catalog.load_manifest(storage, step).data_files()


def files_on_disk(root) -> set[str]:
    root = Path(root)
    return {str(p.relative_to(root)) for p in root.glob("step-*/*") if p.is_file()}


def own_dir(step: int) -> str:
    return naming.step_dir(step) + "/"


def assert_all_verify(storage) -> None:
    for s in committed(storage):
        report = verify_step(storage, s)
        assert report.ok, f"step {s}: {report.problems}"


# ----------------------------------------------------------------------------- 1. property: saves, changes, deletions
class Mixed(nn.Module):
    """Three layers of different sizes (some tensors span several chunks) and a float64 buffer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(64, 48)
        self.c = nn.Linear(128, 96)
        self.register_buffer("scale", torch.linspace(0, 1, 700, dtype=torch.float64))


def mixed_run(seed: int = 0):
    net = Mixed(seed)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


TENSORS = ("a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias", "scale")
LAYER_IN = {"a": 32, "b": 64, "c": 128}

mutation = st.one_of(
    st.tuples(st.just("element"), st.integers(0, 1 << 20), st.floats(-100, 100, width=32)),  # t.data.view(-1)[i] = v
    st.tuples(st.just("add"), st.floats(-2, 2, width=32)),  # in place, outside the optimizer
    st.just(("replace",)),  # t.data = new tensor (new storage, new bytes)
    st.just(("same",)),  # t.data = clone (new storage, the same bytes)
)
save_op = st.tuples(
    st.just("save"),
    st.dictionaries(st.sampled_from(TENSORS), mutation, max_size=4),
    st.sets(st.sampled_from(sorted(LAYER_IN))),  # layers trained by the optimizer this step
    st.booleans(),  # wait for the save before going on
)
other_op = st.one_of(
    st.tuples(st.just("delete"), st.integers(0, 50)),  # collect.delete_step of the i-th committed step
    st.tuples(st.just("retain"), st.integers(1, 3)),  # collect.apply_retention(keep)
    st.just(("collect",)),  # collect.collect (what `checkpointing gc --min-age-s 0` runs)
    st.just(("reopen",)),  # a new manager on the same directory (no reuse base)
)


def _mutate(net: Mixed, name: str, how: tuple, gen: torch.Generator) -> None:
    t = dict(net.named_parameters()) | dict(net.named_buffers())
    t = t[name]
    if how[0] == "element":
        t.data.view(-1)[how[1] % t.numel()] = how[2]
    elif how[0] == "add":
        with torch.no_grad():
            t.add_(how[1])
    elif how[0] == "replace":
        t.data = torch.randn(t.shape, generator=gen, dtype=t.dtype)
    else:
        t.data = t.data.clone()


def _train_layers(net: Mixed, opt, layers: set, gen: torch.Generator) -> None:
    opt.zero_grad(set_to_none=True)  # untrained layers keep grad None: AdamW leaves them alone
    loss = sum(getattr(net, n)(torch.randn(4, LAYER_IN[n], generator=gen)).pow(2).mean() for n in sorted(layers))
    loss.backward()
    opt.step()


def _check_stats(stats) -> None:
    assert stats.ok, stats.error
    assert 0 <= stats.bytes_reused <= stats.bytes_total
    assert 0 <= stats.chunks_reused <= stats.chunks_total
    # every chunk not taken from an earlier step is written (plus page padding)
    assert stats.bytes_written + stats.bytes_reused >= stats.bytes_total, stats


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    ops=st.lists(st.one_of(save_op, save_op, other_op), min_size=3, max_size=12),
    last=save_op,  # the sequence ends with a save: there is always a committed step to restore
    keep_local=st.sampled_from([None, 1, 2, 3]),
    chunk_bytes=st.sampled_from([4096, 16384, 1 << 20]),
)
def test_random_saves_and_deletions_restore_every_committed_step(ops, last, keep_local, chunk_bytes):
    gen = torch.Generator().manual_seed(7)
    with tempfile.TemporaryDirectory() as d:
        storage = LocalStorage(d, direct=False)
        net, opt = mixed_run()
        options = dict(keep_local=keep_local, chunk_bytes=chunk_bytes, fsync=False)
        mgr = CheckpointManager(d, **options)
        try:
            snaps: dict[int, dict] = {}
            expected: list[int] = []  # the committed steps, as the user expects them
            step = 0
            for op in ops + [last]:
                if op[0] == "save":
                    _, mutations, layers, sync = op
                    mgr.wait_staged()  # the previous snapshot no longer reads the live tensors
                    for name, how in sorted(mutations.items()):
                        _mutate(net, name, how, gen)
                    if layers:
                        _train_layers(net, opt, layers, gen)
                    step += 1
                    h = mgr.save(step, state_of(net, opt, step))
                    snaps[step] = snapshot(net, opt, step)
                    expected = sorted(expected + [step])[-keep_local:] if keep_local else expected + [step]
                    if sync:
                        _check_stats(h.wait())
                    continue
                mgr.wait()
                if op[0] == "delete":
                    steps = committed(storage)
                    if steps:
                        victim = steps[op[1] % len(steps)]
                        collect.delete_step(storage, victim)
                        expected.remove(victim)
                elif op[0] == "retain":
                    retired = collect.apply_retention(storage, op[1])
                    assert retired == expected[: max(0, len(expected) - op[1])]
                    expected = expected[len(retired):]
                elif op[0] == "collect":
                    result = collect.collect(storage, min_age_s=0)
                    assert not result.problems and not result.pinned, result
                else:
                    mgr.close()
                    mgr = CheckpointManager(d, **options)
                assert committed(storage) == expected
            mgr.wait()
            for stats in mgr.stats():
                _check_stats(stats)
            assert committed(storage) == expected

            # a full collection leaves exactly what the committed steps reference
            result = collect.collect(storage, min_age_s=0)
            assert not result.problems, result
            referenced = set().union(*(data_files(storage, s) for s in expected)) if expected else set()
            metadata = {n for s in expected for n in (naming.commit_name(s), catalog.read_commit(storage, s).manifest)}
            assert files_on_disk(d) == referenced | metadata
            assert sorted(p.name for p in Path(d).glob("step-*")) == sorted({f.split("/")[0] for f in referenced | metadata})

            for s in expected:
                report = verify_step(storage, s)
                assert report.ok, f"step {s}: {report.problems}"
                # a step takes chunks from another step's file only while they are REWRITE_BELOW of it
                m = catalog.load_manifest(storage, s)
                sizes = {f.path: f.nbytes for f in m.files}
                used: dict[str, int] = {}
                for f, _, n in chunks_of(storage, s):
                    used[f] = used.get(f, 0) + n
                for f, n in used.items():
                    if not f.startswith(own_dir(s)):
                        assert n >= REWRITE_BELOW * sizes[f], (s, f, n, sizes[f])
                restore_and_check(mgr, s, snaps, make=mixed_run)
        finally:
            mgr.close()


# ----------------------------------------------------------------------------- 2. change detection
def test_single_element_change_through_data_rewrites_its_chunk_only(tmp_path):
    chunk = 64 << 10
    torch.manual_seed(0)
    lin = nn.Linear(1024, 256)  # a 1 MiB weight: 16 chunks
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    snaps = {}

    def make(seed):
        torch.manual_seed(seed)
        m = nn.Linear(1024, 256)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    with CheckpointManager(tmp_path / "ck", chunk_bytes=chunk, keep_local=None) as mgr:
        s1 = mgr.save(1, state_of(lin, opt, 1))
        snaps[1] = snapshot(lin, opt, 1)
        mgr.wait_staged()  # the live tensors may change now, while step 1 is written
        lin.weight.data[20, 7] += 1.0  # byte 4 * (20 * 1024 + 7): chunk 1
        assert s1.wait().bytes_reused == 0
        s2 = mgr.save(2, state_of(lin, opt, 2))
        snaps[2] = snapshot(lin, opt, 2)
        st2 = s2.wait()
        assert st2.chunks_total == 16 + 1 and st2.chunks_reused == 16, st2  # 16 weight chunks + the bias
        assert st2.bytes_reused == lin.weight.numel() * 4 + lin.bias.numel() * 4 - chunk
        assert chunk <= st2.bytes_written <= chunk + 2 * PAGE, st2
        refs = refs_of(mgr.storage, 2, "weight")
        assert [i for i, c in enumerate(refs) if c.file.startswith(own_dir(2))] == [1]

        # a change between saves (the save is done: no wait_staged needed), at the last byte
        lin.weight.data[-1, -1] = -3.5
        st3 = mgr.save(3, state_of(lin, opt, 3)).wait()
        snaps[3] = snapshot(lin, opt, 3)
        assert st3.chunks_reused == 16 and chunk <= st3.bytes_written <= chunk + 2 * PAGE, st3
        assert [i for i, c in enumerate(refs_of(mgr.storage, 3, "weight")) if c.file.startswith(own_dir(3))] == [15]
        # chunk 1 now comes from step 2's file, the others from step 1's
        assert refs_of(mgr.storage, 3, "weight")[1].file.startswith(own_dir(2))

        # nothing changed at all: nothing written but the (empty) pack
        st4 = mgr.save(4, state_of(lin, opt, 4)).wait()
        snaps[4] = snapshot(lin, opt, 4)
        assert st4.chunks_reused == st4.chunks_total and st4.bytes_reused == st4.bytes_total and st4.bytes_written == 0, st4

        for s in (1, 2, 3, 4):
            net, o = make(99)
            state = state_of(net, o, -1)
            assert mgr.restore(state, step=s) == s
            assert_tree_equal({"model": net.state_dict(), "optim": o.state_dict(), "meta": state["meta"]}, snaps[s], f"step {s}")
        assert lin.weight[20, 7] != snaps[1]["model"]["weight"][20, 7]
    assert_all_verify(LocalStorage(tmp_path / "ck", direct=False))


def test_dtype_and_shape_changes_with_the_same_bytes(tmp_path):
    """float32 -> int32 (the same bytes), [4, 8] -> [8, 4] (the same bytes), then new bytes: the
    chunks may be taken from the earlier file, but the manifest says the new dtype and shape."""
    m = nn.Module()
    m.register_buffer("buf", torch.arange(32, dtype=torch.float32).reshape(4, 8) / 3)
    m.register_buffer("other", torch.ones(1000))
    versions = {}
    with CheckpointManager(tmp_path / "ck", keep_local=None) as mgr:
        mgr.save(1, {"m": m}).wait()
        versions[1] = m.buf.clone()
        m.buf = m.buf.view(torch.int32)  # reinterpret: the same bytes
        st2 = mgr.save(2, {"m": m}).wait()
        versions[2] = m.buf.clone()
        m.buf = m.buf.reshape(8, 4)
        st3 = mgr.save(3, {"m": m}).wait()
        versions[3] = m.buf.clone()
        m.buf = torch.arange(32, dtype=torch.int32).reshape(8, 4) * 7  # new bytes
        st4 = mgr.save(4, {"m": m}).wait()
        versions[4] = m.buf.clone()
        m.buf = versions[4].view(torch.float32).reshape(2, 16).clone()  # float32 again, new shape, same bytes as 4
        mgr.save(5, {"m": m}).wait()
        versions[5] = m.buf.clone()

        assert st2.bytes_reused == st2.bytes_total and st3.bytes_reused == st3.bytes_total
        assert st4.bytes_reused == 4000 and st4.bytes_written >= 128, st4
        for s, want in versions.items():
            [entry] = [t for t in catalog.load_manifest(mgr.storage, s).tensors if t.key.endswith("buf")]
            assert (entry.dtype, entry.shape) == (str(want.dtype).removeprefix("torch."), tuple(want.shape))
            target = nn.Module()
            target.register_buffer("buf", torch.zeros(want.shape, dtype=want.dtype))
            target.register_buffer("other", torch.zeros(1000))
            mgr.restore({"m": target}, step=s)
            assert_tree_equal(target.buf, want, f"step {s}")
            assert torch.equal(target.other, torch.ones(1000))
        # step 3's buffer is step 1's bytes in step 1's file
        assert refs_of(mgr.storage, 3, "buf")[0].file.startswith(own_dir(1))
    assert_all_verify(LocalStorage(tmp_path / "ck", direct=False))


def test_a_changed_plan_matches_chunks_by_tensor_key(tmp_path):
    """The embedding table grows (the pack plan changes): chunks at the same key, offset and
    length with the same bytes are still taken from the earlier file; the next save (same plan)
    compares bytes in place again; a new key in the state changes the plan once more."""
    chunk = 16 << 10
    torch.manual_seed(0)
    emb = nn.Embedding(1000, 64)  # 256000 bytes: 15 whole chunks and a 10240-byte tail
    frozen = nn.Linear(256, 256).requires_grad_(False)  # 16 + 1 chunks
    frozen_nbytes = 256 * 256 * 4 + 256 * 4
    state = {"emb": emb, "frozen": frozen}
    saved = {}
    with CheckpointManager(tmp_path / "ck", chunk_bytes=chunk, keep_local=None) as mgr:
        mgr.save(1, state).wait()
        saved[1] = clone_tree({k: v.state_dict() for k, v in state.items()})
        grown = nn.Embedding(1100, 64)
        with torch.no_grad():
            grown.weight[:1000] = emb.weight
        state["emb"] = grown
        st2 = mgr.save(2, state).wait()
        saved[2] = clone_tree({k: v.state_dict() for k, v in state.items()})
        assert st2.chunks_total == 18 + 17 and st2.chunks_reused == 15 + 17, st2
        assert st2.bytes_reused == 15 * chunk + frozen_nbytes, st2

        grown.weight.data[5] += 1.0  # chunk 0 only
        st3 = mgr.save(3, state).wait()
        saved[3] = clone_tree({k: v.state_dict() for k, v in state.items()})
        assert st3.chunks_reused == st3.chunks_total - 1 and chunk <= st3.bytes_written <= chunk + 2 * PAGE, st3

        state["extra"] = torch.randn(100)  # a new key: another plan
        st4 = mgr.save(4, state).wait()
        saved[4] = clone_tree({k: (v.state_dict() if isinstance(v, nn.Module) else v) for k, v in state.items()})
        assert st4.chunks_reused == st4.chunks_total - 1 and st4.bytes_reused == st4.bytes_total - 400, st4

        for s, want in saved.items():
            target = {"emb": nn.Embedding(1000 if s == 1 else 1100, 64), "frozen": nn.Linear(256, 256)}
            if "extra" in want:
                target["extra"] = torch.zeros(100)
            assert mgr.restore(target, step=s) == s
            got = {k: (v.state_dict() if isinstance(v, nn.Module) else v) for k, v in target.items()}
            assert_tree_equal(got, want, f"step {s}")
    assert_all_verify(LocalStorage(tmp_path / "ck", direct=False))


def test_incremental_false_reuses_nothing(tmp_path):
    net, opt = frozen_run()
    gen = torch.Generator().manual_seed(0)
    snaps = {}
    with CheckpointManager(tmp_path / "ck", incremental=False, keep_local=2) as mgr:
        for step in range(1, 5):
            train_step(net, opt, gen)
            h = mgr.save(step, state_of(net, opt, step))
            snaps[step] = snapshot(net, opt, step)
            stats = h.wait()
            assert stats.bytes_reused == 0 and stats.chunks_reused == 0, stats
            assert stats.bytes_written >= stats.bytes_total
            assert all(f.startswith(own_dir(step)) for f in data_files(mgr.storage, step))
        assert committed(mgr.storage) == [3, 4]  # retired steps are unlisted when h.wait() returns
        mgr.wait()  # and their files are gone when mgr.wait() returns
        assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == [step_dir_name(3), step_dir_name(4)]
        for s in (3, 4):
            restore_and_check(mgr, s, snaps)


@pytest.mark.parametrize("name", ["incremental", "fsync", "direct_io"])
def test_a_flag_that_is_not_a_bool_is_refused(tmp_path, name):
    """incremental="false" (a flag read from an environment variable) would turn saving what changed on."""
    with pytest.raises(CheckpointConfigError, match=f"{name}='false' is invalid: pass True"):
        CheckpointManager(tmp_path / "ck", **{name: "false"})


def test_a_step_directory_copied_alone_says_it_borrows_from_an_earlier_step(tmp_path, run_cli):
    big, small = torch.randn(256, 1024), torch.zeros(10)
    with CheckpointManager(tmp_path / "src", chunk_bytes=64 << 10) as mgr:
        for step in (1, 2):
            small += 1
            mgr.save(step, {"big": big, "small": small}).wait()
    shutil.copytree(tmp_path / "src" / naming.step_dir(2), tmp_path / "dst" / naming.step_dir(2))  # "archive the newest step"
    hint = "step 2 borrows it from step 1's directory: an incremental save"
    with pytest.raises(CheckpointCorruptError, match="the data file is missing") as info:
        checkpointing.load(tmp_path / "dst")
    assert hint in str(info.value) and "checkpointing export" in str(info.value)
    code, out = run_cli("verify", str(tmp_path / "dst"))
    assert code == 1 and out.count("file missing") == 1 and "'big'" in out and hint in " ".join(out.split()), out


# ----------------------------------------------------------------------------- 3. metrics
def test_frozen_base_metrics(tmp_path):
    net, opt = frozen_run()
    frozen = frozen_bytes(net)
    gen = torch.Generator().manual_seed(0)
    handles = []
    with CheckpointManager(tmp_path / "ck") as mgr:
        for step in range(1, 5):
            train_step(net, opt, gen)
            handles.append(mgr.save(step, state_of(net, opt, step)))
        mgr.wait()
        stats = [h.wait() for h in handles]
        first, later = stats[0], stats[1:]
        assert first.bytes_reused == 0 and first.chunks_reused == 0 and first.bytes_written >= first.bytes_total
        for s in later:
            assert s.bytes_reused == frozen, s  # the frozen base, exactly: every other tensor changed
            assert s.chunks_reused == 8 and s.chunks_total == first.chunks_total  # 4 weights + 4 biases, one chunk each
            assert s.bytes_total - frozen <= s.bytes_written <= s.bytes_total - frozen + 2 * PAGE, s  # the head's share
            assert s.bytes_written < frozen / 10
        by_step = {s.step: s for s in mgr.stats()}
        assert sorted(by_step) == [1, 2, 3, 4]
        for s in stats:
            got = by_step[s.step]
            assert (got.bytes_reused, got.chunks_reused, got.chunks_total, got.bytes_written) == \
                   (s.bytes_reused, s.chunks_reused, s.chunks_total, s.bytes_written)
    records = {r["step"]: r for r in read_jsonl(tmp_path / "ck" / "metrics.jsonl")}
    assert sorted(records) == [1, 2, 3, 4]
    for s in stats:
        r = records[s.step]
        assert (r["bytes_reused"], r["chunks_reused"], r["chunks_total"], r["bytes_written"]) == \
               (s.bytes_reused, s.chunks_reused, s.chunks_total, s.bytes_written)


def test_the_first_save_after_a_restart_writes_only_what_changed(tmp_path):
    """A new manager (a restarted job) restores the newest step; its first save takes the chunks
    whose digests match the restored step's at the same place, and writes the rest, including a
    change made through `.data` after the restore."""
    ck, storage, net, opt, gen = new_run(tmp_path)
    with CheckpointManager(ck, keep_local=1) as mgr:
        snaps = save_steps(mgr, net, opt, gen, [1, 2])
    frozen, before = frozen_bytes(net), data_files(storage, 2)
    net2, opt2 = frozen_run(seed=777)  # the restarted process's fresh objects
    with CheckpointManager(ck, keep_local=1) as mgr:
        assert mgr.restore(state_of(net2, opt2, -1)) == 2
        net2.base[0].weight.data[0, 0] += 1  # one frozen chunk changes behind the optimizer's back
        snaps.update(save_steps(mgr, net2, opt2, gen, [3]))
        first = mgr.stats()[-1]
        edited = net2.base[0].weight.numel() * 4
        assert first.bytes_reused == frozen - edited, first
        assert first.bytes_written <= first.bytes_total - frozen + edited + 2 * PAGE, first
        assert committed(storage) == [3] and data_files(storage, 3) & before  # step 2 retired, the base kept
        restore_and_check(mgr, 3, snaps)
        snaps.update(save_steps(mgr, net2, opt2, gen, [4]))  # and on as usual
        assert mgr.stats()[-1].bytes_reused == frozen
        restore_and_check(mgr, 4, snaps)
        assert_all_verify(storage)


def test_a_restored_step_missing_a_file_is_not_a_base(tmp_path):
    """The restored step's pack file is removed behind the manager's back: the next save finds it
    gone (one stat per base file, beside the commit check) and writes everything rather than refer
    to bytes that are gone."""
    ck, storage, net, opt, gen = new_run(tmp_path)
    with CheckpointManager(ck, keep_local=None) as mgr:
        snaps = save_steps(mgr, net, opt, gen, [1])
    net2, opt2 = frozen_run(seed=3)
    with CheckpointManager(ck, keep_local=None) as mgr:
        assert mgr.restore(state_of(net2, opt2, -1)) == 1
        for f in data_files(storage, 1):
            os.remove(ck / f)
        snaps.update(save_steps(mgr, net2, opt2, gen, [2]))
        st = mgr.stats()[-1]
        assert st.bytes_reused == 0 and st.bytes_written >= st.bytes_total, st
        restore_and_check(mgr, 2, snaps)


# ----------------------------------------------------------------------------- 4. reference-safe retention
def test_keep_local_1_keeps_the_referenced_pack_until_nothing_uses_it(tmp_path, run_cli):
    ck, storage, net, opt, gen = new_run(tmp_path)
    snaps = {}
    layer_bytes = [sum(p.numel() * 4 for p in layer.parameters()) for layer in net.base]

    def save(mgr, step):
        h = mgr.save(step, state_of(net, opt, step))
        snaps[step] = snapshot(net, opt, step)
        stats = h.wait()
        mgr.wait()  # h.wait() returns once the step is durable; mgr.wait() also once retention removed files
        return stats

    def entries(step):
        return sorted(n.name for n in (ck / step_dir_name(step)).iterdir()) if (ck / step_dir_name(step)).exists() else None

    with CheckpointManager(ck, keep_local=1) as mgr:
        for step in (1, 2, 3):
            train_step(net, opt, gen)
            save(mgr, step)
        assert committed(storage) == [3]
        # step 1 is retired (no COMMIT, no manifest) but its pack holds the frozen base step 3 uses
        [pack1] = entries(1)
        assert pack1.endswith(".pack")
        assert entries(2) is None  # step 2's pack held only the head: nothing references it
        assert f"{step_dir_name(1)}/{pack1}" in data_files(storage, 3)
        restore_and_check(mgr, 3, snaps)
        code, out = run_cli("ls", str(ck), "--json")
        assert code == 0, out
        assert [(r["step"], r["state"]) for r in json.loads(out)] == [(1, "retired"), (3, "committed")]

        # change one of the four base layers: the other three (> REWRITE_BELOW of pack 1) stay there
        mgr.wait_staged()
        with torch.no_grad():
            for p in net.base[0].parameters():
                p.add_(0.25)
        train_step(net, opt, gen)
        st4 = save(mgr, 4)
        assert st4.bytes_reused == sum(layer_bytes[1:]), st4
        assert entries(1) == [pack1] and entries(3) is None
        # change two more: what is left in pack 1 (one layer) is below REWRITE_BELOW: rewritten
        with torch.no_grad():
            for layer in net.base[1:3]:
                layer.weight.mul_(-1)
        train_step(net, opt, gen)
        st5 = save(mgr, 5)
        assert st5.bytes_reused == layer_bytes[0], st5  # layer 0 comes from step 4's pack
        assert all(c.file.startswith(own_dir(5)) for c in refs_of(storage, 5, "base.3.weight"))
        assert all(c.file.startswith(own_dir(4)) for c in refs_of(storage, 5, "base.0.weight"))
        assert entries(1) is None  # nothing references pack 1 any more: gone with its directory
        assert [n.endswith(".pack") for n in entries(4)] == [True]
        assert committed(storage) == [5]
        restore_and_check(mgr, 5, snaps)

    # `checkpointing gc` removes a crashed save's files, never a referenced one
    (ck / step_dir_name(9)).mkdir()
    (ck / step_dir_name(9) / "r00000.0123456789ab.pack").write_bytes(b"x" * 5000)
    before = files_on_disk(ck)
    code, out = run_cli("gc", str(ck), "--min-age-s", "0")
    assert code == 0, out
    assert "left 1 file(s) of step 4" in out, out
    assert files_on_disk(ck) == before - {f"{step_dir_name(9)}/r00000.0123456789ab.pack"}
    assert not (ck / step_dir_name(9)).exists()
    code, out = run_cli("verify", str(ck))
    assert code == 0 and "all 1 step(s) verified" in out, out
    with CheckpointManager(ck, keep_local=1) as mgr:
        restore_and_check(mgr, 5, snaps)


# ----------------------------------------------------------------------------- 5. deleting while saving
GC_CHILD = textwrap.dedent(
    """
    import os, sys, traceback
    from checkpointing.tier import collect
    from checkpointing.cli.app import main
    from checkpointing.storage import LocalStorage

    d, ready, stop = sys.argv[1:4]
    storage = LocalStorage(d, direct=False)
    open(ready, "w").close()
    rounds = errors = 0
    while not os.path.exists(stop):
        try:
            if rounds % 10 == 9:
                # the CLI tidies only under the writer lock: while the training job's manager holds it,
                # `checkpointing gc` refuses (exit 2, naming the writer); the collection below goes on anyway
                code = main(["gc", d, "--min-age-s", "0"])
                assert code in (0, 2), f"checkpointing gc exited {code}"
            else:
                collect.collect(storage, min_age_s=0)
            collect.apply_retention(storage, 2)
        except Exception:
            errors += 1
            traceback.print_exc()
        rounds += 1
    print(f"ROUNDS {rounds} ERRORS {errors}", flush=True)
    sys.exit(1 if errors else 0)
    """
)


def _open_beside_gc(ck: Path) -> CheckpointManager:
    """The manager, once the other process's `checkpointing gc` round (which holds the writer lock for
    a moment, as it must) is over: the refusal names the holder, and a moment later the lock is free."""
    from checkpointing.tier.lock import DirectoryLockedError

    for _ in range(200):
        try:
            return CheckpointManager(ck, keep_local=2, chunk_bytes=64 << 10)
        except DirectoryLockedError:
            time.sleep(0.05)
    return CheckpointManager(ck, keep_local=2, chunk_bytes=64 << 10)


@contextlib.contextmanager
def _collector_beside(ck: Path, problems: list[str]) -> Iterator[None]:
    """GC_CHILD collecting `ck` in a tight loop while the body runs; its failure goes to `problems`."""
    logs = ck.parent
    ready, stop = logs / "ready", logs / "stop"
    out, err = open(logs / "collect.out", "w+"), open(logs / "collect.err", "w+")
    child = subprocess.Popen([sys.executable, "-c", GC_CHILD, str(ck), str(ready), str(stop)],
                             env=child_env(), stdout=out, stderr=err)
    try:
        t0 = time.monotonic()
        while not ready.exists():
            assert child.poll() is None and time.monotonic() - t0 < 60, "the gc process did not start"
            time.sleep(0.05)
        yield
    finally:
        stop.touch()
        if child.poll() is None:
            child.wait(timeout=60)
        out.seek(0), err.seek(0)
        child_out, child_err = out.read(), err.read()
        out.close(), err.close()
    assert "ROUNDS" in child_out, child_out + child_err
    if child.returncode != 0:
        problems.append(f"the gc process failed ({child_out.splitlines()[-1]}); its first error:\n{child_err[:2500]}")


def test_concurrent_gc_process_never_leaves_a_committed_step_dangling(tmp_path):
    """A training loop saves every step (keep_local=2: the manager retires steps too) while another
    process collects and retires (keep 2) in a tight loop (the reference-safe protocol of tier/collect.py,
    called directly), trying `checkpointing gc` every tenth round (refused while the writer lock is held)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    storage = LocalStorage(ck, direct=False)
    problems: list[str] = []
    snaps = {}
    with _collector_beside(ck, problems):
        net, opt = frozen_run()
        gen = torch.Generator().manual_seed(0)
        with _open_beside_gc(ck) as mgr:
            step, prev = 0, None
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline or step < 10:
                train_step(net, opt, gen)
                if prev is not None:
                    try:
                        prev.wait()
                    except CheckpointSaveError as exc:
                        problems.append(str(exc))
                    # every step committed now must be whole (unless retired meanwhile)
                    for s in committed(storage):
                        try:
                            marker = catalog.read_commit(storage, s)
                        except CheckpointError:  # retired between the listing and the read
                            continue
                        report = verify_step(storage, s)
                        if not report.ok and pins.still_committed(storage, s, marker.manifest_digest):
                            problems.append(f"committed step {s} is damaged: {report.problems[:2]}")
                step += 1
                prev = mgr.save(step, state_of(net, opt, step))
                snaps[step] = snapshot(net, opt, step)
            try:
                mgr.wait()
            except CheckpointSaveError as exc:
                problems.append(str(exc))
    with CheckpointManager(ck, keep_local=2) as mgr:
        final = committed(storage)
        assert final, "no committed step left"
        for s in final:
            report = verify_step(storage, s)
            if not report.ok:
                problems.append(f"committed step {s} is damaged after the run: {report.problems[:2]}")
                continue
            restore_and_check(mgr, s, snaps)
    assert step >= 10
    assert not problems, f"{step} saves with a collector running beside them:\n" + "\n".join(dict.fromkeys(problems))


def test_a_step_directory_just_made_is_left_for_its_pin(tmp_path, run_cli):
    """A writer makes step-N/ and then writes its pin there: a collector that finds the directory
    empty leaves it while it is young; one it empties itself (a crashed save's file) goes at once."""
    ck = tmp_path / "ck"
    storage = LocalStorage(ck, direct=False)
    (ck / step_dir_name(7)).mkdir(parents=True)
    (ck / step_dir_name(8)).mkdir()
    (ck / step_dir_name(8) / "r00000.0123456789ab.pack").write_bytes(b"x" * 100)
    collect.collect(storage, min_age_s=0)
    assert (ck / step_dir_name(7)).is_dir()
    assert not (ck / step_dir_name(8)).exists()
    code, out = run_cli("gc", str(ck), "--min-age-s", "0")
    assert code == 0 and (ck / step_dir_name(7)).is_dir(), out
    old = time.time() - collect.EMPTY_DIR_GRACE_S - 5
    os.utime(ck / step_dir_name(7), (old, old))
    collect.collect(storage, min_age_s=0)
    assert not (ck / step_dir_name(7)).exists()


def test_saves_whose_step_directory_waits_before_its_pin_survive_a_collector(tmp_path, monkeypatch):
    """The moment between making step-N/ and writing the pin in it, stretched (a writer thread paused
    there: a slow directory fsync, a busy CPU) while another process collects in a tight loop: every
    save commits, none fails because its new directory was removed under it."""
    original = LocalStorage._step_into

    def paused(self, fd, part, rel, create):
        made = create and part.startswith("step-") and part not in os.listdir(fd)
        opened = original(self, fd, part, rel, create)
        if made:
            time.sleep(0.02)  # ~10 rounds of the collector
        return opened

    monkeypatch.setattr(LocalStorage, "_step_into", paused)
    ck = tmp_path / "ck"
    ck.mkdir()
    problems: list[str] = []
    net, opt = frozen_run()
    gen = torch.Generator().manual_seed(0)
    with _collector_beside(ck, problems), _open_beside_gc(ck) as mgr:
        for step in range(1, 16):
            train_step(net, opt, gen)
            try:
                mgr.save(step, state_of(net, opt, step)).wait()
            except CheckpointSaveError as exc:
                problems.append(str(exc))
        final = committed(LocalStorage(ck, direct=False))
    assert final and final[-1] == 15
    assert not problems, f"{len(problems)} of 15 saves failed:\n" + "\n".join(problems[:3])


def test_a_pin_protects_an_old_file_until_it_is_removed(tmp_path, run_cli):
    ck = tmp_path / "ck"
    storage = LocalStorage(ck, direct=False)
    net, opt = frozen_run()
    with CheckpointManager(ck, keep_local=None) as mgr:
        mgr.save(1, state_of(net, opt, 1)).wait()
    [old] = data_files(storage, 1)
    marker = catalog.read_commit(storage, 1)
    assert pins.still_committed(storage, 1, marker.manifest_digest)

    # a save of step 2 in flight takes chunks from step 1's pack: its pin names the file
    pin = pins.write_pin(storage, 2, 0, naming.new_token(), [old])
    result = collect.collect(storage, retire=[1])
    assert result.retired == [1] and result.pinned == [2] and result.kept == {1: 1}, result
    assert not pins.still_committed(storage, 1, marker.manifest_digest)
    assert (ck / old).is_file() and committed(storage) == []
    assert files_on_disk(ck) == {old, pin}
    code, out = run_cli("gc", str(ck), "--min-age-s", "0")  # default --pin-ttl-s: the pin holds
    assert code == 0 and "left step 2: a save in flight pins it" in out, out
    assert files_on_disk(ck) == {old, pin}
    # a pin younger than the TTL holds; a zero TTL takes it for a crashed writer's
    assert collect.collect(storage, pin_ttl_s=3600).garbage == []
    assert (ck / old).is_file()

    pins.remove_pin(storage, pin)  # the save failed (or committed without using step 1)
    result = collect.collect(storage)
    assert {g.path for g in result.garbage} == {old}
    assert files_on_disk(ck) == set() and not (ck / step_dir_name(1)).exists()
    # the failed save's directory, empty when the collector came, may be a writer's about to pin: it
    # stays until it is older than EMPTY_DIR_GRACE_S
    assert [p.name for p in ck.glob("step-*")] == [step_dir_name(2)]
    old_time = time.time() - collect.EMPTY_DIR_GRACE_S - 5
    os.utime(ck / step_dir_name(2), (old_time, old_time))
    collect.collect(storage)
    assert not list(ck.glob("step-*"))

    # a crashed writer's pin (older than --pin-ttl-s) protects nothing
    with CheckpointManager(ck, keep_local=None) as mgr:
        mgr.save(3, state_of(net, opt, 3)).wait()
    [old3] = data_files(storage, 3)
    pin = pins.write_pin(storage, 4, 0, naming.new_token(), [old3])
    collect.collect(storage, retire=[3])
    assert (ck / old3).is_file()
    code, out = run_cli("gc", str(ck), "--min-age-s", "0", "--pin-ttl-s", "0")
    assert code == 0 and "pin of a crashed save" in out, out
    assert files_on_disk(ck) == set()


def test_base_step_deleted_between_two_saves(tmp_path):
    """The manager's previous step is deleted by someone else: the next save takes nothing from it
    (pins.still_committed is False) and references no file that is gone."""
    ck, storage, net, opt, gen = new_run(tmp_path)
    with CheckpointManager(ck, keep_local=None) as mgr:
        snaps = save_steps(mgr, net, opt, gen, (1, 2))
        [pack1] = [f for f in data_files(storage, 1)]
        assert pack1 in data_files(storage, 2)  # step 2 took the frozen base from step 1's pack
        marker2 = catalog.read_commit(storage, 2)
        collect.delete_step(storage, 1)
        assert (ck / pack1).is_file()  # step 2 still references it
        collect.delete_step(storage, 2)  # the manager's base
        assert not pins.still_committed(storage, 2, marker2.manifest_digest)
        assert not (ck / pack1).exists() and not list(ck.glob("step-*"))

        train_step(net, opt, gen)
        st3 = mgr.save(3, state_of(net, opt, 3)).wait()
        snaps[3] = snapshot(net, opt, 3)
        assert st3.bytes_reused == 0 and st3.chunks_reused == 0, st3
        assert all(f.startswith(own_dir(3)) for f in data_files(storage, 3))
        # and the save after it takes the frozen base from step 3 again
        train_step(net, opt, gen)
        st4 = mgr.save(4, state_of(net, opt, 4)).wait()
        snaps[4] = snapshot(net, opt, 4)
        assert st4.bytes_reused == frozen_bytes(net), st4
        # retiring step 3 while step 4 is the base: the next save may take step 3's chunks via 4
        collect.delete_step(storage, 3)
        train_step(net, opt, gen)
        st5 = mgr.save(5, state_of(net, opt, 5)).wait()
        snaps[5] = snapshot(net, opt, 5)
        assert st5.bytes_reused == frozen_bytes(net), st5
        assert committed(storage) == [4, 5]
        assert_all_verify(storage)
        for s in (4, 5):
            restore_and_check(mgr, s, snaps)


class CommitsDuringCollect(LocalStorage):
    """The real local tier; when a collector has listed `step`'s files (G2 in collect.py) and before
    it reads the pins (G3), the writer of `step` commits and removes its pin, as
    background.BackgroundSaves._run does right after a commit."""

    def __init__(self, root, step: int, commit: bytes, pin: str):
        super().__init__(root, direct=False)
        self.step, self.commit, self.pin, self.listed, self.fired = step, commit, pin, 0, False

    def list(self, prefix: str = "") -> list[str]:
        names = super().list(prefix)
        if prefix == naming.step_dir(self.step) and not self.fired:
            self.listed += 1
            if self.listed == 2:  # list_steps() saw no COMMIT, G2 listed the files: now commit
                self.fired = True
                self.put(naming.commit_name(self.step), self.commit, exclusive=True)
                pins.remove_pin(self, self.pin)
        return names


def test_a_step_committing_while_gc_runs_keeps_its_files(tmp_path):
    """Step 2 is in flight (pinned, pack and manifest written, no COMMIT) when a collection starts;
    it commits and unpins after the collector listed its files and before it read the pins."""
    ck, storage, net, opt, gen = new_run(tmp_path)
    with CheckpointManager(ck, keep_local=None) as mgr:
        snaps = save_steps(mgr, net, opt, gen, (1, 2))
    files2 = data_files(storage, 2)
    assert any(f.startswith(own_dir(1)) for f in files2)  # step 2 takes the base from step 1's pack
    collect.delete_step(storage, 1)
    # back to the moment before step 2's COMMIT: its pin names the earlier file it takes chunks from
    commit = (ck / naming.commit_name(2)).read_bytes()
    (ck / naming.commit_name(2)).unlink()
    pin = pins.write_pin(storage, 2, 0, naming.new_token(), sorted(f for f in files2 if not f.startswith(own_dir(2))))

    racing = CommitsDuringCollect(ck, 2, commit, pin)
    collect.collect(racing, min_age_s=0)
    assert racing.fired, "the collector never listed step 2's files twice"
    assert committed(storage) == [2]
    report = verify_step(storage, 2)
    assert report.ok, f"step 2 committed during gc and lost files: {report.problems}"
    with CheckpointManager(ck, keep_local=None) as mgr:
        restore_and_check(mgr, 2, snaps)


# ----------------------------------------------------------------------------- 6. a damaged shared chunk
def test_damaged_shared_chunk_is_reported_for_every_step_using_it(tmp_path, run_cli):
    ck, storage, net, opt, gen = new_run(tmp_path)
    snaps = {}
    with CheckpointManager(ck, keep_local=None) as mgr:
        for step in range(1, 6):
            if step == 5:  # step 5 writes base.1.weight anew: it does not share the chunk
                mgr.wait_staged()
                net.base[1].weight.data.mul_(0.5)
            train_step(net, opt, gen)
            mgr.save(step, state_of(net, opt, step))
            snaps[step] = snapshot(net, opt, step)
        mgr.wait()
    [chunk] = refs_of(storage, 1, "base.1.weight")
    key = (chunk.file, chunk.offset, chunk.length)
    users = [s for s in committed(storage) if key in chunks_of(storage, s)]
    assert users == [1, 2, 3, 4]
    assert chunk.file.startswith(own_dir(1))
    code, out = run_cli("verify", str(ck))
    assert code == 0, out

    flip_bits(ck / chunk.file, chunk.offset + chunk.length // 2)
    code, out = run_cli("verify", str(ck))
    assert code == 1, out
    for s in users:
        assert f"DAMAGED step {s}:" in out, out
        assert f"step {s}, tensor 'model/base.1.weight', {chunk.file} bytes {chunk.offset}..{chunk.offset + chunk.length}" in out, out
    assert "ok      step 5:" in out and "DAMAGED step 5" not in out, out
    assert "4 of 5 step(s) damaged" in out, out
    with CheckpointManager(ck, keep_local=None) as mgr:
        for s in users:
            with pytest.raises(CheckpointCorruptError) as ei:
                mgr.restore(state_of(*frozen_run(3), -1), step=s)
            msg = str(ei.value)
            assert f"step {s}" in msg and chunk.file in msg and "base.1.weight" in msg, msg
        restore_and_check(mgr, 5, snaps)


# ----------------------------------------------------------------------------- 7. checkpointing ls
def test_ls_json_splits_each_step_into_new_unique_shared(tmp_path, run_cli):
    ck = tmp_path / "ck"
    storage = LocalStorage(ck, direct=False)
    net, opt = frozen_run()
    frozen = frozen_bytes(net)
    gen = torch.Generator().manual_seed(0)
    with CheckpointManager(ck, keep_local=None) as mgr:
        stats = {}
        for step in range(1, 5):
            train_step(net, opt, gen)
            stats[step] = mgr.save(step, state_of(net, opt, step)).wait()
    total = stats[1].bytes_total
    head = total - frozen

    def rows():
        code, out = run_cli("ls", str(ck), "--json")
        assert code == 0, out
        return {r["step"]: r for r in json.loads(out)}

    got = rows()
    assert sorted(got) == [1, 2, 3, 4]
    for s, r in got.items():
        assert r["state"] == "committed"
        assert r["stored"] == r["bytes"] == total
        assert r["unique"] + r["shared"] == r["stored"]
        assert r["new"] == total - stats[s].bytes_reused  # what its own save wrote
        assert r["shared"] == frozen, r  # the frozen base, referenced by every step
        assert r["unique"] == head, r
    assert got[1]["new"] == total and all(got[s]["new"] == head for s in (2, 3, 4))

    collect.delete_step(storage, 1)
    got = rows()
    assert got[1]["state"] == "retired" and "stored" not in got[1]
    assert all((got[s]["new"], got[s]["shared"], got[s]["unique"]) == (head, frozen, head) for s in (2, 3, 4)), got
    collect.delete_step(storage, 2)
    collect.delete_step(storage, 3)
    got = rows()
    assert sorted(got) == [1, 4] and got[1]["state"] == "retired"
    assert (got[4]["stored"], got[4]["new"], got[4]["unique"], got[4]["shared"]) == (total, head, total, 0), got[4]
    code, out = run_cli("ls", str(ck))
    assert code == 0 and "retired" in out, out
