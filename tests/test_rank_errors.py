"""Failures of several ranks read once: per-rank causes grouped by cause ("ranks 0-1, 3: A; rank 2: B"),
as pure functions and as 4 gloo ranks see them when their saves fail (real faults, nothing mocked)."""

from __future__ import annotations

import time

import pytest

import _dist
from _dist import run_ranks
from checkpointing.dist.restore_agreement import RestoreView, agreed_step
from checkpointing.errors import (
    CheckpointError,
    CoordinationTimeout,
    RanksFailedError,
    UploadRanksFailed,
    CheckpointMismatchError,
    cause_groups,
    group_by_cause,
    problem_lines,
    rank_ranges,
)

# ----------------------------------------------------------------------------- the formatter


@pytest.mark.parametrize("ranks, text", [
    ([2], "rank 2"),
    ([0], "rank 0"),
    ([3, 0, 2, 1], "ranks 0-3"),
    ([0, 1, 3], "ranks 0-1, 3"),
    ([0, 2], "ranks 0, 2"),
    ([10, 9, 0, 5, 7, 6, 6], "ranks 0, 5-7, 9-10"),
    ([], "no rank"),
])
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def test_a_run_of_sibling_keys_with_one_message_reads_as_one_line():
    # an RNG state's Mersenne words, each saved per rank, restored on another world size
    per_rank = "saved per rank (the 2 saving ranks hold different values)"
    problems = ["model/weight: missing", *(f"rng/python/state/{i}: {per_rank}" for i in range(1, 624)),
                "rng/numpy/keys: " + per_rank, "a/0: x", "a/1: x", "a/2: x"]
    lines = problem_lines(problems)
    assert lines == ["model/weight: missing",
                     f"rng/python/state/1 ... rng/python/state/623 (623 keys under rng/python/state/): {per_rank}",
                     "rng/numpy/keys: " + per_rank, "a/0: x", "a/1: x", "a/2: x"]  # fewer than 4 keys (a run counts as one)
    err = CheckpointMismatchError(7, problems)
    assert err.problems == problems and "(628 problem(s))" in str(err) and "rng/python/state/5:" not in str(err)
    assert "model/weight: missing" in str(err) and "rng/numpy/keys" in str(err)


def test_keys_with_one_message_share_its_line_wherever_they_are():
    # a per-rank RNG state and a per-rank counter, restored on another world size: one reason, said once
    per_rank = "saved per rank, and 1 rank(s) restore now"
    problems = [f"model/weight: {per_rank}", "model/bias: missing", f"rng/torch: {per_rank}", f"pos/i: {per_rank}",
                f"pos/epoch: {per_rank}"]
    assert problem_lines(problems) == [f"model/weight, rng/torch, pos/i, pos/epoch: {per_rank}", "model/bias: missing"]
    many = [f"k{i}: missing in the checkpoint" for i in range(100)]
    assert problem_lines(many) == [", ".join(f"k{i}" for i in range(11)) + " and 89 more keys: missing in the checkpoint"]


def test_a_long_list_of_different_problems_is_cut_and_counted():
    problems = [f"k{i}: missing in the checkpoint ({i})" for i in range(100)]
    lines = problem_lines(problems)  # top-level keys, each its own message: each its own line, then cut
    assert len(lines) == 40 and lines[0] == problems[0] and lines[38] == problems[38]
    assert lines[-1] == "... and 61 more (the error's .problems lists every one)"


def test_the_same_cause_on_every_rank_reads_once():
    reason = "StateError: state['bad'] is a builtins.object, which is not checkpointable"
    assert group_by_cause({r: reason for r in (3, 1, 0, 2)}) == f"ranks 0-3: {reason}"


def test_different_causes_are_grouped_in_order_of_their_lowest_rank():
    assert group_by_cause({0: "A", 1: "A", 2: "B", 3: "A"}) == "ranks 0-1, 3: A; rank 2: B"
    assert group_by_cause({3: "A", 0: "B", 1: "A"}) == "rank 0: B; ranks 1, 3: A"
    assert group_by_cause({5: "only one"}) == "rank 5: only one"
    assert group_by_cause({}) == ""
    assert cause_groups({2: "B", 0: "A", 1: "B"}) == [((0,), "A"), ((1, 2), "B")]


def test_causes_that_name_their_own_rank_still_group():
    """A write failure names the rank's own pack file (r0000N.<token>.pack) or says "rank N"."""
    files = {r: f"OSError: [Errno 30] Read-only file system: 'step-0000000002/r{r:05d}.ab12.pack'" for r in range(4)}
    assert group_by_cause(files) == "ranks 0-3: OSError: [Errno 30] Read-only file system: 'step-0000000002/r<rank>.ab12.pack'"
    lost = {r: f"rank {r} lost the torch.distributed store" for r in (1, 2)} | {0: "MergeError: x"}
    assert group_by_cause(lost) == "rank 0: MergeError: x; ranks 1-2: rank <rank> lost the torch.distributed store"
    # alone, a rank keeps its own words
    assert group_by_cause({0: "A", 2: "rank 2 lost the store"}) == "rank 0: A; rank 2: rank 2 lost the store"


