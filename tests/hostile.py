"""A corpus of hostile and damaged checkpoints (like safetensors' attacks/): each case turns a good
checkpoint directory into a bad one the way an attacker, a rotting disk or an unlucky user would.

Every case starts from `make_good(root)`: two committed steps of a small state. A case edits the
newest step (or the root) and, where an attacker could, re-seals the step's COMMIT so that the
manifest digest matches again: what remains is what our own checks must catch. `OUTSIDE` files
are planted beside the root: no command may touch them.

tests/test_hostile.py runs every CLI command and restore() against every case.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

from checkpointing import CheckpointManager
from checkpointing.format.manifest import canonical_json

STEP = 2  # the step every case damages (step 1 stays good)


def good_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "acc[": {"]": torch.arange(6, dtype=torch.int64)},  # a legitimate key with rich markup characters
        "blob": b"\x00\x01binary",
        "step": seed,
    }


def make_good(root: Path) -> None:
    with CheckpointManager(root, keep_local=None) as mgr:
        mgr.save(1, good_state(1)).wait()
        mgr.save(STEP, good_state(2)).wait()


def step_dir(root: Path, step: int = STEP) -> Path:
    return root / f"step-{step:010d}"


def manifest_path(root: Path, step: int = STEP) -> Path:
    return next(step_dir(root, step).glob("manifest.*.json"))


def pack_path(root: Path, step: int = STEP) -> Path:
    return next(step_dir(root, step).glob("r*.pack"))


def load_manifest(root: Path) -> dict:
    return json.loads(manifest_path(root).read_bytes())


def write_manifest(root: Path, doc: dict | bytes) -> None:
    """Replace the manifest and re-seal COMMIT with the new digest (what a tamperer can do)."""
    path = manifest_path(root)
    data = doc if isinstance(doc, bytes) else canonical_json(doc)
    path.chmod(0o644)
    path.write_bytes(data)
    commit = step_dir(root) / "COMMIT"
    marker = json.loads(commit.read_bytes())
    marker["manifest_digest"] = "sha256:" + hashlib.sha256(data).hexdigest()
    commit.chmod(0o644)
    commit.write_bytes(canonical_json(marker))


def _tensor(doc: dict, key: str) -> dict:
    return next(t for t in doc["tensors"] if t["key"] == key)


def huge_chunk_length(root: Path, outside: Path) -> None:
    doc = load_manifest(root)
    _tensor(doc, "model/w")["shards"][0]["chunks"][0][2] = 2**45
    write_manifest(root, doc)


def huge_shape(root: Path, outside: Path) -> None:
    doc = load_manifest(root)
    entry = _tensor(doc, "model/w")
    entry["shape"] = [2**40, 2**40]
    entry["shards"][0]["shape"] = [2**40, 2**40]
    write_manifest(root, doc)


def negative_offset(root: Path, outside: Path) -> None:
    doc = load_manifest(root)
    _tensor(doc, "model/w")["shards"][0]["chunks"][0][1] = -4096
    write_manifest(root, doc)


def chunk_past_end_of_file(root: Path, outside: Path) -> None:
    doc = load_manifest(root)
    chunk = _tensor(doc, "model/b")["shards"][0]["chunks"][0]
    chunk[1] = os.path.getsize(pack_path(root)) + 10 * 4096
    write_manifest(root, doc)


def path_traversal(root: Path, outside: Path) -> None:
    doc = load_manifest(root)
    for entry in doc["tensors"]:
        for shard in entry["shards"]:
            for chunk in shard["chunks"]:
                chunk[0] = "../" * 8 + str(outside / "secret.txt").lstrip("/")
    write_manifest(root, doc)


def bad_base64(root: Path, outside: Path) -> None:
    raw = manifest_path(root).read_bytes()
    good = json.dumps(__import__("base64").b64encode(b"\x00\x01binary").decode())
    assert good.encode() in raw
    write_manifest(root, raw.replace(good.encode(), b'"%%% not base64 %%%"'))


def deep_tree(root: Path, outside: Path) -> None:
    doc = load_manifest(root)
    depth = 100_000
    body = canonical_json(doc)
    deep = '{"list":[' * depth + '{"value":1}' + "]}" * depth  # built as text: json.dumps itself would recurse too deeply
    tree_key = "trees" if "trees" in doc else "tree"
    old = canonical_json({tree_key: doc[tree_key]})[1:-1]
    write_manifest(root, body.replace(old, f'"{tree_key}":{deep if tree_key == "tree" else "[" + deep + "]"}'.encode()))


def many_shards(root: Path, outside: Path) -> None:
    """20,000 one-element shards of one tensor (a 13 MB manifest made the old tiling check quadratic)."""
    doc = load_manifest(root)
    entry = _tensor(doc, "acc[/]")
    first = entry["shards"][0]["chunks"][0]
    n = 20_000
    entry["shape"] = [n]
    entry["shards"] = [{"offsets": [i], "shape": [1], "chunks": [[first[0], first[1], 8, first[3]]]} for i in range(n)]
    write_manifest(root, doc)


def commit_is_dev_zero(root: Path, outside: Path) -> None:
    commit = step_dir(root) / "COMMIT"
    commit.unlink()
    commit.symlink_to("/dev/zero")


def manifest_is_huge(root: Path, outside: Path) -> None:
    """A 4 GiB (sparse) manifest file: reading it whole would exhaust memory."""
    path = manifest_path(root)
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.truncate(4 << 30)


def pack_is_fifo(root: Path, outside: Path) -> None:
    pack = pack_path(root)
    pack.unlink()
    os.mkfifo(pack)


def pack_is_symlink_outside(root: Path, outside: Path) -> None:
    pack = pack_path(root)
    size = pack.stat().st_size
    pack.unlink()
    target = outside / "secret.pack"
    target.write_bytes(b"s" * size)
    pack.symlink_to(target)


def step_dir_symlink_outside(root: Path, outside: Path) -> None:
    """An uncommitted 'step' that is a symlink to a directory outside the root: never emptied."""
    victim = outside / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("keep me")
    (root / "step-0000000098").symlink_to(victim, target_is_directory=True)


def truncated_pack(root: Path, outside: Path) -> None:
    pack = pack_path(root)
    pack.chmod(0o644)
    with open(pack, "r+b") as f:
        f.truncate(100)


def flip_bits(path: Path, offset: int, mask: int = 0x10) -> None:
    """XOR the byte at `offset` of a real file with `mask` (what a rotting disk does to a chunk)."""
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def flipped_bit(root: Path, outside: Path) -> None:
    flip_bits(pack_path(root), 5)


def manifest_not_json(root: Path, outside: Path) -> None:
    write_manifest(root, b"\xff\xfe not json at all")


def metrics_symlink(root: Path, outside: Path) -> None:
    metrics = root / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    target = outside / "not-metrics.txt"
    target.write_text("root:x:0:0:root:/root:/bin/bash\n")
    metrics.symlink_to(target)


def tier_file_is_dev_zero(root: Path, outside: Path) -> None:
    tier = root / "TIER"
    if tier.exists():
        tier.unlink()
    tier.symlink_to("/dev/zero")


CASES: dict[str, Callable[[Path, Path], None]] = {
    f.__name__: f
    for f in (
        huge_chunk_length, huge_shape, negative_offset, chunk_past_end_of_file, path_traversal, bad_base64,
        deep_tree, many_shards, commit_is_dev_zero, manifest_is_huge, pack_is_fifo, pack_is_symlink_outside,
        step_dir_symlink_outside, truncated_pack, flipped_bit, manifest_not_json, metrics_symlink, tier_file_is_dev_zero,
    )
}

# Cases after which step STEP must not verify or restore (the others damage only what is around it).
DAMAGES_STEP = set(CASES) - {"step_dir_symlink_outside", "metrics_symlink", "tier_file_is_dev_zero"}
# Cases where a writer (CheckpointManager) may refuse to open the directory with a clear error instead
# (the tier's identity file is not a regular file: it is not replaced behind the user's back)
REFUSED_AT_OPEN = {"tier_file_is_dev_zero"}


def snapshot_outside(outside: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `outside` with its mode and bytes: no command may change any of it."""
    out = {}
    for path in sorted(outside.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(outside))] = (path.stat().st_mode, path.read_bytes())
    return out
