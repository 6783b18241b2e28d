"""The CLI on every tier: ls/inspect/verify/gc on a directory and on s3:// (moto on 127.0.0.1), with
--storage-option or credentials from the environment; `report` on a real run's metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from s3_server import KEY, SECRET, client, s3_bucket, s3_endpoint  # noqa: F401 - fixtures

from _models import child_env
from checkpointing import CheckpointManager, CheckpointUploadError
from checkpointing.cli.app import main
from checkpointing.cli.targets import storage_options

MiB = 1 << 20


@pytest.fixture
def run(run_cli):
    return run_cli


@pytest.fixture
def saved(tmp_path, s3_bucket):
    """Steps 1..3 on a local tier (keep_local=2) and an S3 tier (all kept)."""
    url, options = s3_bucket
    local = tmp_path / "local"
    with CheckpointManager(local, remote=url, storage_options=options, upload_part_bytes=5 * MiB) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((1 << 16,), float(step)), "lr": 0.5}).wait()
    return local, url, options


def opts(options: dict) -> list[str]:
    return ["-o", f"endpoint_url={options['endpoint_url']}", "-o", f"key={options['key']}", "-o", f"secret={options['secret']}",
            "-o", "client_kwargs.region_name=us-east-1"]


def test_storage_options_parse_nested_and_typed():
    assert storage_options(["a=1", "b=true", "c.d=x", "c.e=2.5", "u=http://h:9/p?q=1"]) == {
        "a": 1, "b": True, "c": {"d": "x", "e": 2.5}, "u": "http://h:9/p?q=1"}
    # a credential is the text typed, and so is a number Python would write otherwise (leading zeros, exponents)
    assert storage_options(["secret=0123", "key=1e5", "client_kwargs.aws_session_token=42", "n=007", "f=1e5"]) == {
        "secret": "0123", "key": "1e5", "client_kwargs": {"aws_session_token": "42"}, "n": "007", "f": "1e5"}
    assert main(["ls", "s3://b/p", "-o", "novalue"]) == 2


def test_ls_inspect_verify_on_s3_with_storage_options(saved, run):
    local, url, options = saved
    code, out = run("ls", url, *opts(options), "--json")
    assert code == 0, out
    rows = json.loads(out)
    assert [(r["step"], r["state"]) for r in rows] == [(1, "committed"), (2, "committed"), (3, "committed")]
    assert all(r["bytes"] > 0 and r["committed_at"] for r in rows)
    code, out = run("inspect", url, *opts(options), "--step", "2")
    assert code == 0 and "step 2" in out and "lr = 0.5" in out, out
    code, out = run("verify", url, *opts(options))
    assert code == 0 and "all 3 step(s) verified" in out, out
    assert SECRET not in out


def test_ls_with_remote_shows_where_each_step_is_durable(saved, run):
    local, url, options = saved
    code, out = run("ls", url, "--remote", url, *opts(options), "--json")
    assert code == 0 and {r["tier"] for r in json.loads(out)} == {"local+remote"}, out
    # a local directory beside an S3 tier: the storage options are the remote tier's
    code, out = run("ls", str(local), "--remote", url, *opts(options), "--json")
    assert code == 0, out
    assert [(r["step"], r["tier"]) for r in json.loads(out)] == [(1, "remote"), (2, "local+remote"), (3, "local+remote")], out
    assert SECRET not in out
    code, out = run("ls", str(local), *opts(options))  # no URL at all to apply them to
    assert code != 0 and "applies to URLs" in out, out


def test_credentials_from_the_environment(saved, run, monkeypatch):
    local, url, options = saved
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    code, out = run("ls", str(local), "--remote", url, "--json")
    assert code == 0, out
    assert [(r["step"], r["state"], r["tier"]) for r in json.loads(out)] == [
        (1, "remote only", "remote"), (2, "committed", "local+remote"), (3, "committed", "local+remote")]
    code, out = run("ls", str(local), "--remote", url)
    assert code == 0 and "local+remote" in out and "remote only" in out, out
    code, out = run("verify", url, "--step", "1")
    assert code == 0 and "ok" in out, out


def test_verify_finds_damage_on_s3_and_bad_credentials_fail_cleanly(saved, run):
    local, url, options = saved
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    key = next(o["Key"] for o in client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-0000000002/")["Contents"]
               if o["Key"].endswith(".pack"))
    body = bytearray(client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[10] ^= 0xFF
    client().put_object(Bucket=bucket, Key=key, Body=bytes(body))
    code, out = run("verify", url, *opts(options))
    assert code == 1 and "DAMAGED step 2" in out and "1 of 3 step(s) damaged" in out, out
    wrong = ["-o", f"endpoint_url={options['endpoint_url']}", "-o", "key=nobody", "-o", "secret=wrong-secret-123",
             "-o", "client_kwargs.region_name=us-east-1"]
    code, out = run("ls", "s3://no-such-bucket-x/p", *wrong)
    assert code == 2 and "cannot open s3://no-such-bucket-x/p" in out and "wrong-secret-123" not in out, out


def test_inspect_names_a_missing_or_truncated_data_file_on_each_tier(saved, run):
    """inspect checks every data file's size without reading it (on S3: a listing of the step's
    directory): a truncated pack on the remote tier and a deleted one on the local tier are named."""
    local, url, options = saved
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    key = next(o["Key"] for o in client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-0000000003/")["Contents"]
               if o["Key"].endswith(".pack"))
    client().put_object(Bucket=bucket, Key=key, Body=b"short")
    code, out = run("inspect", url, *opts(options), "--step", "3")
    assert code == 1 and "damaged" in out and key.rsplit("/", 1)[1] in out and "5 bytes, expected" in out, out
    code, out = run("inspect", url, *opts(options), "--step", "2")
    assert code == 0, out
    [pack] = (local / "step-0000000003").glob("*.pack")
    pack.unlink()
    code, out = run("inspect", str(local), "--step", "3")
    assert code == 1 and f"{pack.name}: missing or not a regular file" in out, out
    # ls tells it too (sizes only): the step is listed damaged, not committed, on both tiers
    code, out = run("ls", str(local), "--json")
    rows = {r["step"]: r for r in json.loads(out)}
    assert code == 0 and rows[3]["state"] == "damaged" and pack.name in rows[3]["error"] and "verify" in rows[3]["error"], out
    assert rows[2]["state"] == "committed", out
    code, out = run("ls", url, *opts(options), "--json")
    assert [r["state"] for r in json.loads(out)] == ["committed", "committed", "damaged"], out


def test_gc_removes_only_unreferenced_data(run, tmp_path, s3_bucket):
    url, options = s3_bucket
    kwargs = dict(remote=url, storage_options=options, upload_part_bytes=5 * MiB)
    with CheckpointManager(tmp_path / "a", **kwargs) as a, CheckpointManager(tmp_path / "b", **kwargs) as b:
        for step in (1, 2, 3):
            a.save(step, {"w": torch.full((1 << 16,), float(step))}).wait()
        with pytest.raises(CheckpointUploadError, match="another writer"):  # b started before a saved step 3
            b.save(3, {"w": torch.zeros(1 << 16)}).wait()
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    client().put_object(Bucket=bucket, Key=f"{prefix}/step-0000000009/r00000.abc.pack", Body=b"x" * 100)  # never committed
    code, out = run("gc", url, *opts(options), "--dry-run", "--min-age-s", "0")
    assert code == 0, out
    assert "would remove step-0000000009" in out and out.count("would remove step-0000000003/") == 2, out  # b's pack and manifest
    code, out = run("gc", url, *opts(options), "--dry-run")  # everything is younger than an hour: left alone
    assert "nothing unreferenced" in out, out
    code, out = run("gc", url, *opts(options), "--min-age-s", "0")
    assert code == 0 and "removed 3 unreferenced object(s)" in out, out
    code, out = run("gc", url, *opts(options), "--min-age-s", "0")
    assert "nothing unreferenced" in out
    code, out = run("verify", url, *opts(options))
    assert code == 0 and "all 3 step(s) verified" in out, out
    code, out = run("gc", str(tmp_path / "b"), "--dry-run", "--min-age-s", "0")
    assert code == 0 and "nothing unreferenced" in out, out


def test_gc_aborts_a_multipart_upload_left_unfinished(saved, run):
    """A process that lost the network while aborting leaves an upload listing does not show: gc finds it."""
    local, url, options = saved
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    key = f"{prefix}/step-0000000009/r00000.abc.pack"
    upload = client().create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    client().upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * (5 * MiB))
    code, out = run("gc", url, *opts(options), "--dry-run", "--min-age-s", "0")
    assert code == 0 and "would abort the unfinished multipart upload of step-0000000009/r00000.abc.pack" in out, out
    assert "1 unfinished upload(s): run without --dry-run to abort them" in out, out  # (moto dates every upload 2010: no age test)
    foreign = [f"{prefix}/other/big.bin", f"{prefix}/notes.bin", f"{prefix}/step-0000000009/notes.bin"]  # another program's
    for name in foreign:
        client().create_multipart_upload(Bucket=bucket, Key=name)
    code, out = run("gc", url, *opts(options), "--min-age-s", "0")
    assert code == 0 and "aborted the unfinished multipart upload of step-0000000009/r00000.abc.pack" in out, out
    assert "1 unfinished upload(s) aborted" in out and "notes.bin" not in out, out
    left = client().list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    assert sorted(u["Key"] for u in left) == sorted(foreign)  # gc aborts only uploads of names a save writes
    code, out = run("verify", url, *opts(options))
    assert code == 0 and "all 3 step(s) verified" in out, out


def test_report_on_a_real_runs_metrics(saved, run, tmp_path):
    local, url, options = saved
    code, out = run("report", str(local))
    assert code == 0, out
    assert "upload" in out and "local+remote" in out and "3 saves, 3 ok" in out, out
    code, out = run("report", str(local), "--json")
    doc = json.loads(out)
    assert [s["step"] for s in doc["saves"]] == [1, 2, 3] and all(s["upload_s"] > 0 for s in doc["saves"])
    assert SECRET not in (local / "metrics.jsonl").read_text()
    assert run("report", str(tmp_path / "nothing-here"))[0] == 2


def test_report_on_the_remote_tier_reads_rank_zeros_copy_of_the_metrics(saved, run, tmp_path):
    """ARCHITECTURE.md: report works on any tier URL; the uploads keep a copy of metrics.jsonl there."""
    local, url, options = saved
    code, out = run("report", url, *opts(options), "--json")
    assert code == 0, out
    assert [s["step"] for s in json.loads(out)["saves"]] == [1, 2, 3] and SECRET not in out
    code, out = run("report", str(local), "-o", "key=k")
    assert code == 2 and "applies to URLs" in out, out
    empty = url.rsplit("/", 1)[0] + "/nothing-saved-here"
    code, out = run("report", empty, *opts(options))
    assert code == 2 and "no save metrics recorded" in out, out


def test_report_on_the_remote_tier_has_every_save_after_close(tmp_path, s3_bucket, run):
    """With an optimizer marking steps, a save's record is final only at close(): its copy follows it."""
    url, options = s3_bucket
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "local", remote=url, storage_options=options, upload_part_bytes=5 * MiB) as mgr:
        for step in range(1, 6):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            mgr.save(step, {"model": model, "optim": opt})
    code, out = run("report", url, *opts(options), "--json")
    assert code == 0 and [s["step"] for s in json.loads(out)["saves"]] == [1, 2, 3, 4, 5], out


