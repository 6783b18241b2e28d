"""Restore after node loss from peer copies: real gloo processes on 127.0.0.1, node-local directories,
one node's directory deleted; with and without a remote tier (moto S3 on 127.0.0.1); a damaged peer
copy; a peer SIGKILLed mid-copy. Workers are in tests/_peer.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from s3_server import s3_bucket, s3_endpoint  # noqa: F401 - fixtures

import _peer
from _dist import DIED, run_ranks
from checkpointing.format import naming
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog
from checkpointing.tier.tierfile import read_tier_id

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tier(base: Path, node: int) -> str:
    tier = read_tier_id(LocalStorage(base / f"node{node}", create=False))
    assert tier
    return tier


def _restored_line(lines: list[str]) -> str:
    return next(line for line in lines if "restored step" in line)


@pytest.mark.parametrize("world,per_node", [(2, 1), (4, 2)])
def test_a_lost_node_restores_bit_exactly_from_its_peer_without_a_remote_tier(tmp_path, world, per_node):
    run_ranks(_peer.save_steps, world, str(tmp_path), per_node, [1, 2], tmp=tmp_path)
    nodes = world // per_node
    lost = nodes - 1
    old = _tier(tmp_path, lost)
    shutil.rmtree(tmp_path / f"node{lost}")  # the machine is gone; a fresh one takes its ranks
    out = run_ranks(_peer.restore_after_loss, world, str(tmp_path), per_node, 2, None, 3, tmp=tmp_path)
    for rank, r in enumerate(out):
        line = _restored_line(r["lines"])
        if rank // per_node == lost:
            assert "from the peer copy" in line and f"peers/{old}" in line, line
            assert f"MB from {tmp_path}/node{lost} " not in line
            if rank % per_node == 0:  # the node's leader fetched it back, saying from where
                assert any("fetched back step 2" in m and "peer rank 0 (host 127.0.0.1" in m for m in r["lines"]), r["lines"]
        else:
            assert "peer copy" not in line, line  # the others read their own disks
        # every rank lists the step it restored (the replaced node: its fetched-back copy); the lost disk held the others' copies
        assert r["tiers"] == ({1: "local", 2: "local"} if rank // per_node != lost else {2: "local"}), (rank, r["tiers"])
    # keep_local=None: the old tier's steps stay restorable beside the new tier's (on its peer, and its fetched-back copy)
    new = _tier(tmp_path, lost)
    assert new != old
    assert sorted(p.name for p in (tmp_path / "node0" / "peers").iterdir()) == sorted([new, old])
    assert catalog.list_steps(LocalStorage(tmp_path / f"node{lost}" / "peers" / old, create=False)).committed == [2]
    # keep_local=2: the old tier's steps go once the new tier holds the two newest, everywhere
    run_ranks(_peer.save_steps, world, str(tmp_path), per_node, [4], None, 2, tmp=tmp_path)
    assert sorted(p.name for p in (tmp_path / "node0" / "peers").iterdir()) == [new]
    assert not (tmp_path / f"node{lost}" / "peers" / old).exists()


def test_with_a_remote_tier_the_peer_copy_is_preferred(tmp_path, s3_bucket):
    run_ranks(_peer.save_steps, 2, str(tmp_path), 1, [1, 2], s3_bucket, tmp=tmp_path)
    shutil.rmtree(tmp_path / "node1")
    out = run_ranks(_peer.restore_after_loss, 2, str(tmp_path), 1, 2, s3_bucket, tmp=tmp_path)
    line = _restored_line(out[1]["lines"])
    assert "from the peer copy" in line and "remote tier" not in line, line


def _rot_peer_copy(base: Path, step: int) -> None:
    """Node 1 is lost, and bit rot hit node 0's copy of its `step`."""
    old = _tier(base, 1)
    shutil.rmtree(base / "node1")
    replica = LocalStorage(base / "node0" / "peers" / old, create=False)
    pack = next(f.path for f in catalog.load_manifest(replica, step).files if f.tier == old and f.path.startswith(naming.step_dir(step)))
    path = Path(replica.root, pack)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_damaged_peer_copy_falls_back_to_the_remote_tier(tmp_path, s3_bucket):
    run_ranks(_peer.save_steps, 2, str(tmp_path), 1, [1, 2], s3_bucket, tmp=tmp_path)
    _rot_peer_copy(tmp_path, 2)
    out = run_ranks(_peer.restore_after_loss, 2, str(tmp_path), 1, 2, s3_bucket, tmp=tmp_path)
    lines = out[1]["lines"]
    assert any("could not fetch step 2" in m and "arrived damaged" in m for m in lines), lines
    line = _restored_line(lines)
    assert "from the remote tier" in line, line


def test_without_a_remote_tier_a_damaged_peer_copy_falls_back_to_the_older_step_a_peer_holds(tmp_path):
    run_ranks(_peer.save_steps, 2, str(tmp_path), 1, [1, 2, 3], tmp=tmp_path)
    _rot_peer_copy(tmp_path, 3)
    out = run_ranks(_peer.restore_after_loss, 2, str(tmp_path), 1, 2, tmp=tmp_path)
    lines = out[1]["lines"]
    assert any("could not fetch step 3" in m and "arrived damaged" in m for m in lines), lines
    assert any("fetched back step 2" in m for m in lines), lines
    assert "from the peer copy" in _restored_line(lines)
    assert out[1]["tiers"] == {2: "local"} and out[0]["tiers"] == {1: "local", 2: "local", 3: "local"}


def test_a_peer_killed_mid_copy_leaves_nothing_restore_trusts_and_an_older_step_is_restored(tmp_path):
    out = run_ranks(_peer.killed_mid_copy, 2, str(tmp_path), 1, 5.0, tmp=tmp_path, allow_died=True)
    assert out[1] == DIED
    survivor = out[0]
    assert survivor["trained"] and survivor["tiers"] == {1: "local", 2: "local"}, survivor  # its local commit stands
    error = survivor["error"]
    assert "peer copy of step 2 failed" in error and "peer rank 1 (host 127.0.0.1, port" in error, error
    # on the dead peer's disk: rank 0's step 1 copy committed, step 2 never (a directory without COMMIT)
    replica = LocalStorage(tmp_path / "node1" / "peers" / _tier(tmp_path, 0), create=False)
    assert catalog.list_steps(replica) == catalog.StepListing([1], [2])
    # node 0 is then lost: step 2 of its ranks was only on its disk, so step 2 is skipped and step 1 restored
    shutil.rmtree(tmp_path / "node0")
    out = run_ranks(_peer.restore_after_loss, 2, str(tmp_path), 1, 1, tmp=tmp_path)
    assert any("step 2 is committed on other nodes" in m and "rank 0" in m for m in out[0]["lines"]), out[0]["lines"]
    assert any("restores step 1, not 2" in m for m in out[1]["lines"]), out[1]["lines"]
    assert catalog.list_steps(replica) == catalog.StepListing([1], [])  # the half copy was tidied at start-up
