"""Peer placement and the restore's fetch plan (checkpointing/plan/peers.py): pure functions, hypothesis-tested."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointing.errors import CheckpointConfigError
from checkpointing.plan.peers import Fetch, Hosted, check_nodes, fetch_plan, hosted_by, place


@st.composite
def layouts(draw):
    copies = draw(st.integers(1, 4))
    nodes = draw(st.lists(st.integers(0, 500), min_size=copies + 1, max_size=24, unique=True))
    return draw(st.permutations(nodes)), copies


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_each_node_has_k_distinct_peers_never_itself_and_the_load_is_even(layout):
    nodes, k = layout
    placement = place(nodes, k)
    assert set(placement) == set(nodes)
    for node, peers in placement.items():
        assert len(peers) == k == len(set(peers))
        assert node not in peers and set(peers) <= set(nodes)
    hosts = hosted_by(placement)
    assert all(len(sources) == k for sources in hosts.values())  # every node holds exactly k others' copies


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_losing_any_k_nodes_leaves_a_copy_of_every_nodes_data(layout, data):
    nodes, k = layout
    placement = place(nodes, k)
    lost = set(data.draw(st.lists(st.sampled_from(sorted(nodes)), max_size=k, unique=True)))
    for node, peers in placement.items():
        assert {node, *peers} - lost, f"node {node}'s data lost with {lost}"


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_placement_depends_on_the_set_of_nodes_only(layout):
    nodes, k = layout
    assert place(nodes, k) == place(sorted(nodes), k) == place(list(reversed(nodes)), k)


def test_ring_offsets_by_leader_rank():
    assert place([0, 2, 4, 6], 1) == {0: (2,), 2: (4,), 4: (6,), 6: (0,)}
    assert place([0, 1, 2], 2) == {0: (1, 2), 1: (2, 0), 2: (0, 1)}
    assert hosted_by(place([0, 2], 1)) == {0: (2,), 2: (0,)}


@pytest.mark.parametrize("nodes,k", [([0], 1), ([0, 1], 2), ([3, 5, 7], 3)])
def test_too_few_nodes_is_a_clear_error(nodes, k):
    with pytest.raises(CheckpointConfigError) as err:
        place(nodes, k)
    message = str(err.value)
    assert f"peer_copies={k} needs at least {k + 1} nodes" in message and f"this job has {len(nodes)}" in message
    assert "Lower peer_copies" in message


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1"])
def test_bad_copy_counts_are_refused(bad):
    with pytest.raises(CheckpointConfigError, match="peer_copies"):
        check_nodes([0, 1, 2], bad)


def test_zero_copies_places_nothing():
    assert place([0], 0) == {0: ()}


# ----------------------------------------------------------------------------- the fetch plan

NODES = {0: (0, 1), 2: (2, 3), 4: (4, 5)}


def test_a_replaced_node_fetches_the_newest_step_every_node_can_read():
    hosted = [Hosted(2, "old0", (0, 1), 6, (10, 20)), Hosted(4, "old0", (0, 1), 6, (20,)), Hosted(0, "t2", (2, 3), 6, (10, 20))]
    local = {0: set(), 2: {10, 20}, 4: {10, 20}}
    # step 20 first; should its copies arrive damaged, step 10 (node 2 alone holds it)
    assert fetch_plan(0, NODES, 6, local=local, hosted=hosted) == [Fetch("old0", 20, (2, 4)), Fetch("old0", 10, (2,))]
    assert fetch_plan(0, NODES, 6, local=local, hosted=hosted, requested=10) == [Fetch("old0", 10, (2,))]
    assert fetch_plan(0, NODES, 6, local=local, hosted=hosted, requested=20) == [Fetch("old0", 20, (2, 4))]
    for other in (2, 4):  # they hold it on their own disks
        assert fetch_plan(other, NODES, 6, local=local, hosted=hosted) == []


def test_a_step_whose_copy_never_committed_is_not_the_target_an_older_one_is():
    # node 0 lost; its copy of step 30 never committed on node 2 (the peer died mid-copy)
    hosted = [Hosted(2, "old0", (0, 1), 6, (10, 20))]
    local = {0: set(), 2: {10, 20, 30}, 4: {10, 20, 30}}
    assert fetch_plan(0, NODES, 6, local=local, hosted=hosted) == [Fetch("old0", 20, (2,)), Fetch("old0", 10, (2,))]
    # the remote tier holds step 20: should its copy arrive damaged, restore reads it from there (no older step)
    assert fetch_plan(0, NODES, 6, local=local, hosted=hosted, remote={20}) == [Fetch("old0", 20, (2,))]
    # the remote tier holds step 30: it is the target, and no peer has it, so nothing is fetched (read remotely)
    assert fetch_plan(0, NODES, 6, local=local, hosted=hosted, remote={30}) == []


def test_nothing_is_fetched_that_the_node_holds_or_other_ranks_or_world_sizes_wrote():
    local = {0: {10}, 2: {10}, 4: {10}}
    assert fetch_plan(0, NODES, 6, local=local, hosted=[Hosted(2, "t0", (0, 1), 6, (10,))]) == []  # on its disk
    fresh = {0: set(), 2: {10}, 4: {10}}
    assert fetch_plan(0, NODES, 6, local=fresh, hosted=[Hosted(2, "t0", (0, 1), 4, (10,))]) == []  # another world size
    assert fetch_plan(0, NODES, 6, local=fresh, hosted=[Hosted(2, "t0", (0,), 6, (10,))]) == []  # other ranks
    assert fetch_plan(0, NODES, 6, local=fresh, hosted=[Hosted(0, "t0", (0, 1), 6, (10,))]) == []  # its own fetched copy


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 2, 4]), st.sampled_from(["a", "b"]), st.sampled_from([(0, 1), (2, 3), (4, 5), (0,)]),
                          st.sets(st.integers(0, 20), max_size=5)), max_size=8),
       st.dictionaries(st.sampled_from([0, 2, 4]), st.sets(st.integers(0, 20), max_size=5)),
       st.sets(st.integers(0, 20), max_size=3), st.sampled_from([0, 2, 4]))
def test_fetch_plan_properties(entries, local, remote, me):
    hosted = [Hosted(h, t, r, 6, tuple(sorted(s))) for h, t, r, s in entries]
    plan = fetch_plan(me, NODES, 6, local=local, hosted=hosted, remote=remote)
    assert [f.step for f in plan] == sorted({f.step for f in plan}, reverse=True)  # newest first, each step once
    assert all(f.step not in remote for f in plan[:-1])  # nothing older than a step the remote tier holds
    reach = {n: set(local.get(n, ())) | remote | {s for h in hosted if h.ranks == NODES[n] for s in h.steps} for n in NODES}
    common = set.intersection(*reach.values())
    if not plan:
        target = max(common, default=None)
        assert target is None or target in local.get(me, ()) or not any(
            h.host != me and h.ranks == NODES[me] and target in h.steps for h in hosted) or any(
            h.host == me and h.ranks == NODES[me] and target in h.steps for h in hosted)
        return
    assert plan[0].step <= max(common)  # the step the ranks will restore, else (its copy held nowhere) older ones
    for f in plan:
        assert f.step in common and f.step not in local.get(me, ())  # steps every node reads, lacking here
        assert me not in f.hosts and f.hosts == tuple(sorted(f.hosts))
        assert all(any(h.host == host and h.tier == f.tier and f.step in h.steps and h.ranks == NODES[me] for h in hosted) for host in f.hosts)
