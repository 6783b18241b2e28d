"""Every CLI command and restore() against every hostile checkpoint of tests/hostile.py.

What must hold, whatever the directory holds: a clear message and an exit code (never a traceback,
an exception out of the CLI, a hang, or a huge allocation); nothing outside the root is read into
a tensor, changed or deleted; a damaged step never restores wrong tensors.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hostile
import checkpointing
from checkpointing import CheckpointError, CheckpointManager
from checkpointing.cli.app import main

COMMANDS = {
    "ls": ["ls", "{root}"],
    "ls-json": ["ls", "{root}", "--json"],
    "inspect": ["inspect", "{root}"],
    "inspect-step": ["inspect", "{root}", "--step", str(hostile.STEP)],
    "verify": ["verify", "{root}"],
    "gc-dry-run": ["gc", "{root}", "--dry-run", "--min-age-s", "0"],
    "report": ["report", "{root}"],
    "export": ["export", "{root}", "--step", str(hostile.STEP), "--out", "{out}"],
}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good") / "ckpt"
    hostile.make_good(root)
    return root


@pytest.fixture
def case_dirs(good, tmp_path):
    def build(case: str) -> tuple[Path, Path, dict]:
        root, outside = tmp_path / case / "ckpt", tmp_path / case / "outside"
        shutil.copytree(good, root, symlinks=True)
        outside.mkdir()
        (outside / "secret.txt").write_text("not a checkpoint")
        hostile.CASES[case](root, outside)
        return root, outside, hostile.snapshot_outside(outside)

    return build


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(hostile.CASES))
def test_every_command_gives_a_clear_answer(case, case_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    root, outside, before = case_dirs(case)
    for name, template in COMMANDS.items():
        argv = [a.format(root=root, out=tmp_path / f"export-{name}.pt") for a in template]
        code, text = _run(capsys, argv)
        assert "Traceback" not in text, f"{name}: {text[-3000:]}"
        assert code in (0, 1, 2), f"{name} exited {code}: {text[-2000:]}"
        if name == "verify" and case in hostile.DAMAGES_STEP:
            assert code != 0, f"verify found nothing wrong in {case}: {text[-2000:]}"
        if name == "export" and case in hostile.DAMAGES_STEP:
            assert code != 0, f"export of a damaged step succeeded ({case}): {text[-2000:]}"
        if code != 0:
            assert text.strip(), f"{name} failed without a message"
    assert hostile.snapshot_outside(outside) == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(hostile.CASES))
def test_restore_raises_a_checkpoint_error_or_restores_good_values(case, case_dirs):
    root, outside, before = case_dirs(case)
    for step in (hostile.STEP, None):
        target = hostile.good_state(0)
        try:
            with CheckpointManager(root, keep_local=None) as mgr:
                got = mgr.restore(target, step=step)
        except CheckpointError as exc:
            assert str(exc), case
            if case not in hostile.DAMAGES_STEP | hostile.REFUSED_AT_OPEN:
                raise
            continue
        assert got in (1, hostile.STEP)
        if step == hostile.STEP:
            assert case not in hostile.DAMAGES_STEP, f"restored step {got} from a damaged checkpoint ({case})"
        expected = hostile.good_state(got)
        assert torch.equal(target["model"]["w"], expected["model"]["w"])
        assert torch.equal(target["acc["]["]"], expected["acc["]["]"])
        assert target["blob"] == expected["blob"] and target["step"] == expected["step"]
    assert hostile.snapshot_outside(outside) == before
    if case == "step_dir_symlink_outside":
        assert (outside / "victim" / "important.txt").read_text() == "keep me"


@pytest.mark.timeout(180)
def test_the_console_script_prints_no_traceback(case_dirs, tmp_path):
    """The real `python -m checkpointing` process on a few cases (stderr and exit code as a user sees them)."""
    for case in ("huge_chunk_length", "bad_base64", "commit_is_dev_zero", "pack_is_fifo"):
        root, _, _ = case_dirs(case)
        for argv in (["verify", str(root)], ["inspect", str(root), "--step", str(hostile.STEP)]):
            done = subprocess.run([sys.executable, "-m", "checkpointing", *argv], capture_output=True, text=True, timeout=120,
                                  env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
            assert "Traceback" not in done.stderr + done.stdout, f"{case} {argv[0]}: {done.stderr[-3000:]}"
            assert done.returncode in (1, 2), f"{case} {argv[0]} exited {done.returncode}"
            assert done.stderr.strip() or done.stdout.strip()


@pytest.mark.parametrize("shape,boxes,overlap", [
    ((20_000,), [((i,), (1,)) for i in range(20_000)], False),
    ((4, 20_000), [((0, i), (4, 1)) for i in range(20_000)], False),  # one first offset for all: the old check was quadratic
    ((200, 100), [((i, j), (1, 1)) for i in range(200) for j in range(100)], False),
    ((20_000, 20_000), [((i, 0), (1, 20_000 - i)) for i in range(20_000)], False),  # not a grid: the sweep decides
    ((4, 40), [((0, 2 * i), (4, 2)) for i in range(20)] + [((0, 5), (4, 1))], True),
    ((4, 4), [((0, 0), (2, 4)), ((1, 0), (2, 4))], True),
])
def test_tiling_check_is_fast_and_exact(shape, boxes, overlap):
    from checkpointing.errors import ManifestError
    from checkpointing.format.decode import check_tiling

    if overlap:
        with pytest.raises(ManifestError, match="overlap"):
            check_tiling(shape, boxes, "t")
    else:
        check_tiling(shape, boxes, "t")


def test_verify_reads_a_chunk_in_bounded_pieces(tmp_path, monkeypatch):
    """A chunk larger than verify's piece size is hashed piece by piece, and a flipped bit is still found."""
    from checkpointing.storage import LocalStorage
    from checkpointing.tier import verify

    root = tmp_path / "ckpt"
    with CheckpointManager(root, keep_local=None) as mgr:
        mgr.save(1, {"w": torch.arange(100_000, dtype=torch.float32)}).wait()
    monkeypatch.setattr(verify, "PIECE_BYTES", 4096)
    storage = LocalStorage(root, direct=False, create=False)
    assert verify.verify_step(storage, 1).ok
    hostile.flip_bits(hostile.pack_path(root, 1), 300_000, 1)
    report = verify.verify_step(storage, 1)
    assert not report.ok and "digest mismatch" in report.problems[0]


