"""Where checkpoints live: a home-relative path, an empty path, a remote tier that is a file, a directory that
cannot be written, a full disk (RLIMIT_FSIZE in a child process: writes fail with EFBIG, as they would with ENOSPC).
Each gives a clear error naming the place, or works as the user meant; a failed write leaves no temporary."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import torch

import checkpointing
from _models import child_env
from checkpointing import CheckpointConfigError, CheckpointManager
from checkpointing.storage.retry import translate

_FULL_DISK = r"""
import json, os, resource, sys
from checkpointing import CheckpointManager
from checkpointing.storage import LocalStorage
root, what = sys.argv[1], sys.argv[2]
storage = LocalStorage(root) if what == "put" else None
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (0 if what == "open" else 4096, hard))
try:
    if what == "open":
        CheckpointManager(root)
    else:
        storage.put("step-0000000001/manifest.abc.json", b"x" * 100_000)
    out = {"error": None}
except Exception as exc:
    out = {"error": type(exc).__name__, "message": str(exc), "filename": getattr(exc, "filename", None)}
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print(json.dumps(out))
"""


def _full_disk(root, what: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(root), what], env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _temporaries(root) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if ".tmp-" in n]


def test_a_manager_that_cannot_write_its_directory_says_which_and_how_to_fix(tmp_path):
    root = tmp_path / "full"
    root.mkdir()
    out = _full_disk(root, "open")
    assert out["error"] == "CheckpointConfigError", out
    assert f"cannot use {root} as the checkpoint directory" in out["message"] and "TIER" in out["message"], out
    assert "read_only=True" in out["message"], out
    assert _temporaries(root) == []


def test_a_write_that_fails_names_the_file_and_leaves_no_temporary(tmp_path):
    out = _full_disk(tmp_path, "put")
    assert out["error"] == "OSError" and "File too large" in out["message"], out
    assert out["filename"] == str(tmp_path / "step-0000000001" / "manifest.abc.json"), out
    assert _temporaries(tmp_path) == []


def test_a_home_relative_directory_is_the_home_directorys(tmp_path, monkeypatch):
    home, elsewhere = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    with CheckpointManager("~/ckpt") as mgr:
        mgr.save(1, {"w": torch.arange(4.0)}).wait()
        assert mgr.directory == home / "ckpt"
    assert torch.equal(checkpointing.load("~/ckpt")["w"], torch.arange(4.0))
    assert os.listdir(elsewhere) == []  # nothing under a directory literally named "~"


def test_an_empty_path_is_refused_not_read_as_the_current_directory(tmp_path, monkeypatch):
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.zeros(2)}).wait()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointConfigError, match="is empty"):
        checkpointing.load("")


def test_a_file_remote_tier_that_is_a_file_is_refused_at_start(tmp_path):
    (tmp_path / "remote.bin").write_bytes(b"not a directory")
    with pytest.raises(CheckpointConfigError, match="is a file, not a directory"):
        CheckpointManager(tmp_path / "local", remote=(tmp_path / "remote.bin").as_uri())


@pytest.mark.parametrize("exc, where, hint", [
    (PermissionError(errno.EACCES, "Permission denied", "/r/step-1"), "file:///r/step-1/PIN.json", "may write and read there"),
    (OSError(errno.ENOSPC, "No space left on device"), "file:///r/step-1/x.pack", "free space on that filesystem"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "/r/step-1/x.pack", "free space on that filesystem"),
    (PermissionError(errno.EACCES, "Permission denied"), "s3://bucket/run/step-1/x.pack", "credentials"),
])
def test_a_filesystem_remote_tiers_errors_advise_on_the_filesystem_not_on_credentials(exc, where, hint):
    said = str(translate(exc, what="write", where=where))
    assert hint in said, said
    assert ("credentials" in said) == where.startswith("s3://"), said


def test_home_relative_paths_in_the_lightning_plugin_and_the_cli(tmp_path, monkeypatch, run_cli):
    pytest.importorskip("lightning.pytorch")
    from checkpointing.integrations.lightning import LightningCheckpointIO

    home, elsewhere = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    assert LightningCheckpointIO("~/store").directory == str(home / "store")
    with CheckpointManager("~/ckpt") as mgr:
        mgr.save(1, {"w": torch.arange(4.0)}).wait()
    code, out = run_cli("ls", "~/ckpt")  # a quoted "~" (a script's, a config's) reaches the CLI as it is
    assert code == 0 and f"checkpoints in {home / 'ckpt'}" in out, out
    code, out = run_cli("export", "~/ckpt", "--out", "~/w.pt")
    assert code == 0 and (home / "w.pt").is_file(), out
    assert os.listdir(elsewhere) == []


def test_the_cli_refuses_an_empty_target_rather_than_work_on_the_current_directory(tmp_path, monkeypatch, run_cli):
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.zeros(2)}).wait()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_cli("rm", "", "--step", "1")  # rm "$CKPT" with CKPT unset
    assert exit_.value.code == 2
    with CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.steps() == [1, 2]


def test_a_file_remote_tier_below_a_file_is_refused_at_start(tmp_path):
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(CheckpointConfigError, match="lies below the file"):
        CheckpointManager(tmp_path / "local", remote=(tmp_path / "afile" / "run").as_uri())