def test_only_a_ranks_own_number_is_hidden():
    # the same words about rank 0 on every rank (rank 0's included) are one cause, word for word
    same = {r: "rank 0 (the coordinator) published no manifest in time" for r in range(3)}
    assert group_by_cause(same) == "ranks 0-2: rank 0 (the coordinator) published no manifest in time"
    # each naming another rank: not one cause
    assert group_by_cause({1: "rank 2 failed", 2: "rank 1 failed"}) == "rank 1: rank 2 failed; rank 2: rank 1 failed"
    # a longer number that starts or ends with the rank's is not the rank's
    assert group_by_cause({1: "x r00011", 11: "x r00001"}) == "rank 1: x r00011; rank 11: x r00001"
    assert group_by_cause({1: "error 1", 2: "error 2"}) == "rank 1: error 1; rank 2: error 2"


def test_ranks_failed_error_keeps_step_count_and_every_cause():
    exc = RanksFailedError(7, {3: "B", 0: "A", 1: "A", 2: "A"})
    assert str(exc) == "step 7 failed on 4 ranks: ranks 0-2: A; rank 3: B"
    assert exc.failures == {0: "A", 1: "A", 2: "A", 3: "B"} and list(exc.failures) == [0, 1, 2, 3]
    assert str(RanksFailedError(1, {2: "A"})) == "step 1 failed on 1 rank: rank 2: A"
    up = UploadRanksFailed({1: "AccessDenied", 0: "AccessDenied"})
    assert str(up) == "2 ranks failed: ranks 0-1: AccessDenied" and up.failures == {0: "AccessDenied", 1: "AccessDenied"}


def test_restore_agreement_groups_errors_and_notes():
    views = [RestoreView([], "", "OSError: disk gone") for _ in range(4)]
    with pytest.raises(CheckpointError, match=r"^restore failed on ranks 0-3: OSError: disk gone$"):
        agreed_step(views, None)
    note = "step 3 is not committed in /ck"
    views = [RestoreView([1, 3], "it can"), RestoreView([1], note), RestoreView([1], note), RestoreView([1], "other")]
    with pytest.raises(CheckpointError) as info:
        agreed_step(views, 3)
    assert str(info.value) == f"step 3 cannot be restored: ranks 1-2 cannot read it ({note}); rank 3 cannot read it (other)"


def test_ranks_asking_for_different_steps_are_told_so():
    views = [RestoreView([30], "it can", requested=30), RestoreView([25], "it can", requested=25), RestoreView([30], "it can", requested=30)]
    with pytest.raises(CheckpointError) as info:
        agreed_step(views, 30)
    assert str(info.value) == ("the ranks asked restore() for different steps (ranks 0, 2: step=30; rank 1: step=25): "
                               "every rank must pass the same step, or step=None on every rank")


def test_a_timeout_names_the_silent_ranks_as_ranges():
    from torch.distributed import HashStore

    from checkpointing.dist import keys
    from checkpointing.dist.store import wait_keys

    store = HashStore()
    store.set(keys.save_part(0, 0), b"{}")
    store.set(keys.save_part(0, 3), b"{}")
    waited = [keys.save_part(0, r) for r in range(5)]
    with pytest.raises(CoordinationTimeout) as info:
        wait_keys(store, waited, time.monotonic(), "step 1: waiting for every rank's report", timeout_s=5)
    assert info.value.ranks == [1, 2, 4]
    assert "step 1: waiting for every rank's report: ranks 1-2, 4 did not answer in time (timeout_s=5;" in str(info.value)


def test_reports_naming_a_silent_rank_end_the_wait_for_it():
    """A rank that timed out waiting for rank 1 (a peer on its node) says so at its `silent` key:
    rank 0 then stops waiting for rank 1's report (waiting a second timeout_s for a dead rank)."""
    import json as _json

    from torch.distributed import HashStore

    from checkpointing.dist import keys
    from checkpointing.dist.store import wait_reports

    store = HashStore()
    parts, silent = [keys.save_part(0, r) for r in range(4)], [keys.save_silent(0, r) for r in range(4)]
    cause = "CoordinationTimeout: step 1: waiting for local-tier peers: rank 1 did not answer in time (timeout_s=600)"
    store.set(parts[0], _json.dumps({"ok": False, "error": cause, "root": True}))
    store.set(silent[0], _json.dumps({"ranks": [1], "error": cause}))
    store.set(parts[2], b'{"ok": true, "part": 2}')
    store.set(parts[3], _json.dumps({"ok": False, "error": "aborted because another rank failed", "root": False}))
    far = time.monotonic() + 600  # no timeout is reached: the silent key tells
    assert wait_reports(store, parts, silent, far, "step 1: waiting for every rank's report", timeout_s=600, slice_s=0.01) == {1: cause}
    store.set(parts[1], b'{"ok": true}')  # every report there: nobody is silent
    assert wait_reports(store, parts, silent, far, "x", timeout_s=600) == {}
    other = HashStore()  # missing reports no silent key names: the timeout, naming them
    other.set(parts[0], _json.dumps({"ok": False, "error": cause, "root": True}))
    other.set(silent[0], _json.dumps({"ranks": [1], "error": cause}))
    with pytest.raises(CoordinationTimeout) as info:
        wait_reports(other, parts, silent, time.monotonic() + 0.05, "step 1: waiting for every rank's report", timeout_s=5, slice_s=0.01)
    assert info.value.ranks == [1, 2, 3]


