"""What `pip install` gets: the distribution's name and metadata, the typing marker, the version
flag, and local use without the s3 extra (a remote s3:// URL then names the extra to install)."""

from __future__ import annotations

import email
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(out)],
                   check=True, capture_output=True, timeout=300)
    [built] = out.glob("*.whl")
    return built


def test_the_wheel_is_tiered_checkpointing_and_s3_is_an_extra(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        [meta_name] = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_name))
    assert meta["Name"] == "tiered-checkpointing"
    assert "checkpointing/py.typed" in names and "checkpointing/__init__.py" in names
    requires = meta.get_all("Requires-Dist")
    base = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("torch") for r in base) and not any("s3fs" in r or "boto" in r for r in base)
    assert any(r.startswith("s3fs") and 'extra == "s3"' in r for r in requires)


def test_version_flag(run_cli):
    with pytest.raises(SystemExit) as info:
        run_cli("--version")
    assert info.value.code == 0


def test_version_flag_prints_the_distribution(tmp_path):
    out = subprocess.run([sys.executable, "-m", "checkpointing", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "tiered-checkpointing" in out.stdout


BLOCK_S3 = textwrap.dedent(
    """
    import sys
    class NoS3:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("s3fs", "aiobotocore", "botocore", "boto3"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, NoS3())
    """
)


def test_local_use_works_without_s3fs_and_a_remote_url_names_the_extra(tmp_path):
    script = BLOCK_S3 + textwrap.dedent(
        f"""
        import torch
        from checkpointing import CheckpointManager, CheckpointConfigError
        model = torch.nn.Linear(4, 2)
        with CheckpointManager({str(tmp_path / "ck")!r}) as mgr:
            mgr.save(1, {{"model": model}}).wait()
            fresh = torch.nn.Linear(4, 2)
            assert mgr.restore({{"model": fresh}}) == 1 and torch.equal(fresh.weight, model.weight)
        assert "s3fs" not in sys.modules and "botocore" not in sys.modules
        try:
            CheckpointManager({str(tmp_path / "ck2")!r}, remote="s3://bucket/run")
        except CheckpointConfigError as exc:
            print("REFUSED:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED:" in out.stdout and "pip install 'tiered-checkpointing[s3]'" in out.stdout
