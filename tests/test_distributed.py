"""Multi-rank checkpoints with real processes on gloo (127.0.0.1): FSDP2 state, resharding,
per-rank state, failures, a killed rank, node-local tiers. Nothing is mocked."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import _dist
from _dist import run_ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same training run saved on 1, 2 and 4 ranks (FSDP2 + AdamW), with its unsharded reference."""
    tmp = tmp_path_factory.mktemp("saved")
    out = {}
    for n in (1, 2, 4):
        directory, ref = str(tmp / f"ck{n}"), str(tmp / f"ref{n}.pt")
        out[n] = (directory, ref, run_ranks(_dist.save_and_reference, n, directory, ref, tmp=tmp))
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp2_save_writes_each_shard_once(saved, n):
    directory, _, stats = saved[n]
    manifest = _manifest(directory, 3)
    assert manifest["world_size"] == n
    # every rank wrote only its own shards, and what several ranks hold (AdamW's step counts) once
    itemsize = {"float32": 4, "int64": 8}
    total = sum(math.prod(t["shape"]) * itemsize[t["dtype"]] for t in manifest["tensors"])
    written = sum(s["bytes_written"] for s in stats)
    assert written == total, (written, total)
    assert max(s["bytes_written"] for s in stats) < 0.8 * total
    # the loader position is per rank: one tree per rank; the model's tensors are sharded DTensors
    assert len(manifest["trees"]) == n
    emb = next(t for t in manifest["tensors"] if t["key"] == "model/emb.weight")
    assert len(emb["shards"]) == n and emb["shape"] == [37, 24]


@pytest.mark.parametrize("m", [1, 2, 4])
def test_restore_reshards_bit_exact(saved, m, tmp_path):
    """Saved on N ranks, restored on M (N, M in 1, 2, 4): model and AdamW state equal the reference."""
    dirs = [saved[n][0] for n in (1, 2, 4)]
    refs = [saved[n][1] for n in (1, 2, 4)]
    results = run_ranks(_dist.restore_matrix, m, dirs, refs, tmp=tmp_path)
    assert results == [[3, 3, 3]] * m


def test_restore_sharded_into_an_unsharded_model(saved, tmp_path):
    dirs = [saved[n][0] for n in (2, 4)]
    refs = [saved[n][1] for n in (2, 4)]
    assert run_ranks(_dist.restore_plain, 1, dirs, refs, tmp=tmp_path) == [[3, 3]]


def test_dcp_state_dict_helpers_round_trip(tmp_path):
    assert run_ranks(_dist.dcp_helpers_roundtrip, 2, str(tmp_path / "ck"), tmp=tmp_path) == [True, True]


def test_per_rank_values_restore_per_rank_and_refuse_other_world_sizes(tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(_dist.per_rank_state, 2, ck, "save", tmp=tmp_path)
    same = run_ranks(_dist.per_rank_state, 2, ck, "same", tmp=tmp_path)
    assert same == [(0, [0.0] * 3, [0, 1, 2, 3]), (10, [1.0] * 3, [0, 1, 2, 3])]
    # the replicated tensor is stored once; the per-rank one twice
    manifest = _manifest(ck, 1)
    assert sorted(t["key"] for t in manifest["tensors"]) == ["rng", "rng", "shared"]
    [other] = run_ranks(_dist.per_rank_state, 1, ck, "other", tmp=tmp_path)
    assert "loader/pos" in other and "rng" in other and "saved per rank" in other
    assert "1 rank(s) restore now" in other and "restore with 2 ranks" in other and "pipeline" not in other, other
    assert "shared" not in other.split("problem(s)")[1]


def test_write_failure_on_one_rank_commits_nothing_and_names_it(tmp_path):
    ck = str(tmp_path / "ck")
    messages = run_ranks(_dist.fail_on_one_rank, 2, ck, 1, tmp=tmp_path)
    for message in messages:
        assert "step 2 failed" in message and "rank 1" in message and "File too large" in message, message
        assert "rank 0:" not in message  # rank 0 only aborted: it is not named as a cause
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if (p / "COMMIT").exists()) == ["step-0000000001", "step-0000000003"]


def test_a_killed_rank_times_out_the_others_and_a_restart_restores(tmp_path):
    ck = str(tmp_path / "ck")
    results = run_ranks(_dist.killed_mid_save, 3, ck, 2, tmp=tmp_path, allow_died=True)
    assert results[2] == _dist.DIED
    for message in results[:2]:
        seconds = float(message.split("s ", 1)[0])
        assert seconds < 30, message
        assert "rank 2 did not answer" in message, message
    assert run_ranks(_dist.restore_latest, 3, ck, tmp=tmp_path) == [(1, 1.0), (1, 2.0), (1, 3.0)]


