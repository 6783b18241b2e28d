"""plan_pack and retention: pure planning, checked by properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointing.options import MIN_CHUNK_BYTES
from checkpointing.plan.pack import POOL_ALIGN, plan_pack, round_up
from checkpointing.plan.resume import ResumeOffer, resume_plan
from checkpointing.plan.retention import steps_to_delete

PROPS = settings(max_examples=150, deadline=None)

leaf_sizes = st.lists(st.integers(0, 200_000) | st.sampled_from([0, 1, 63, 64, 65, 4095, 4096, 4097, 1 << 16]), max_size=12)
chunk_sizes = st.integers(MIN_CHUNK_BYTES, 1 << 16) | st.sampled_from([4096, 4097, 8192, 1 << 16, 1 << 23])


@st.composite
def plan_inputs(draw):
    sizes = draw(leaf_sizes)
    deferred = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    chunk = draw(chunk_sizes)
    # ManagerOptions requires budget >= 2 * chunk_bytes
    budget = draw(st.none() | st.integers(2 * chunk, 2 * chunk + 600_000))
    return sizes, deferred, chunk, budget


def check_plan(sizes, deferred, chunk, budget):
    plan = plan_pack(sizes, deferred, chunk_bytes=chunk, budget=budget)
    pool = plan.pool_bytes
    ps = plan.placements

    # every byte of every leaf is placed exactly once, in order, in chunks of at most chunk_bytes
    for leaf, n in enumerate(sizes):
        mine = [p for p in ps if p.leaf == leaf]
        assert [p.src_offset for p in mine] == [sum(q.length for q in mine[:i]) for i in range(len(mine))]
        assert sum(p.length for p in mine) == n
        assert all(0 < p.length <= chunk for p in mine)
    assert plan.data_bytes == sum(sizes)

    # eager leaves first, then deferred ones; eager_placements counts the eager prefix
    kinds = [deferred[p.leaf] for p in ps]
    assert kinds == sorted(kinds)
    assert plan.eager_placements == kinds.count(False)
    order = [p.leaf for p in ps]
    first_seen = list(dict.fromkeys(order))
    expected = [i for i, d in enumerate(deferred) if not d and sizes[i]] + [i for i, d in enumerate(deferred) if d and sizes[i]]
    assert first_seen == expected  # state order kept within each group
    assert all(order[i] <= order[i + 1] or deferred[order[i + 1]] != deferred[order[i]] for i in range(len(order) - 1))

    # pack layout: increasing, non-overlapping; ends at pack_bytes
    for a, b in zip(ps, ps[1:]):
        assert a.pack_offset + a.length <= b.pack_offset
    assert plan.pack_bytes == (ps[-1].pack_offset + ps[-1].length if ps else 0)

    if budget is None or budget >= plan.data_bytes:
        # no ring: chunks back to back and the pool is exactly the data
        for a, b in zip(ps, ps[1:]):
            assert a.pack_offset + a.length == b.pack_offset
        assert pool == plan.pack_bytes == plan.data_bytes
        return plan
    # a ring: whole pages, within the budget, nobody straddles its end, room for a chunk + a page
    assert pool % POOL_ALIGN == 0 and 2 * POOL_ALIGN <= pool <= max(budget, 2 * POOL_ALIGN)
    assert pool >= budget // POOL_ALIGN * POOL_ALIGN
    for p in ps:
        assert p.pack_offset % pool + p.length <= pool, (p, pool)
        assert p.length + POOL_ALIGN <= pool
    # the padding is bounded: each skipped ring tail is shorter than a chunk
    assert plan.pack_bytes <= 2 * plan.data_bytes
    return plan


@PROPS
@given(plan_inputs())
def test_plan_pack_properties(args):
    check_plan(*args)


@PROPS
@given(leaf_sizes, st.sampled_from([4096, 8192, 1 << 16, 1 << 20]))
def test_without_budget_the_pool_holds_the_whole_pack(sizes, chunk):
    """Without a budget the pool is the identity (no ring)."""
    plan = check_plan(sizes, [False] * len(sizes), chunk, None)
    assert plan.pack_bytes <= plan.pool_bytes
    assert all(p.pack_offset < plan.pool_bytes for p in plan.placements)


@PROPS
@given(leaf_sizes, chunk_sizes)
def test_without_budget_the_pool_holds_the_whole_pack_any_chunk_size(sizes, chunk):
    """The module docstring: 'With a pool at least as large as the data this is the identity'.

    chunk_bytes only has to be >= 4096 (ManagerOptions); any size keeps the identity.
    """
    plan = check_plan(sizes, [False] * len(sizes), chunk, None)
    assert plan.pack_bytes <= plan.pool_bytes, (plan.pack_bytes, plan.pool_bytes)


def test_examples():
    plan = plan_pack([10, 100], [True, False], chunk_bytes=4096, budget=None)
    assert [(p.leaf, p.src_offset, p.length, p.pack_offset) for p in plan.placements] == [(1, 0, 100, 0), (0, 0, 10, 100)]
    assert plan.eager_placements == 1 and plan.pack_bytes == 110 and plan.pool_bytes == 110

    empty = plan_pack([], [], chunk_bytes=4096, budget=None)
    assert empty.placements == () and empty.pack_bytes == 0 and empty.pool_bytes == 0

    zeros = plan_pack([0, 0], [False, True], chunk_bytes=4096, budget=None)
    assert zeros.placements == () and zeros.eager_placements == 0

    # a ring of 8192 bytes with 3000-byte chunks: the third chunk would straddle, it skips to 8192
    ring = plan_pack([9000], [False], chunk_bytes=3000, budget=8192 + 100)
    assert ring.pool_bytes == 8192
    assert [(p.src_offset, p.length, p.pack_offset) for p in ring.placements] == [
        (0, 3000, 0), (3000, 3000, 3000), (6000, 3000, 8192),
    ]


def test_budget_larger_than_data_changes_nothing():
    a = plan_pack([5000, 7000], [False, True], chunk_bytes=4096, budget=None)
    b = plan_pack([5000, 7000], [False, True], chunk_bytes=4096, budget=1 << 30)
    assert a == b


def test_chunk_larger_than_pool_is_clamped():
    plan = plan_pack([100_000], [False], chunk_bytes=1 << 20, budget=3 * 4096 + 5)
    assert plan.pool_bytes == 3 * 4096
    assert all(p.length <= plan.pool_bytes for p in plan.placements)
    check_plan([100_000], [False], 1 << 20, 3 * 4096 + 5)


@pytest.mark.parametrize("n,align,expected", [(0, 64, 0), (1, 64, 64), (64, 64, 64), (65, 64, 128), (4097, 4096, 8192)])
def test_round_up(n, align, expected):
    assert round_up(n, align) == expected


# ---------------------------------------------------------------- retention


@PROPS
@given(st.sets(st.integers(0, 10**10 - 1), max_size=30), st.integers(1, 35), st.none() | st.integers(0, 10**10 - 1))
def test_steps_to_delete_properties(committed_set, keep, protect):
    committed = list(committed_set)
    doomed = steps_to_delete(committed, keep, protect=protect)
    kept = committed_set - set(doomed)
    assert set(doomed) <= committed_set
    assert len(doomed) == len(set(doomed))
    assert protect not in doomed
    newest = sorted(committed_set)[-keep:]
    assert set(newest) <= kept  # the newest `keep` always stay
    assert kept <= set(newest) | {protect}  # nothing else stays but the protected step
    assert doomed == sorted(doomed)  # oldest first


@PROPS
@given(st.lists(st.integers(0, 100), max_size=20), st.integers(1, 5))
def test_steps_to_delete_ignores_input_order(steps, keep):
    steps = list(dict.fromkeys(steps))
    assert steps_to_delete(steps, keep) == steps_to_delete(sorted(steps), keep) == steps_to_delete(steps[::-1], keep)


def test_steps_to_delete_examples():
    assert steps_to_delete([], 1) == []
    assert steps_to_delete([1, 2, 3], 2) == [1]
    assert steps_to_delete([3, 1, 2], 1) == [1, 2]
    assert steps_to_delete([1, 2, 3], 1, protect=1) == [2]
    assert steps_to_delete([1, 2, 3], 5) == []
    for bad in (0, -1):
        with pytest.raises(ValueError):
            steps_to_delete([1], bad)


# ---------------------------------------------------------------- resuming interrupted uploads


def _offer(need: list[tuple[str, int]], have: set[str], digest: str = "d") -> ResumeOffer:
    return ResumeOffer(digest, 2, tuple(need), frozenset(have))


NEED = [("step-1/a", 0), ("step-1/b", 1), ("step-0/c", 1)]  # an incremental step: one file from an earlier step


def test_at_the_same_world_size_each_rank_sends_the_files_it_wrote():
    everything = {p for p, _ in NEED}
    plan = resume_plan([{1: _offer(NEED, everything)}, {1: _offer(NEED, everything)}])
    assert plan.sends == {1: (("step-1/a",), ("step-1/b", "step-0/c"))} and plan.left == {}


def test_on_fewer_ranks_the_lowest_holder_sends_what_its_writer_is_not_there_to_send():
    everything = {p for p, _ in NEED}
    assert resume_plan([{1: _offer(NEED, everything)}]).sends == {1: (("step-1/a", "step-1/b", "step-0/c"),)}
    # three ranks restart, the third on a new node: the writers (0 and 1) still send their own files
    plan = resume_plan([{1: _offer(NEED, {"step-1/a"})}, {1: _offer(NEED, everything)}, {1: _offer(NEED, set())}])
    assert plan.sends == {1: (("step-1/a",), ("step-1/b", "step-0/c"), ())}


def test_a_step_is_left_when_a_file_is_nowhere_or_rank_0_lacks_the_step_or_the_saves_differ():
    everything = {p for p, _ in NEED}
    plan = resume_plan([{1: _offer(NEED, {"step-1/a"}), 2: _offer(NEED, {"step-1/a"}), 3: _offer(NEED, set(), "x")},
                        {2: _offer(NEED, {"step-1/b", "step-0/c"}), 3: _offer(NEED, set(), "y"), 4: _offer(NEED, everything)}])
    assert plan.sends == {2: (("step-1/a",), ("step-1/b", "step-0/c"))}
    assert "no rank of this job holds 2 of its files (e.g. step-1/b)" in plan.left[1]
    assert plan.left[3] == "the ranks' local tiers hold different saves of it"
    assert plan.left[4] == "not committed on the local tier of rank 0 (which commits it on the remote tier)"


def test_a_node_added_since_takes_part_with_nothing_to_send():
    everything = {p for p, _ in NEED}
    plan = resume_plan([{1: _offer(NEED, everything)}, {1: _offer(NEED, everything)}, {}])  # 2 -> 3 ranks: rank 2 is new
    assert plan.sends == {1: (("step-1/a",), ("step-1/b", "step-0/c"), ())} and plan.left == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sets(st.sampled_from([p for p, _ in NEED])), min_size=1, max_size=4))
def test_a_resumed_step_sends_every_file_exactly_once_from_a_rank_that_holds_it(haves):
    plan = resume_plan([{1: _offer(NEED, have)} for have in haves])
    if set().union(*haves) == {p for p, _ in NEED}:
        sent = [(r, p) for r, paths in enumerate(plan.sends[1]) for p in paths]
        assert sorted(p for _, p in sent) == sorted(p for p, _ in NEED)
        assert all(p in haves[r] for r, p in sent)
    else:
        assert 1 not in plan.sends and 1 in plan.left
