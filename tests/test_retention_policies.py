"""Retention policies (issue 17, item 5): KeepLatest, KeepEvery, KeepBest, KeepSteps and their union.

Each policy as a pure function (hypothesis); save(..., metrics=...) stored in the manifest and COMMIT
(validated on the way in and on the way back); then end to end: a manager's local tier under a
composed policy, KeepBest across a restart (the metrics come from disk), incremental saves that
borrow from retired steps still restoring bit-exact, keep_remote with a policy on an S3 tier (moto on
127.0.0.1), and two real gloo ranks (rank 0's metrics are the step's). Nothing is mocked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from s3_server import s3_bucket, s3_endpoint  # noqa: F401 - fixtures

from _dist import run_ranks
from checkpointing import CheckpointConfigError, CheckpointManager
from checkpointing.errors import ManifestError
from checkpointing.format import naming
from checkpointing.format.decode import MAX_METRIC_NAME, MAX_METRICS, decode_commit, decode_manifest
from checkpointing.format.manifest import CommitMarker, encode_commit, encode_manifest
from checkpointing.options import ManagerOptions
from checkpointing.plan.retention import KeepAny, KeepBest, KeepEvery, KeepLatest, KeepSteps, RetentionPolicy, StepInfo, steps_to_delete
from checkpointing.storage import RetryPolicy, open_storage
from checkpointing.tier import catalog
from checkpointing.tier.catalog import MAX_COMMIT_BYTES
from checkpointing.tier.verify import verify_step
from test_manifest import golden_commit, golden_manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROPS = settings(max_examples=300, deadline=None)
WHERE = "test"

# ------------------------------------------------------------------ the policies, pure

steps_st = st.sets(st.integers(0, 10**6), max_size=40)
value_st = st.none() | st.just(math.nan) | st.integers(-5, 5) | st.floats(-10, 10, allow_nan=False)  # few values: ties


@st.composite
def infos_st(draw, metric: str = "loss") -> list[StepInfo]:
    """Committed steps, each with `metric` (or without it, or NaN) and sometimes another metric."""
    out = []
    for step in draw(steps_st):
        value = draw(value_st)
        metrics = {} if value is None else {metric: value}
        if draw(st.booleans()):
            metrics["other"] = draw(st.floats(-1, 1))
        out.append(StepInfo(step, metrics))
    draw(st.randoms()).shuffle(out)
    return out


policy_st = st.deferred(lambda: st.one_of(
    st.builds(KeepLatest, st.integers(1, 8)),
    st.builds(KeepEvery, st.integers(1, 50)),
    st.builds(KeepBest, st.integers(1, 5), st.sampled_from(["loss", "other", "absent"]), st.sampled_from(["min", "max"])),
    st.builds(KeepSteps, st.sets(st.integers(0, 10**6), max_size=5)),
    st.builds(lambda a, b: a | b, policy_st, policy_st),
))


@PROPS
@given(infos_st(), st.integers(1, 45))
def test_keep_latest_keeps_exactly_the_newest_n(infos, n):
    steps = sorted(i.step for i in infos)
    assert KeepLatest(n).kept(infos) == frozenset(steps[-n:])
    assert len(KeepLatest(n).kept(infos)) == min(n, len(steps))


@PROPS
@given(infos_st(), st.integers(1, 10**5))
def test_keep_every_keeps_exactly_the_multiples(infos, n):
    kept = KeepEvery(n).kept(infos)
    assert kept == frozenset(i.step for i in infos if i.step % n == 0)


@PROPS
@given(infos_st(), st.integers(1, 8), st.sampled_from(["min", "max"]))
def test_keep_best_keeps_the_n_best_by_metric_and_mode(infos, n, mode):
    kept = KeepBest(n, "loss", mode=mode).kept(infos)
    rated = {i.step: i.metrics["loss"] for i in infos if "loss" in i.metrics and not math.isnan(i.metrics["loss"])}
    assert kept <= set(rated)  # never a step without the metric, never NaN
    assert len(kept) == min(n, len(rated))
    better = (lambda a, b: a < b) if mode == "min" else (lambda a, b: a > b)
    for k in kept:
        for other in set(rated) - kept:  # nothing left out beats what is kept; of equal values the newer is kept
            assert not better(rated[other], rated[k])
            assert rated[other] != rated[k] or other < k


def test_keep_best_examples():
    infos = [StepInfo(1, {"loss": 0.5}), StepInfo(2, {"loss": 0.2}), StepInfo(3, {"loss": 0.2}), StepInfo(4, {}),
             StepInfo(5, {"loss": math.nan}), StepInfo(6, {"loss": 0.9, "acc": 0.7}), StepInfo(7, {"acc": 0.9})]
    assert KeepBest(1, "loss").kept(infos) == {3}  # 2 and 3 tie: the newer wins
    assert KeepBest(2, "loss").kept(infos) == {2, 3}
    assert KeepBest(3, "loss").kept(infos) == {1, 2, 3}
    assert KeepBest(10, "loss").kept(infos) == {1, 2, 3, 6}  # 4 has no loss, 5's is NaN: never "best"
    assert KeepBest(1, "loss", mode="max").kept(infos) == {6}
    assert KeepBest(1, "acc", mode="max").kept(infos) == {7}
    assert KeepBest(1, "missing").kept(infos) == frozenset()


@PROPS
@given(infos_st(), st.sets(st.integers(0, 10**6), max_size=10))
def test_keep_steps_keeps_exactly_the_named_committed_steps(infos, named):
    assert KeepSteps(named).kept(infos) == frozenset(i.step for i in infos) & named


@PROPS
@given(infos_st(), policy_st, policy_st)
def test_union_is_the_set_union(infos, a, b):
    union = a | b
    assert isinstance(union, KeepAny)
    assert union.kept(infos) == a.kept(infos) | b.kept(infos)
    assert (a | b | a).kept(infos) == union.kept(infos)
    assert union.metric_names == a.metric_names | b.metric_names


@PROPS
@given(infos_st(), policy_st, st.none() | st.integers(0, 10**6) | st.sets(st.integers(0, 10**6), max_size=3))
def test_steps_to_delete_keeps_the_newest_the_protected_and_what_the_policy_keeps(infos, policy, protect):
    doomed = steps_to_delete(infos, policy, protect=protect)
    steps = {i.step for i in infos}
    protected = set() if protect is None else {protect} if isinstance(protect, int) else protect
    assert doomed == sorted(doomed)
    if steps:
        assert max(steps) not in doomed  # the manager's rule: the newest committed step always stays
    assert set(doomed) == steps - policy.kept(infos) - protected - ({max(steps)} if steps else set())


def test_composition_flattens_and_reads():
    p = KeepLatest(2) | KeepEvery(1000) | KeepBest(3, "loss") | KeepSteps([5, 1])
    assert p.policies == (KeepLatest(2), KeepEvery(1000), KeepBest(3, "loss"), KeepSteps({1, 5}))
    assert repr(p) == "KeepLatest(n=2) | KeepEvery(n=1000) | KeepBest(n=3, metric='loss', mode='min') | KeepSteps([1, 5])"
    assert p.metric_names == {"loss"} and KeepLatest(2).metric_names == frozenset()
    assert KeepLatest(2) | KeepLatest(2) == KeepAny((KeepLatest(2),))
    with pytest.raises(TypeError):
        KeepLatest(2) | 3  # type: ignore[operator]
    assert steps_to_delete(range(1, 11), KeepLatest(2) | KeepEvery(4)) == [1, 2, 3, 5, 6, 7]
    assert steps_to_delete([1, 2, 3], 2) == [1]  # an int is KeepLatest(n), as keep_local=n always meant


@pytest.mark.parametrize("make, match", [
    (lambda: KeepLatest(0), r"KeepLatest\(n\)=0"),
    (lambda: KeepLatest(True), r"KeepLatest\(n\)=True"),
    (lambda: KeepEvery(-1), r"KeepEvery\(n\)=-1"),
    (lambda: KeepEvery(2.5), r"KeepEvery\(n\)=2.5"),
    (lambda: KeepBest(0, "loss"), r"KeepBest\(n\)=0"),
    (lambda: KeepBest(1, ""), "the name of a metric"),
    (lambda: KeepBest(1, "loss", mode="lowest"), "use 'min'"),
    (lambda: KeepSteps("12"), "collection of step numbers"),
    (lambda: KeepSteps([1, -2]), "KeepSteps step=-2"),
    (lambda: KeepAny((KeepLatest(1), 3)), "not a retention policy"),
])
def test_invalid_policies_say_how_to_fix_them(make, match):
    with pytest.raises(CheckpointConfigError, match=match):
        make()


def test_options_take_an_int_a_policy_or_none():
    assert ManagerOptions(keep_local=3).local_retention == KeepLatest(3)
    assert ManagerOptions(keep_local=None).local_retention is None
    p = KeepLatest(1) | KeepBest(2, "loss")
    assert ManagerOptions(keep_local=p, remote="memory://x", keep_remote=KeepEvery(10)).remote_retention == KeepEvery(10)
    assert ManagerOptions(keep_local=p).local_retention is p
    for bad in (0, -1, True, "2", 2.0, [KeepLatest(1)]):
        with pytest.raises(CheckpointConfigError, match="keep_local=.* is invalid: pass a whole number >= 1 .*a retention policy"):
            ManagerOptions(keep_local=bad)  # type: ignore[arg-type]
    with pytest.raises(CheckpointConfigError, match="has no effect without a remote tier"):
        ManagerOptions(keep_remote=KeepLatest(1))


# ------------------------------------------------------------------ metrics on disk

metrics_st = st.dictionaries(
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=MAX_METRIC_NAME).filter(str.isprintable),
    st.integers(-(1 << 63), (1 << 63) - 1) | st.floats(allow_nan=False, allow_infinity=False),
    max_size=MAX_METRICS,
)


@PROPS
@given(metrics_st)
def test_metrics_round_trip_in_manifest_and_commit(metrics):
    m = dataclasses.replace(golden_manifest(), metrics=metrics)
    data = encode_manifest(m)
    assert decode_manifest(data, WHERE) == m and encode_manifest(decode_manifest(data, WHERE)) == data
    c = dataclasses.replace(golden_commit(), metrics=metrics)
    raw = encode_commit(c)
    assert decode_commit(raw, WHERE) == c and decode_commit(raw, WHERE).metrics == metrics
    assert len(raw) < MAX_COMMIT_BYTES
    assert ("metrics" in json.loads(data)) == bool(metrics)  # without metrics the bytes are those of before


@pytest.mark.parametrize("bad, match", [
    ([1], "must be an object"),
    ({"loss": "0.3"}, "not a number"),
    ({"loss": True}, "not a number"),
    ({"loss": None}, "not a number"),
    ({"": 1}, "1-128 printable"),
    ({"a\nb": 1}, "1-128 printable"),
    ({"x" * 129: 1}, "1-128 printable"),
    ({"big": 1 << 63}, "within 64 bits"),
    ({f"m{i}": i for i in range(MAX_METRICS + 1)}, "at most 64"),
])
def test_bad_metrics_on_disk_are_rejected(bad, match):
    manifest = json.loads(encode_manifest(golden_manifest()))
    commit = json.loads(encode_commit(golden_commit()))
    for obj, decode in ((manifest, decode_manifest), (commit, decode_commit)):
        obj["metrics"] = bad
        with pytest.raises(ManifestError, match=match):
            decode(json.dumps(obj).encode(), WHERE)


def test_an_overflowing_float_on_disk_is_not_finite():
    raw = encode_commit(golden_commit()).replace(b'"format_version"', b'"metrics":{"loss":1e400},"format_version"')
    with pytest.raises(ManifestError, match="must be finite"):
        decode_commit(raw, WHERE)


def test_save_checks_metrics_and_stores_them_in_manifest_and_commit(tmp_path):
    with CheckpointManager(tmp_path / "ck", keep_local=None, fsync=False) as mgr:
        state = {"w": torch.arange(4.0)}
        for bad, match in [
            ({"loss": math.nan}, "'loss' is nan: a metric must be finite"),
            ({"loss": math.inf}, "must be finite"),
            ({"loss": torch.tensor(0.5)}, r"a Tensor \(a tensor: pass loss.item\(\)\)"),
            ({"loss": "low"}, "is a str"),
            ({"ok": True}, "is a bool"),
            ({"": 1.0}, "printable"),
            ([("loss", 1.0)], "takes a dict of names to numbers"),
        ]:
            with pytest.raises(CheckpointConfigError, match=match):
                mgr.save(1, state, metrics=bad)
        mgr.save(1, state, metrics={"loss": np.float32(0.25), "tokens": np.int64(7), "lr": 3e-4}).wait()  # numpy scalars are numbers
        mgr.save(2, state).wait()
        marker = catalog.read_commit(mgr.storage, 1)
        assert marker.metrics == {"loss": 0.25, "tokens": 7, "lr": 3e-4} and type(marker.metrics["tokens"]) is int
        assert catalog.load_manifest(mgr.storage, 1).metrics == marker.metrics
        assert catalog.read_commit(mgr.storage, 2).metrics == {} and b"metrics" not in mgr.storage.get(naming.commit_name(2))


# ------------------------------------------------------------------ end to end, one rank

N = 1 << 14  # floats per tensor: 64 KiB, four chunks of 16 KiB
CHANGES = {1: "abcd", 2: "a", 3: "b", 4: "c", 5: "a", 6: "b", 7: "c", 8: "a", 9: "b", 10: "c"}  # "d" only ever in step 1


def values(step: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, k in enumerate("abcd"):
        times = sum(k in CHANGES[s] for s in range(1, step + 1))
        out[k] = torch.randn(N, generator=torch.Generator().manual_seed(i)) + times
    return out


class Trainer:
    """One state updated in place, only the tensors a step changes: later saves borrow the rest."""

    def __init__(self) -> None:
        self.state = {k: torch.zeros(N) for k in "abcd"}

    def to(self, step: int) -> dict[str, torch.Tensor]:
        for k, v in values(step).items():
            if not torch.equal(self.state[k], v):
                self.state[k].copy_(v)
        return self.state


def manager(d: Path, **kwargs) -> CheckpointManager:
    return CheckpointManager(d, chunk_bytes=16 << 10, fsync=False, **kwargs)


def restores_exactly(mgr: CheckpointManager, step: int) -> bool:
    out = {k: torch.full((N,), -1.0) for k in "abcd"}
    assert mgr.restore(out, step=step) == step
    return all(torch.equal(out[k], v) for k, v in values(step).items())


def test_keep_latest_or_every_on_the_local_tier(tmp_path):
    t = Trainer()
    with manager(tmp_path / "ck", keep_local=KeepLatest(2) | KeepEvery(4)) as mgr:
        for step in range(1, 11):
            mgr.save(step, t.to(step)).wait()
            assert mgr.steps() == [s for s in range(1, step + 1) if s >= step - 1 or s % 4 == 0], step
        assert mgr.steps() == [4, 8, 9, 10]
        assert "keep_local=KeepLatest(n=2) | KeepEvery(n=4)" in repr(mgr)
        for step in mgr.steps():
            assert restores_exactly(mgr, step), step


def test_keep_best_uses_the_stored_metrics_after_a_restart(tmp_path, run_cli):
    losses = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.5, 5: 0.8, 6: 0.6}
    t = Trainer()
    with manager(tmp_path / "ck", keep_local=None) as mgr:  # keeps everything: no ranking in this process
        for step, loss in losses.items():
            mgr.save(step, t.to(step), metrics={"loss": loss, "acc": 1 - loss}).wait()
    code, out = run_cli("ls", str(tmp_path / "ck"), "--json")
    rows = {r["step"]: r for r in json.loads(out)}
    assert code == 0 and rows[2]["metrics"] == {"loss": 0.5, "acc": 0.5} and rows[6]["metrics"]["loss"] == 0.6
    code, out = run_cli("ls", str(tmp_path / "ck"))
    assert code == 0 and "acc=0.5 loss=0.5" in out, out
    with manager(tmp_path / "ck", keep_local=KeepBest(1, "loss")) as mgr:
        assert mgr.steps() == [1, 2, 3, 4, 5, 6]  # opening deletes nothing; retention runs after a save
        mgr.save(7, t.to(7), metrics={"loss": 0.95}).wait()
        assert mgr.steps() == [4, 7]  # 2 and 4 tie at 0.5: the newer stays; 7 is the newest, kept whatever its loss
        assert restores_exactly(mgr, 4)
        mgr.save(8, t.to(8), metrics={"loss": 0.1}).wait()
        assert mgr.steps() == [8]
        assert restores_exactly(mgr, 8)


def test_keep_best_warns_once_when_saves_lack_its_metric(tmp_path, caplog):
    with manager(tmp_path / "ck", keep_local=KeepBest(1, "val_loss") | KeepLatest(1)) as mgr, caplog.at_level(logging.WARNING, "checkpointing"):
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.zeros(4)}, metrics={"loss": 1.0}).wait()
        assert mgr.steps() == [3]
    warned = [r.getMessage() for r in caplog.records if "saved without metrics" in r.getMessage()]
    assert len(warned) == 1 and "['val_loss']" in warned[0] and "step 1" in warned[0], warned


def test_incremental_saves_borrowing_from_retired_steps_restore_bit_exact(tmp_path, run_cli):
    t = Trainer()
    ck = tmp_path / "ck"
    with manager(ck, keep_local=KeepEvery(3) | KeepLatest(1)) as mgr:
        for step in range(1, 8):
            mgr.save(step, t.to(step)).wait()
        assert mgr.steps() == [3, 6, 7]
        stats = mgr.stats()
        assert all(s.bytes_reused > 0 for s in stats[1:])  # every save after the first borrowed (tensor "d" at least)
    assert (ck / naming.step_dir(1)).is_dir() and not (ck / naming.commit_name(1)).exists()  # retired, its "d" still borrowed
    code, out = run_cli("gc", str(ck))
    assert code == 0, out
    storage = open_storage(str(ck))
    for step in (3, 6, 7):
        report = verify_step(storage, step)
        assert report.ok, report.problems
    with manager(ck, keep_local=None) as mgr:
        for step in (3, 6, 7):
            assert restores_exactly(mgr, step), step


# ------------------------------------------------------------------ the remote tier (moto S3)


def test_keep_remote_policy_on_s3(tmp_path, s3_bucket):
    url, options = s3_bucket
    acc = {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.3, 5: 0.4, 6: 0.5, 7: 0.6}
    t = Trainer()
    keep_remote = KeepEvery(3) | KeepBest(1, "acc", mode="max")
    with manager(tmp_path / "node", remote=url, storage_options=options, keep_local=1, keep_remote=keep_remote,
                 upload_part_bytes=5 << 20) as mgr:
        mgr.remote_storage.retry = RetryPolicy(attempts=4, base_s=0.001, cap_s=0.005)
        for step, a in acc.items():
            mgr.save(step, t.to(step), metrics={"acc": a})
        mgr.wait()
        assert mgr.tiers() == {2: "remote", 3: "remote", 6: "remote", 7: "local+remote"}
    remote = open_storage(url, options)
    assert catalog.read_commit(remote, 2).metrics == {"acc": 0.9}
    for step in (2, 3, 6, 7):
        report = verify_step(remote, step)
        assert report.ok, report.problems
    with manager(tmp_path / "fresh", remote=url, storage_options=options, keep_local=None) as mgr:  # a replaced node
        for step in (2, 3, 6, 7):
            assert restores_exactly(mgr, step), step


# ------------------------------------------------------------------ two ranks: rank 0's metrics are the step's


def _two_ranks_keep_best(rank: int, world: int, directory: str) -> tuple[list[int], dict]:
    losses = {1: (0.3, 0.9), 2: (0.9, 0.1), 3: (0.8, 0.8)}  # (rank 0's, rank 1's)
    with CheckpointManager(directory, keep_local=KeepBest(1, "loss"), fsync=False, timeout_s=60) as mgr:
        for step, per_rank in losses.items():
            mgr.save(step, {"w": torch.full((8,), float(step))}, metrics={"loss": per_rank[rank], "rank": rank}).wait()
        mgr.wait()  # on rank 1 too: until the tier's leader (rank 0) retired what it does not keep
        return mgr.steps(), dict(catalog.read_commit(mgr.storage, 1).metrics)


def test_with_two_ranks_rank_zeros_metrics_decide(tmp_path):
    results = run_ranks(_two_ranks_keep_best, 2, str(tmp_path / "shared"), tmp=tmp_path)
    for steps, metrics in results:
        assert steps == [1, 3], results  # by rank 1's losses step 2 would have been the best
        assert metrics == {"loss": 0.3, "rank": 0}


def test_policies_are_public_retention_policies():
    for p in (KeepLatest(1), KeepEvery(1), KeepBest(1, "m"), KeepSteps([]), KeepLatest(1) | KeepEvery(2)):
        assert isinstance(p, RetentionPolicy)
        assert hash(p) == hash(dataclasses.replace(p)) and p == dataclasses.replace(p)
    assert StepInfo(3, {"a": 1.0}) == StepInfo(3, {"a": 1.0}) and StepInfo(3).metrics == {}


def _two_ranks_keep_one(rank: int, world: int, directory: str) -> list[list[int]]:
    seen = []
    with CheckpointManager(directory, keep_local=1, fsync=False, timeout_s=60) as mgr:
        for step in range(1, 9):
            mgr.save(step, {"w": torch.full((1 << 12,), float(step))})
            mgr.wait()
            seen.append(mgr.steps())
    return seen


def test_after_wait_every_rank_sharing_a_tier_lists_what_its_leader_kept(tmp_path):
    for rank_views in run_ranks(_two_ranks_keep_one, 2, str(tmp_path / "shared"), tmp=tmp_path):
        assert rank_views == [[s] for s in range(1, 9)], rank_views