def test_node_local_tiers_hold_what_their_ranks_need(tmp_path, capsys):
    base = tmp_path / "nodes"
    (steps0, fetched0), (steps1, fetched1) = run_ranks(_dist.node_local_save, 2, str(base), tmp=tmp_path)
    assert steps0 == steps1 == [1]
    assert fetched0 == []  # rank 0 merged the manifest: it commits its own copy
    [(stored, size)] = fetched1  # rank 1 leads the other tier: it fetched it from rank 0's store, compressed
    commit = json.loads((base / "node1" / "step-0000000001" / "COMMIT").read_text())
    assert stored < size / 2 and size == (base / "node1" / commit["manifest"]).stat().st_size
    for node in ("node0", "node1"):  # each node-local tier has the manifest, the commit and the replicated table
        manifest = _manifest(str(base / node), 1)
        table = next(t for t in manifest["tensors"] if t["key"] == "table")
        files = {c[0] for shard in table["shards"] for copy in [shard["chunks"], *shard.get("replicas", [])] for c in copy}
        assert any((base / node / f).exists() for f in files), node
    assert run_ranks(_dist.node_local_restore, 2, str(base), tmp=tmp_path) == ["restored 1", "restored 1"]
    from checkpointing.cli.app import main as cli

    for node in ("node0", "node1"):  # verify checks this tier's copies; the other node's shards are not damage
        assert cli(["verify", str(base / node)]) == 0
        assert "live on other ranks' local tiers" in " ".join(capsys.readouterr().out.split())
    shutil.rmtree(base / "node1")  # node 1 is replaced; there is no remote tier
    results = run_ranks(_dist.node_local_restore, 2, str(base), tmp=tmp_path)
    for r in results:
        assert r.startswith("error: no step can be restored on every rank: step 1 is committed but rank 1 cannot read it"), r


def test_only_the_tier_leader_decodes_the_manifest_of_each_save(tmp_path):
    """Ranks that commit on no tier keep their account of the step from rank 0 (digest, their files), never the
    job's whole manifest: it would cost every rank O(all ranks' tensors) of CPU per save. Their
    incremental saves still build on what was committed."""
    saves = 4
    r0, r1 = run_ranks(_dist.manifest_decodes, 2, str(tmp_path / "ck"), saves, tmp=tmp_path)
    assert r1["decoded"] == 0, r1
    # rank 1's account of each step lists its own file only: the whole table to every rank is O(N^2) per save
    assert [a[:3] for a in r1["accounts"]] == [(step, 2, [1]) for step in range(1, saves + 1)], r1["accounts"]
    assert r0["accounts"] == []  # rank 0 leads the tier: it has the manifest
    assert r0["decoded"] >= saves, r0  # rank 0 checks each manifest it merged decodes (and the spy sees it)
    for r in (r0, r1):  # odd steps trained (every chunk new), even steps did not (nothing new but page padding)
        odd, even = r["bytes_written"][0::2], r["bytes_written"][1::2]
        assert min(odd) > 16 * max(even), r["bytes_written"]
    assert r0["restored"] == r1["restored"] == saves  # bit-exact (the worker compares)


def _manifest(directory: str, step: int) -> dict:
    from pathlib import Path

    commit = json.loads((Path(directory) / f"step-{step:010d}" / "COMMIT").read_text())
    return json.loads((Path(directory) / commit["manifest"]).read_text())


def test_torchrun_example_trains_resumes_and_reshards(tmp_path):
    """examples/train_fsdp.py as users launch it: torchrun, 2 ranks, then a resume on 1 rank."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "train_fsdp.py"
    ck = tmp_path / "ck"

    def torchrun(n: int, steps: int) -> str:
        proc = _dist.torchrun(n, str(script), "--dir", str(ck), "--steps", str(steps), "--every", "5")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    first = torchrun(2, 10)
    assert "resumed at 0, trained to 10" in first and "steps on disk [5, 10]" in first, first
    second = torchrun(1, 15)
    assert "resumed at 10, trained to 15" in second and "steps on disk [10, 15]" in second, second


def test_export_writes_full_tensors_of_a_sharded_step(saved, tmp_path):
    """`checkpointing export` on a 4-rank checkpoint: one file of unsharded tensors, loadable without pickle."""
    from checkpointing.cli.app import main as cli

    directory, ref_path, _ = saved[4]
    out = tmp_path / "full.pt"
    assert cli(["export", directory, "--out", str(out)]) == 0
    data = torch.load(out, weights_only=True)
    assert data["step"] == 3 and data["world_size"] == 4
    ref = torch.load(ref_path)
    model = {k: v for k, v in ref.items() if k.startswith("model/")}
    assert model and all(torch.equal(data["tensors"][k], v) for k, v in model.items())