def test_the_console_script_entry_runs_report(saved):
    local, _, _ = saved
    r = subprocess.run([sys.executable, "-m", "checkpointing", "report", str(local)], env=child_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "saves" in r.stdout, r.stderr


def test_rm_and_gc_on_a_file_url_take_the_writer_lock_of_a_live_managers_directory(tmp_path, run):
    d = tmp_path / "ck"
    with CheckpointManager(d, keep_local=None) as mgr:  # a training process holds the directory
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((4,), float(step))}).wait()
        (d / "step-0000000001" / "stray.tmp").write_bytes(b"x")  # something for gc to remove
        for target in (str(d), f"file://{d}"):  # another process: the lock is per process
            for argv in (["rm", target, "--step", "1"], ["gc", target, "--min-age-s", "0"]):
                r = subprocess.run([sys.executable, "-m", "checkpointing", *argv], env=child_env(), capture_output=True, text=True, timeout=120)
                assert r.returncode == 2 and "holds" in r.stderr, (argv, r.stdout, r.stderr)
        assert mgr.steps() == [1, 2, 3] and (d / "step-0000000001" / "stray.tmp").exists()
    code, out = run("rm", f"file://{d}", "--step", "1")  # closed: the lock is free
    assert code == 0 and "deleted step 1" in out, out
    remote = tmp_path / "remote-tier"  # a file:// tier no manager writes as its local one: no lock, no WRITER file made
    with CheckpointManager(tmp_path / "node", remote=f"file://{remote}", keep_local=None) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step))}).wait()
    code, out = run("rm", f"file://{remote}", "--step", "1")
    assert code == 0 and not (remote / "WRITER").exists(), out