def test_verify_checks_the_file_table_sizes_as_inspect_does(tmp_path, capsys):
    """A sealed manifest whose file table gives a data file another size than it has: every chunk
    still reads clean, but the step does not match its own manifest, and verify says so."""
    root = tmp_path / "ckpt"
    hostile.make_good(root)
    doc = hostile.load_manifest(root)
    doc["files"][0][3] = 2**63  # [path, rank, tier, nbytes, primary_bytes]
    hostile.write_manifest(root, doc)
    assert main(["verify", str(root)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "9223372036854775808" in out and "bytes, expected" in out
    assert main(["inspect", str(root), "--step", str(hostile.STEP)]) == 1


def test_load_of_a_whole_tensor_declared_larger_than_memory_is_a_clear_error(good, tmp_path):
    """Consistent on its face (the chunks tile the shape, the file table agrees): load() allocates
    fresh tensors, and 4 TiB is refused as a problem naming the key, not a raw allocator error."""
    root = tmp_path / "ckpt"
    shutil.copytree(good, root, symlinks=True)
    doc = hostile.load_manifest(root)
    entry = next(t for t in doc["tensors"] if t["key"] == "model/w")
    n = 1 << 40  # float32 elements: 4 TiB
    pack = entry["shards"][0]["chunks"][0][0]
    entry["shape"] = entry["shards"][0]["shape"] = [n]
    entry["shards"][0]["offsets"] = [0]
    entry["shards"][0]["chunks"] = [[pack, i * n, n, "xxh3-128:" + "0" * 32] for i in range(4)]
    for f in doc["files"]:
        if f[0] == pack:
            f[3] = f[4] = 4 * n
    hostile.write_manifest(root, doc)
    with pytest.raises(CheckpointError, match="model/w: saved as float32.*cannot be allocated here"):
        checkpointing.load(root, step=hostile.STEP)

