"""CheckpointManager(peer_copies=1) across real gloo processes on 127.0.0.1, with node-local directories:
committed replicas on the peer, tier states, incremental copies, retention and delete, a hung peer.
Workers are in tests/_peer.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import _peer
from _dist import run_ranks
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog
from checkpointing.tier.tierfile import read_tier_id
from checkpointing.tier.verify import verify_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tier(base: Path, node: int) -> str:
    tier = read_tier_id(LocalStorage(base / f"node{node}", create=False))
    assert tier
    return tier


def _replica(base: Path, node: int, host: int) -> LocalStorage:
    return LocalStorage(base / f"node{host}" / "peers" / _tier(base, node), create=False)


@pytest.mark.parametrize("world,per_node", [(2, 1), (4, 2)])
def test_saves_commit_replicas_on_the_peer_incrementally_and_retention_and_delete_cover_them(tmp_path, world, per_node):
    results = run_ranks(_peer.save_copy_retain_delete, world, str(tmp_path), per_node, tmp=tmp_path)
    nodes = world // per_node
    leaders = [n * per_node for n in range(nodes)]
    for r in results:  # every rank heard every node's outcome, the same
        assert r["sent1"] == results[0]["sent1"] and sorted(r["sent1"]) == leaders
        assert r["tiers2"] == {1: "local+peer", 2: "local+peer"}
        assert r["tiers3"] == {2: "local+peer", 3: "local+peer"}  # keep_local=2 retired step 1 here and on the peer
        assert r["tiers_deleted"] == {3: "local+peer"}
    for n in range(nodes):
        host = (n + 1) % nodes  # ring offset 1 in leader-rank order
        tier = _tier(tmp_path, n)
        replica = _replica(tmp_path, n, host)
        assert catalog.list_steps(replica).committed == [3] and verify_step(replica, 3).ok
        assert not (tmp_path / f"node{n}" / "peers" / tier).exists()  # no node holds its own copy
        source = LocalStorage(tmp_path / f"node{n}", create=False)
        for f in catalog.load_manifest(source, 3).files:
            if f.tier == tier:
                assert replica.get(f.path) == source.get(f.path)  # byte for byte
        leader = results[n * per_node]
        sent1, reused1, peers = leader["sent1"][n * per_node]
        assert tuple(peers) == (host * per_node,) and (sent1, reused1) == (sum(leader["files1"]), 0)
        # step 2 sends only the node's new pack(s); `w`, borrowed from step 1's pack, is held there already
        sent2, reused2, _ = leader["sent2"][n * per_node]
        new2, old2 = leader["files2"]
        assert (sent2, reused2) == (new2, old2) and old2 > 0 and sent2 < sent1 / 3
        assert leader["reused2"] >= _peer.N * 4  # the save itself borrowed `w`
    held = sorted(p.parent.parent.parent.name for p in tmp_path.glob("node*/peers/*/TIER"))
    assert held == [f"node{n}" for n in range(nodes)]  # one copy per node, where placement says


def test_the_job_store_does_not_grow_with_saves(tmp_path):
    counts = run_ranks(_peer.store_keys_over_saves, 2, str(tmp_path), 1, 8, tmp=tmp_path)[0]
    assert counts[3:] == [counts[3]] * 5, counts  # each save's keys (commit, peer copies) go once no rank needs them


def test_too_few_nodes_is_refused_on_every_rank(tmp_path):
    messages = run_ranks(_peer.too_few_nodes, 2, str(tmp_path), tmp=tmp_path)
    for m in messages:
        assert "peer_copies=1 needs at least 2 nodes" in m and "this job has 1" in m and "ranks [0, 1] share tier" in m


def test_peer_copies_off_leaves_no_trace(tmp_path):
    tiers = run_ranks(_peer.copies_off, 2, str(tmp_path), 1, tmp=tmp_path)
    assert tiers == [{1: "local"}, {1: "local"}]
    assert not list(tmp_path.glob("node*/peers"))


def test_a_hung_peer_times_out_naming_it_the_local_commit_stands_and_the_next_save_copies(tmp_path):
    out = run_ranks(_peer.hung_peer, 2, str(tmp_path), 1, 3.0, tmp=tmp_path)
    for r in out:
        assert "peer copy of step 1 failed" in r["first"], r["first"]
        assert "peer rank 1 (host 127.0.0.1, port" in r["first"] and "no progress for 3 s" in r["first"]
        assert "committed on the local tier" in r["first"]
    assert out[0]["tiers1"] == {1: "local"}  # node 0's copy on the hung peer never committed
    assert out[1]["tiers1"] == {1: "local+peer"}  # node 1's copy on node 0 did
    assert out[0]["tiers2"] == {1: "local", 2: "local+peer"} and out[1]["tiers2"] == {1: "local+peer", 2: "local+peer"}
    assert catalog.list_steps(_replica(tmp_path, 0, 1)).committed == [2]


def test_without_waiting_the_failed_copy_is_raised_by_the_save_that_waits_for_it(tmp_path):
    out = run_ranks(_peer.error_at_a_later_save, 2, str(tmp_path), 1, 3.0, tmp=tmp_path)
    for r in out:
        assert r["save3"].startswith("peer copy of step 1 failed") and "peer rank 1 (host 127.0.0.1" in r["save3"], r["save3"]
    assert out[0]["tiers"] == {1: "local", 2: "local+peer", 3: "local+peer"}
    assert out[1]["tiers"] == {1: "local+peer", 2: "local+peer", 3: "local+peer"}