def _per_rank_save(rank: int, world: int, d: str) -> None:
    with CheckpointManager(d) as mgr:
        mgr.save(1, {"mine": torch.full((3,), float(rank)), "shared": torch.ones(2), "loader": {"pos": rank * 10}, "epoch": 3}).wait()


def test_inspect_shows_each_ranks_values_and_which_rank_holds_each_tensor(tmp_path, run):
    from _dist import run_ranks

    d = tmp_path / "ck"
    run_ranks(_per_rank_save, 2, str(d), tmp=tmp_path)
    code, out = run("inspect", str(d))
    assert code == 0, out
    lines = out.splitlines()
    assert sum(1 for ln in lines if "│ mine" in ln) == 2 and any("│ shared" in ln and "all" in ln for ln in lines), out
    assert "values of rank 0" in out and "values of rank 1" in out and "loader/pos = 10" in out and "loader/pos = 0" in out, out
    code, out = run("inspect", str(d), "--json")
    doc = json.loads(out)
    assert doc["rank_trees"] == [0, 1] and len(doc["trees"]) == 2 and doc["world_size"] == 2
    assert sorted(t["ranks"] for t in doc["tensors"] if t["key"] == "mine") == [[0], [1]]
    assert [t["ranks"] for t in doc["tensors"] if t["key"] == "shared"] == [[0, 1]]
    code, out = run("inspect", str(d), "--max-values", "-1")
    assert code == 2 and "--max-values must be >= 0" in out, out


def test_inspect_lists_values_under_their_escaped_keys_with_their_byte_sizes(tmp_path, run):
    d = tmp_path / "ck"
    with CheckpointManager(d) as mgr:
        mgr.save(1, {"v": {"a/b": 1, "a": {"b": 2}, "x%2Fy": 3, "b2": b"\x00\xff", "b1": b"x", "b4": b"abcd", "b0": b""}}).wait()
    code, out = run("inspect", str(d))
    assert code == 0, out
    for line in ("v/a%2Fb = 1", "v/a/b = 2", "v/x%252Fy = 3", "v/b2 = <2 bytes>", "v/b1 = <1 bytes>", "v/b4 = <4 bytes>", "v/b0 = <0 bytes>"):
        assert line in out, (line, out)