# ----------------------------------------------------------------------------- 4 gloo ranks

WORLD = 4
FSIZE = "OSError: [Errno 27] File too large"
STATE = "StateError: state['bad'] is a builtins.object, which is not checkpointable"


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    """Step 2 fails on every rank for the same write failure, step 3 on every rank for the same value that
    cannot be checkpointed, step 4 on ranks 0, 1 and 3 for the write and on rank 2 for the value."""
    tmp = tmp_path_factory.mktemp("failed")
    plans = [
        {r: "fsize" for r in range(WORLD)},
        {r: "state" for r in range(WORLD)},
        {0: "fsize", 1: "fsize", 2: "state", 3: "fsize"},
    ]
    return run_ranks(_dist.failing_saves, WORLD, str(tmp / "ck"), plans, tmp=tmp)


def test_the_same_write_failure_on_every_rank_reads_once(failed):
    for rank, per_step in enumerate(failed):
        message, logged = per_step[0]
        assert message.startswith(f"CheckpointSaveError: save of step 2 failed: RanksFailedError: step 2 failed on 4 ranks: ranks 0-3: {FSIZE}"), (rank, message)
        assert "(writing a pack file in " in message and "step-0000000002). " in message, message  # where, said once
        assert message.count("ranks 0-3: ") == 1 and message.count("File too large") == 1, message
        assert "rank 0" not in message and "rank 3" not in message, message
        [line] = [line for line in logged if "step 2 failed on" in line]
        assert line.count("ranks 0-3: ") == 1 and line.count("File too large") == 1, line


def test_the_same_unsupported_value_on_every_rank_reads_once(failed):
    """save() raises the StateError on each rank; the step's verdict, logged on each rank, says it once."""
    for rank, per_step in enumerate(failed):
        message, logged = per_step[1]
        assert message.startswith(STATE) and message.count("not checkpointable") == 1, (rank, message)
        [line] = [line for line in logged if "step 3 failed on" in line]
        assert f"step 3 failed on 4 ranks: ranks 0-3: {STATE}" in line, (rank, line)
        assert line.count("ranks 0-3: ") == 1 and line.count("not checkpointable") == 1, line


def test_different_causes_are_grouped_by_cause(failed):
    expected = f"step 4 failed on 4 ranks: ranks 0-1, 3: {FSIZE} (writing a pack file in "
    for rank, per_step in enumerate(failed):
        message, logged = per_step[2]
        if rank == 2:
            assert message.startswith(STATE), message
            [message] = [line for line in logged if "step 4 failed on" in line]
        assert expected in message and f"step-0000000004); rank 2: {STATE}" in message, (rank, message)
        assert message.count("File too large") == 1 and message.count("not checkpointable") == 1, message


def test_only_keys_numbered_one_after_the_other_read_as_a_range():
    # every other layer's weight mismatched: no "model/0.weight ... model/28.weight" that a reader takes for all of them
    why = "saved float32[4, 4], target is float32[4, 5]"
    problems = [f"model/{i}.weight: {why}" for i in range(0, 30, 2)]
    line, = problem_lines(problems)
    assert " ... " not in line and line.startswith("model/0.weight, model/2.weight, ") and line.endswith(f"and 4 more keys: {why}")
    words = [f"rng/state/{i}: x" for i in (*range(1, 9), *range(10, 13))]  # 9 is missing: two runs
    assert problem_lines(words) == ["rng/state/1 ... rng/state/8 (8 keys under rng/state/), rng/state/10, rng/state/11, "
                                    "rng/state/12: x"]


def test_a_line_counts_the_keys_it_leaves_out_runs_included():
    why = "saved float32[3], target is float32[4]"
    problems = [f"x/p{p:02d}/{g}: {why}" for p in range(13) for g in range(4)]  # 13 runs of 4 numbered siblings
    line, = problem_lines(problems)
    assert line.endswith(f"and 8 more keys: {why}"), line  # 11 runs named (44 keys), 2 runs of 4 left out
    assert line.count(" keys under x/p") == 11


def test_ranks_that_pass_different_steps_commit_nothing_and_every_rank_hears_why(tmp_path):
    """Rank 0 saves step 2, rank 1 step 3: step 2 was committed naming rank 1's file in step 3's directory, which
    went when step 3 failed (an unreadable step; rank 0 was told it succeeded)."""
    results = run_ranks(_dist.different_steps, 2, str(tmp_path / "ck"), tmp=tmp_path)
    for rank, out in enumerate(results):
        assert out["error"] is not None and "ranks passed different steps to save(): rank 0 step 2, rank 1 3" in out["error"], (rank, out)
        assert out["steps"] == [1, 4] and out["restored"] == 4 and out["same"], (rank, out)
