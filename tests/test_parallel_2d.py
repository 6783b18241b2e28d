"""2-D parallel state (FSDP2 over tensor parallel) saved on a (dp=2, tp=2) mesh and resharded (issue 16).

Real gloo processes on 127.0.0.1, nothing mocked. One 4-rank run (the module fixture) trains a
small llama-shaped model laid out with Colwise/Rowwise/SequenceParallel and fully_shard, gathers
every parameter and AdamW state to full tensors, saves, refuses Partial and non-box shards, does
DCP's own round trip, and restores on the same mesh and as pure FSDP on 4 ranks; one 2-rank run
restores as TP-only and as 1-D FSDP; the test process restores into a plain model. Every restore
goes into a fresh model and a fresh AdamW (no state: the planner creates it sharded like its
parameter) and must equal the gathered full tensors bit for bit, then train one more step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import _dist2d
from _dist import run_ranks

STEP = _dist2d.STEPS


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("parallel2d")
    ranks = run_ranks(_dist2d.four_ranks, 4, str(tmp), tmp=tmp)
    return {"dir": str(tmp / "ckpt"), "ranks": ranks, "ref": ranks[0]["ref"], "next": ranks[0]["next"]}


@pytest.fixture(scope="module")
def restored(saved, tmp_path_factory) -> dict[str, list[tuple[str, Any]]]:
    """Per target layout, every rank's ("ok", result) or ("error", traceback); rank 0's result holds the full tensors."""
    out = {name: [r[name] for r in saved["ranks"]] for name in ("same_mesh", "fsdp4")}
    two = run_ranks(_dist2d.two_ranks, 2, saved["dir"], tmp=tmp_path_factory.mktemp("two"))
    out.update({name: [r[name] for r in two] for name in ("tp", "fsdp2")})
    with torch.random.fork_rng():  # the plain model is built (seeded) in this process
        out["plain"] = [_dist2d.attempt(lambda: _dist2d.restore_into(saved["dir"], "plain"))]
    return out


def _ok(results: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    errors = [f"rank {r}: {v}" for r, (status, v) in enumerate(results) if status != "ok"]
    assert not errors, "\n".join(errors)
    return [v for _, v in results]


def _manifest(directory: str, step: int) -> tuple[dict, Path]:
    commit = json.loads((Path(directory) / f"step-{step:010d}" / "COMMIT").read_text())
    return json.loads((Path(directory) / commit["manifest"]).read_text()), Path(directory) / commit["manifest"]


def _assert_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(got), sorted(set(expected) ^ set(got))
    differ = [k for k, v in expected.items() if v.dtype != got[k].dtype or v.shape != got[k].shape or not torch.equal(v, got[k])]
    assert not differ, f"not bit-exact: {differ}"


def test_save_covers_strided_uneven_and_replicated_placements(saved):
    assert [r["save"][0] for r in saved["ranks"]] == ["ok"] * 4, [r["save"] for r in saved["ranks"]]
    seen = set(saved["ranks"][0]["placements"].values())
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in seen  # Colwise/Rowwise-embedding rows under FSDP2
    assert "(Shard(dim=0), Shard(dim=1))" in seen  # Rowwise weight under FSDP2
    assert "(Shard(dim=0), Replicate())" in seen  # SequenceParallel norm, Rowwise bias
    manifest, _ = _manifest(saved["dir"], STEP)
    tensors = {t["key"]: t for t in manifest["tensors"]}
    # every model tensor is tiled by its saved shards, uneven ones included (vocab 1001 -> 251/250 rows)
    for key, t in tensors.items():
        if key.startswith("model/"):
            assert sum(math.prod(s["shape"]) for s in t["shards"]) == math.prod(t["shape"]), key
    assert sorted(s["shape"][0] for s in tensors["model/emb.weight"]["shards"]) == [250, 250, 250, 251]
    assert sorted(tuple(s["offsets"]) for s in tensors["model/blocks.0.down.weight"]["shards"]) == [(0, 0), (0, 27), (20, 0), (20, 27)]


def test_same_mesh_restore_is_bit_exact_and_trains_on_identically(saved, restored):
    results = _ok(restored["same_mesh"])
    assert [r["step"] for r in results] == [STEP] * 4
    _assert_equal(saved["ref"], results[0]["full"])
    _assert_equal(saved["next"], results[0]["next"])  # the original job's next step, bit for bit


def test_restore_matches_dcp_round_trip_on_the_same_mesh(saved, restored):
    status, dcp_full = saved["ranks"][0]["dcp"]
    assert status == "ok", dcp_full
    assert all(r["dcp"][0] == "ok" for r in saved["ranks"]), [r["dcp"] for r in saved["ranks"]]
    _assert_equal(dcp_full, _ok(restored["same_mesh"])[0]["full"])
    _assert_equal(saved["ref"], dcp_full)


@pytest.mark.parametrize("target", ["fsdp4", "tp", "fsdp2", "plain"])
def test_restore_on_another_mesh_is_bit_exact_and_trains_on(saved, restored, target):
    """Pure FSDP on 4 ranks, TP-only on 2, 1-D FSDP on 2, one plain process: model and AdamW state equal
    the full tensors gathered before the save; one more step matches the original job's next step
    (the same global batch, split another way: equal up to float rounding)."""
    results = _ok(restored[target])
    assert [r["step"] for r in results] == [STEP] * len(results)
    _assert_equal(saved["ref"], results[0]["full"])
    nxt = results[0]["next"]
    assert sorted(nxt) == sorted(saved["next"])
    for k, v in saved["next"].items():
        assert torch.isfinite(nxt[k]).all() and not torch.equal(nxt[k], saved["ref"][k]), k
        torch.testing.assert_close(nxt[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


def _needed_bytes(manifest: dict, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """Bytes of the saved chunks holding the rows of every saved shard that overlaps a box this rank restores."""
    total = 0
    for t in manifest["tensors"]:
        offsets, shape = boxes[t["key"]]
        for s in t["shards"]:
            lo = [max(a, b) for a, b in zip(offsets, s["offsets"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, s["offsets"], s["shape"])]
            if any(h <= l for l, h in zip(lo, hi)) or 0 in shape or 0 in s["shape"]:
                continue
            row = math.prod(s["shape"][1:]) * (sum(c[2] for c in s["chunks"]) // max(1, math.prod(s["shape"])))
            first, last = ((lo[0] - s["offsets"][0]) * row, (hi[0] - s["offsets"][0]) * row) if s["shape"] else (0, 1)
            at = 0
            for _, _, length, _ in s["chunks"]:
                if at < last and at + length > first:
                    total += length
                at += length
    return total


@pytest.mark.parametrize("target", ["same_mesh", "fsdp4", "tp", "fsdp2", "plain"])
def test_each_rank_reads_only_the_chunks_it_needs(saved, restored, target):
    """The kernel's count of bytes each restoring process read (/proc/self/io rchar, around restore())
    is the chunks its boxes overlap plus the small files (manifest, COMMIT): never the other ranks' data."""
    manifest, path = _manifest(saved["dir"], STEP)
    data = sum(c[2] for t in manifest["tensors"] for s in t["shards"] for c in s["chunks"])
    small = 4 * path.stat().st_size + (16 << 10)
    for rank, r in enumerate(_ok(restored[target])):
        needed = _needed_bytes(manifest, r["boxes"])
        assert needed <= r["rchar"] <= needed + small, (rank, needed, r["rchar"], small)
        if target == "plain":
            assert needed == data
        else:
            assert needed < 0.6 * data, (rank, needed, data)  # about 1/world of it; a box across two saved shards reads both


def test_partial_placement_is_refused_on_every_rank_naming_the_key(saved):
    for rank, r in enumerate(saved["ranks"]):
        refused = r["partial"]
        assert refused["raised_in"] == "save", (rank, refused)
        assert refused["error"].startswith("checkpointing.errors.StateError: "), (rank, refused)
        assert "state['grad_sum']" in refused["error"] and "partial" in refused["error"], (rank, refused)
        assert refused["steps"] == [STEP], (rank, refused)  # nothing committed: step 2 is still the latest


def test_local_shard_that_is_not_one_box_is_refused(saved):
    for rank, r in enumerate(saved["ranks"]):
        refused = r["strided"]
        assert refused["raised_in"] == "save", (rank, refused)
        assert refused["error"].startswith("checkpointing.errors.StateError: "), (rank, refused)
        assert "state['odd']" in refused["error"] and "not one contiguous block" in refused["error"], (rank, refused)
        assert refused["steps"] == [STEP], (rank, refused)
