"""The remote tier end to end: CheckpointManager(remote=...) on a moto S3 server (127.0.0.1), memory://
and file://. Faults are injected by wrapping the real backend (tests/faults.py); ranks are real
processes on gloo (tests/_dist.py, tests/_tiered.py). Nothing is mocked.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from faults import Fault, InjectedCrash, inject
from s3_server import SECRET, s3_bucket, s3_endpoint  # noqa: F401 - fixtures

import _tiered
import checkpointing
from _dist import run_ranks
from checkpointing import CheckpointConfigError, CheckpointError, CheckpointManager, CheckpointUploadError
from checkpointing.tier import catalog
from checkpointing.tier import collect
from checkpointing.format import naming
from checkpointing.observe.metrics import read_jsonl
from checkpointing.storage import RetryPolicy, open_storage
from checkpointing.tier.verify import verify_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MiB = 1 << 20
FAST = RetryPolicy(attempts=4, base_s=0.001, cap_s=0.005)


def manager(local: Path, bucket: tuple[str, dict], **kwargs) -> CheckpointManager:
    url, options = bucket
    kwargs.setdefault("upload_part_bytes", 5 * MiB)
    mgr = CheckpointManager(local, remote=url, storage_options=options, **kwargs)
    mgr.remote_storage.retry = FAST  # transient faults are retried quickly
    return mgr


def state(seed: int, n: int = 1 << 18) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(64, 33, generator=g), "step": seed, "cfg": {"name": "run"}}


def blank(n: int = 1 << 18) -> dict:
    return {"w": torch.zeros(n), "b": torch.zeros(64, 33), "step": -1, "cfg": {}}


def same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"] and a["cfg"] == b["cfg"]


def remote_of(bucket: tuple[str, dict]):
    return open_storage(bucket[0], bucket[1])


def assert_remote_whole(remote) -> list[int]:
    """Every step visible on the remote tier verifies completely: nothing half-uploaded is ever committed."""
    committed = catalog.list_steps(remote).committed
    for step in committed:
        report = verify_step(remote, step)
        assert report.ok, report.problems
    return committed


# ----------------------------------------------------------------------------- the happy path


def test_save_uploads_every_step_and_restores_from_the_remote_only(tmp_path, s3_bucket):
    local = tmp_path / "local"
    with manager(local, s3_bucket, keep_local=None) as mgr:
        handles = [mgr.save(s, state(s)) for s in (1, 2, 3)]
        stats = [h.wait() for h in handles]
        assert [s.tier for s in stats] == ["local+remote"] * 3 and all(s.ok for s in stats)
        assert all(s.upload_s > 0 and s.bytes_uploaded > 0 and s.upload_bytes_per_s > 0 for s in stats)
        assert mgr.tiers() == {1: "local+remote", 2: "local+remote", 3: "local+remote"}
        assert mgr.steps() == [1, 2, 3]
    remote = remote_of(s3_bucket)
    assert assert_remote_whole(remote) == [1, 2, 3]
    # the remote copy of each pack holds exactly its primary prefix (everything, with one rank)
    manifest = catalog.load_manifest(remote, 3)
    for f in manifest.files:
        assert remote.size(f.path) == f.primary_bytes == f.nbytes
    records = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines()]
    assert [r["tier"] for r in records] == ["local+remote"] * 3 and all(r["upload_s"] > 0 for r in records)
    # credentials are in no file of either tier (manifests, commit markers, metrics, packs)
    assert not [p for p in local.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    names = [f"{naming.step_dir(s)}/{n}" for s in (1, 2, 3) for n in remote.list(naming.step_dir(s))]
    assert len(names) == 9 and not [n for n in names if SECRET.encode() in remote.get(n)]

    shutil.rmtree(local)  # the machine is gone: a new one has only the bucket
    target = blank()
    with manager(tmp_path / "new-machine", s3_bucket) as mgr:
        assert mgr.tiers() == {1: "remote", 2: "remote", 3: "remote"}
        assert mgr.restore(target) == 3 and same(target, state(3))
        assert mgr.restore(target, step=1) == 1 and same(target, state(1))
        mgr.save(4, state(4)).wait()  # and training goes on from there
        assert mgr.tiers()[4] == "local+remote"


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_other_fsspec_remotes(tmp_path, scheme):
    url = f"memory://ckpt-{uuid.uuid4().hex}/run" if scheme == "memory" else (tmp_path / "remote").as_uri()
    with CheckpointManager(tmp_path / "a", remote=url, upload_part_bytes=1 * MiB) as mgr:
        mgr.save(7, state(7)).wait()
        assert mgr.tiers() == {7: "local+remote"}
    target = blank()
    with CheckpointManager(tmp_path / "b", remote=url) as mgr:
        assert mgr.restore(target) == 7 and same(target, state(7))


def test_a_file_remote_that_overlaps_the_local_directory_is_refused(tmp_path):
    """The same directory (its retention would delete what keep_remote keeps), or one inside the other."""
    local = tmp_path / "ck"
    local.mkdir()
    (tmp_path / "link").symlink_to(local)
    for remote, how in [(local.as_uri(), "is"), (f"file://{tmp_path / 'link'}", "is"), ((local / "remote").as_uri(), "lies inside"),
                        (tmp_path.as_uri(), "contains")]:
        with pytest.raises(CheckpointConfigError, match=f"remote tier .* {how} the local directory .*separate directories"):
            CheckpointManager(local, remote=remote, keep_local=1)
    assert sorted(p.name for p in local.iterdir()) == []  # refused before anything was written
    with CheckpointManager(local, remote=(tmp_path / "ck-remote").as_uri(), keep_local=1) as mgr:  # a sibling whose name extends it
        mgr.save(1, state(1)).wait()


def test_options_are_validated_and_secrets_never_shown(tmp_path, s3_bucket):
    url, options = s3_bucket
    for kwargs, text in [
        ({"remote": "/some/dir"}, "is not a URL"),
        ({"remote": url, "upload_part_bytes": 1 * MiB}, "upload_part_bytes"),
        ({"remote": url, "upload_concurrency": 0}, "upload_concurrency"),
        ({"remote": url, "upload_bytes_per_s": -1}, "upload_bytes_per_s"),
        ({"keep_remote": 2}, "without a remote tier"),
        ({"storage_options": {"key": "k"}}, "without remote"),
        ({"remote": "nosuchscheme://x/y"}, "no filesystem"),
        ({"remote": "file://tmp/x"}, r"relative path.*file:///absolute/path"),  # two slashes: would land under the cwd
        ({"remote": url, "storage_options": "endpoint_url=x"}, "storage_options must be a dict"),
        ({"remote": url, "storage_options": {**options, "client_kwargs": {"region": "x"}}},
         r"'client_kwargs.region' \(did you mean 'client_kwargs.region_name'\?\)"),
    ]:
        with pytest.raises(CheckpointConfigError, match=text):
            CheckpointManager(tmp_path / "x", **{"storage_options": options if "remote" in kwargs else None, **kwargs})
    for local in ("file:///tmp/x", url):  # a URL as the local directory would land under the current directory
        with pytest.raises(CheckpointConfigError, match=r"is a URL: the local tier is a directory .*remote="):
            CheckpointManager(local)
    typo = {("endpoint" if k == "endpoint_url" else k): v for k, v in options.items()}
    with pytest.raises(CheckpointConfigError, match="'endpoint' \\(did you mean 'endpoint_url'\\?\\)") as info:
        CheckpointManager(tmp_path / "t", remote=url, storage_options=typo)  # s3fs would fail later, inside botocore
    assert SECRET not in str(info.value) and not (tmp_path / "t").exists()
    with pytest.raises(CheckpointConfigError, match="cannot use the remote tier") as info:
        CheckpointManager(tmp_path / "y", remote="s3://no-such-bucket-here/p", storage_options=options)
    assert SECRET not in str(info.value)
    with manager(tmp_path / "z", s3_bucket, keep_remote=3) as mgr:
        assert SECRET not in repr(mgr) and SECRET not in repr(mgr.options) and url in repr(mgr)


# ----------------------------------------------------------------------------- faults


@pytest.mark.parametrize("fault", [
    Fault("upload_part", "slowdown", times=2),
    Fault("put_object", "slowdown", times=2),
    Fault("upload_part", "reset", times=1),
    Fault("put_object", "reset", times=2),
    Fault("upload_part", "truncate", times=1),
    Fault("complete_multipart_upload", "lost", times=1),
], ids=lambda f: f"{f.op}-{f.kind}")
def test_transient_faults_are_retried_and_the_step_becomes_durable(tmp_path, s3_bucket, fault):
    with manager(tmp_path / "local", s3_bucket) as mgr:
        proxy = inject(mgr.remote_storage, fault)
        stats = mgr.save(1, state(1, n=3 << 20)).wait()  # 12 MB: a multipart upload of 3 parts
        assert stats.ok and stats.tier == "local+remote"
        assert fault.fired == fault.times, proxy.calls[-5:]
    assert assert_remote_whole(remote_of(s3_bucket)) == [1]
    target = blank(3 << 20)
    with manager(tmp_path / "other", s3_bucket) as mgr:
        assert mgr.restore(target) == 1 and same(target, state(1, n=3 << 20))


@pytest.mark.parametrize("fault, cause", [
    (Fault("upload_part", "short", times=1), r"part \d+ is \d+ bytes on the server"),  # the server stored a truncated part: caught by ListParts
    (Fault("put_object", "short", times=1, path="*.pack"), "expected"),  # a truncated single PUT: caught before COMMIT
    (Fault("*", "denied", times=-1), "AccessDenied"),
    (Fault("put_object", "crash", path="*/COMMIT"), "InjectedCrash"),  # dies between the data and the commit marker
], ids=["short-part", "short-put", "denied", "crash-before-commit"])
def test_failed_uploads_never_show_a_remote_step_and_leave_the_local_one(tmp_path, s3_bucket, fault, cause, caplog):
    n = 3 << 20 if fault.op == "upload_part" else 1 << 18
    with manager(tmp_path / "local", s3_bucket, keep_local=None) as mgr:
        proxy = inject(mgr.remote_storage, fault)
        h = mgr.save(1, state(1, n=n))
        with pytest.raises(CheckpointUploadError, match=cause) as info:
            h.wait()
        message = str(info.value)
        assert "step 1" in message and "committed on the local tier" in message and SECRET not in message
        assert catalog.list_steps(remote_of(s3_bucket)).committed == []
        assert mgr.tiers() == {1: "local"}
        records = [json.loads(line) for line in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["ok"] is False and records[-1]["tier"] == "local" and re.search(cause, records[-1]["error"])
        target = blank(n)
        assert mgr.restore(target) == 1 and same(target, state(1, n=n))  # the local step is untouched
        proxy.faults.clear()
        assert mgr.save(2, state(2, n=n)).wait().tier == "local+remote"  # the next save uploads again
        mgr.wait()  # the error was reported once
        assert catalog.list_steps(remote_of(s3_bucket)).committed == [2]  # the remote tier failed last: step 1 waited
        mgr.save(3, state(3, n=n)).wait()  # it answers again: step 1's upload goes again first (one process)
    assert assert_remote_whole(remote_of(s3_bucket)) == [1, 2, 3]
    assert SECRET not in caplog.text


def test_an_upload_error_surfaces_at_the_next_save_or_wait(tmp_path, s3_bucket):
    with manager(tmp_path / "local", s3_bucket) as mgr:
        proxy = inject(mgr.remote_storage, Fault("*", "denied", times=-1))
        mgr.save(1, state(1))
        with pytest.raises(CheckpointUploadError):
            mgr.wait()
        mgr.wait()  # once
        mgr.save(2, state(2))
        h3 = mgr.save(3, state(3))  # the upload of 2 has not necessarily finished: not raised yet
        with pytest.raises(CheckpointUploadError, match="step 2"):
            mgr.save(4, state(4))  # waits for the upload before last (2), raises its error, saves nothing
        while not h3.done():
            time.sleep(0.01)
        proxy.faults.clear()
        with pytest.raises(CheckpointUploadError, match="step 3"):
            mgr.wait()
        mgr.save(5, state(5)).wait()  # the remote tier failed last: only step 5 goes (an outage costs one upload per save)
        assert mgr.tiers() == {1: "local", 2: "local", 3: "local", 5: "local+remote"}  # 4 was never saved
        mgr.save(6, state(6)).wait()  # it answers again: the failed uploads of 1, 2 and 3 go again first (one process)
        mgr.wait()
        assert mgr.tiers() == {1: "remote", 2: "remote", 3: "remote", 5: "local+remote", 6: "local+remote"}  # keep_local=2


@pytest.mark.parametrize("keep_remote", [None, 1])
def test_an_outage_costs_each_save_its_own_upload_and_keep_remote_drops_what_it_would_not_keep(tmp_path, s3_bucket, caplog, keep_remote):
    """One process: while the remote tier fails, no failed upload is tried again (each save pays its own upload's retry
    budget, not every failed one's, and the stall stays flat); once it answers, they go again, those keep_remote keeps."""
    with manager(tmp_path / "local", s3_bucket, keep_local=1, keep_remote=keep_remote) as mgr:
        mgr.save(1, state(1)).wait()
        proxy = inject(mgr.remote_storage, Fault("*", "denied", times=-1))
        for step in range(2, 7):
            with pytest.raises(CheckpointUploadError, match=f"step {step}"):
                mgr.save(step, state(step)).wait()
        assert not [m for m in caplog.messages if "trying the failed upload" in m]
        held = {1: "remote", 6: "local"} if keep_remote == 1 else {1: "remote", **{s: "local" for s in range(2, 7)}}
        assert mgr.tiers() == held  # keep_remote=1 keeps only the newest: the others need not wait locally
        proxy.faults.clear()
        mgr.save(7, state(7)).wait()
        mgr.save(8, state(8)).wait()
        mgr.wait()
        tried = sorted(int(m.split("step ")[1].split()[0]) for m in caplog.messages if "trying the failed upload" in m)
        assert tried == ([] if keep_remote == 1 else [2, 3, 4, 5, 6])
        assert mgr.tiers() == ({8: "local+remote"} if keep_remote == 1 else
                               {1: "remote", **{s: "remote" for s in range(2, 8)}, 8: "local+remote"})


def test_a_failed_upload_that_succeeds_later_is_recorded_again_and_the_report_shows_the_save_ok(tmp_path, s3_bucket, run_cli):
    """docs/observability.md: a failed upload tried again that succeeds gets a second record of its save (ok, both tiers,
    upload_tries 2) in mgr.stats(), metrics.jsonl, on_metrics and the remote tier's copy; the report folds the two."""
    got: list[dict] = []
    local = tmp_path / "local"
    with manager(local, s3_bucket, on_metrics=got.append) as mgr:
        mgr.save(1, state(1)).wait()
        proxy = inject(mgr.remote_storage, Fault("*", "denied", times=-1))
        h2 = mgr.save(2, state(2))
        with pytest.raises(CheckpointUploadError, match="step 2"):
            h2.wait()
        assert [(s.step, s.ok, s.tier, s.upload_tries) for s in mgr.stats()] == [(1, True, "local+remote", 1), (2, False, "local", 1)]
        proxy.faults.clear()
        mgr.save(3, state(3)).wait()  # the remote tier answers again
        mgr.save(4, state(4)).wait()  # the failed upload of 2 goes first
        mgr.wait()
        assert h2.exception() is None and h2.wait().step == 2  # durable now: its handle says so
        stats = {s.step: s for s in mgr.stats()}
        assert sorted(stats) == [1, 2, 3, 4]
        s2 = stats[2]
        assert (s2.ok, s2.tier, s2.error, s2.upload_tries, s2.committed) == (True, "local+remote", None, 2, True)
        assert s2.bytes_uploaded == stats[1].bytes_uploaded > 0 and s2.upload_s > 0
        assert mgr.tiers() == {1: "remote", 2: "remote", 3: "local+remote", 4: "local+remote"}
    assert mgr.tiers() == {1: "remote", 2: "remote", 3: "local+remote", 4: "local+remote"}  # closed: its own loop is gone
    lines = [r for r in read_jsonl(local / naming.METRICS_NAME) if r["step"] == 2]
    assert [(r["ok"], r["tier"], r["upload_tries"]) for r in lines] == [(False, "local", 1), (True, "local+remote", 2)]
    assert lines[0]["time"] == lines[1]["time"] and lines[1]["error"] is None
    assert [(r["step"], r["ok"]) for r in got] == [(1, True), (2, False), (3, True), (2, True), (4, True)]
    for where in (str(local), s3_bucket[0]):  # rank 0's copy on the remote tier has the second record too
        o = s3_bucket[1]
        opts = ["-o", f"endpoint_url={o['endpoint_url']}", "-o", f"key={o['key']}", "-o", f"secret={o['secret']}",
                "-o", "client_kwargs.region_name=us-east-1"] if "://" in where else []
        code, out = run_cli("report", where, "--json", *opts)
        assert code == 0, out
        doc = json.loads(out)
        assert [(r["step"], r["ok"], r["upload_tries"]) for r in doc["saves"]] == [(1, True, 1), (2, True, 2), (3, True, 1), (4, True, 1)]
        assert (doc["summary"]["saves"], doc["summary"]["ok"], doc["summary"]["failed"]) == (4, 4, 0)
    code, out = run_cli("report", str(local))
    assert code == 0 and "ok (uploaded at try 2)" in out, out


def test_an_upload_that_failed_and_is_resumed_by_later_processes_records_each_try_of_its_save(tmp_path, s3_bucket, run_cli,
                                                                                             monkeypatch):
    """The save's first record (upload failed) was written by the process before: each upload a later manager resumes
    adds a record of that save, from it (same time), counting the tries on over processes (the second process's
    resumed upload fails too: its filesystem denies step 1's objects; the third one's succeeds)."""
    import checkpointing.storage.remote as remote_module
    from faults import FaultyFS

    local, real_open = tmp_path / "local", remote_module.open_endpoint

    def denied(*args, **kwargs):  # the endpoint a manager opens, wrapped before its start-up resumes anything
        endpoint = real_open(*args, **kwargs)
        endpoint.fs = FaultyFS(endpoint.fs, Fault("*", "denied", times=-1, path="*step-0000000001*"))
        return endpoint

    with manager(local, s3_bucket) as mgr:
        inject(mgr.remote_storage, Fault("*", "denied", times=-1))
        with pytest.raises(CheckpointUploadError, match="step 1"):
            mgr.save(1, state(1)).wait()
    monkeypatch.setattr(remote_module, "open_endpoint", denied)
    with manager(local, s3_bucket) as mgr:
        mgr.wait()  # the resumed upload, failed again (logged: no save of this process waits for it)
        assert mgr.tiers() == {1: "local"}
    monkeypatch.setattr(remote_module, "open_endpoint", real_open)
    with manager(local, s3_bucket) as mgr:
        mgr.wait()  # resumed once more: it succeeds
        assert mgr.tiers() == {1: "local+remote"}
    lines = read_jsonl(local / naming.METRICS_NAME)
    assert [(r["step"], r["ok"], r["tier"], r["upload_tries"]) for r in lines] == [
        (1, False, "local", 1), (1, False, "local", 2), (1, True, "local+remote", 3)]
    assert len({r["time"] for r in lines}) == 1 and lines[0]["stall_s"] == lines[2]["stall_s"] and lines[2]["bytes_uploaded"] > 0
    code, out = run_cli("report", str(local), "--json")
    doc = json.loads(out)
    assert code == 0 and [(r["step"], r["ok"], r["upload_tries"]) for r in doc["saves"]] == [(1, True, 3)]
    assert doc["summary"]["failed"] == 0


def test_a_replacement_node_keeps_the_runs_metrics_history_on_the_remote_tier(tmp_path, s3_bucket, run_cli):
    """docs/observability.md: the copy of metrics.jsonl on the remote tier is there for `report URL` after the node is
    gone. A replacement node (an empty local directory) takes the copy's records first, so its own uploads do not put
    a shorter file over the history; the node that comes back later keeps what the other one added, in time order."""
    from checkpointing.save.metrics_copy import merged

    o = s3_bucket[1]
    opts = ["-o", f"endpoint_url={o['endpoint_url']}", "-o", f"key={o['key']}", "-o", f"secret={o['secret']}",
            "-o", "client_kwargs.region_name=us-east-1"]

    def reported(where: str) -> list[int]:
        code, out = run_cli("report", where, "--json", *(opts if "://" in where else []))
        assert code == 0, out
        return [r["step"] for r in json.loads(out)["saves"]]

    node_a, node_b = tmp_path / "a", tmp_path / "b"
    with manager(node_a, s3_bucket) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step)).wait()
    assert reported(s3_bucket[0]) == [1, 2, 3]
    with manager(node_b, s3_bucket) as mgr:  # node a is gone: a new one resumes from the remote tier
        target = blank()
        assert mgr.restore(target) == 3 and same(target, state(3))
        for step in (4, 5):
            mgr.save(step, state(step)).wait()
    assert reported(s3_bucket[0]) == [1, 2, 3, 4, 5] == reported(str(node_b))
    with manager(node_a, s3_bucket) as mgr:  # node a comes back: its file lacks 4 and 5
        assert mgr.restore(blank()) == 5
        mgr.save(6, state(6)).wait()
    assert reported(s3_bucket[0]) == [1, 2, 3, 4, 5, 6] == reported(str(node_a))
    # the merge itself: lines the local file lacks, each once, by time; a line without a time keeps its neighbour's
    local = b'{"step": 1, "time": 10}\n{"step": 4, "time": 40}\n'
    remote = b'{"step": 1, "time": 10}\n{"step": 2, "time": 20}\nnot json\n{"step": 2, "time": 20}\n{"step": 3, "time": 30}\n'
    data, added = merged(local, remote)
    assert added == 3 and data.splitlines() == [b'{"step": 1, "time": 10}', b'{"step": 2, "time": 20}', b"not json",
                                                b'{"step": 3, "time": 30}', b'{"step": 4, "time": 40}']
    assert merged(local, local) == (local, 0)
    # another node's record of step 4 as recovered (it found the step unrecorded in the copy): this node has its own
    stand_in = b'{"step": 4, "time": 41, "recovered": true}\n{"step": 5, "time": 50, "recovered": true}\n'
    data, added = merged(local, stand_in)
    assert added == 1 and data.splitlines()[-1] == b'{"step": 5, "time": 50, "recovered": true}'


def test_local_retention_keeps_a_step_whose_upload_failed_until_it_is_uploaded(tmp_path, s3_bucket):
    """docs/design.md: the only copy of a step is never deleted before it is durable elsewhere."""
    with manager(tmp_path / "local", s3_bucket) as mgr:  # keep_local=2, every step kept remotely
        mgr.save(1, state(1)).wait()
        proxy = inject(mgr.remote_storage, Fault("*", "denied", times=-1))
        with pytest.raises(CheckpointUploadError, match="tries this upload again"):
            mgr.save(2, state(2)).wait()
        for step in (3, 4):
            with pytest.raises(CheckpointUploadError, match=f"step {step}"):
                mgr.save(step, state(step)).wait()
        assert mgr.tiers() == {1: "remote", 2: "local", 3: "local", 4: "local"}  # keep_local=2 keeps more: their only copies
        proxy.faults.clear()
        mgr.save(5, state(5)).wait()
        assert mgr.tiers() == {1: "remote", 2: "local", 3: "local", 4: "local", 5: "local+remote"}
        mgr.save(6, state(6)).wait()  # the remote tier answers again: 2, 3 and 4 go first
        mgr.wait()
        assert mgr.tiers() == {1: "remote", 2: "remote", 3: "remote", 4: "remote", 5: "local+remote", 6: "local+remote"}
    assert assert_remote_whole(remote_of(s3_bucket)) == [1, 2, 3, 4, 5, 6]


def test_a_crash_between_data_and_commit_resumes_when_the_manager_starts_again(tmp_path, s3_bucket, caplog):
    local = tmp_path / "local"
    with manager(local, s3_bucket) as mgr:
        inject(mgr.remote_storage, Fault("put_object", "crash", path="*/COMMIT"))
        with pytest.raises(CheckpointUploadError, match="InjectedCrash"):
            mgr.save(1, state(1, n=3 << 20)).wait()
    remote = remote_of(s3_bucket)
    listing = catalog.list_steps(remote)
    assert listing.committed == [] and listing.incomplete == [1]  # data and manifest are there, invisible
    caplog.set_level(logging.INFO, logger="checkpointing")
    with manager(local, s3_bucket) as mgr:
        mgr.wait()  # the resumed upload
        assert mgr.tiers() == {1: "local+remote"}
    resumed = [r.getMessage() for r in caplog.records if "resumed upload of step 1" in r.getMessage()]
    assert resumed and "0.0 MB sent" in resumed[0], resumed  # the data objects were reused, not sent again
    assert assert_remote_whole(remote) == [1]


_CHILD = textwrap.dedent(r"""
    import sys, time, torch
    from pathlib import Path
    from checkpointing import CheckpointManager
    local, url, endpoint, key, secret = sys.argv[1:6]
    options = {"endpoint_url": endpoint, "key": key, "secret": secret, "client_kwargs": {"region_name": "us-east-1"}}
    mgr = CheckpointManager(local, remote=url, storage_options=options, upload_part_bytes=5 << 20, upload_bytes_per_s=4e6)
    mgr.save(1, {"w": torch.arange(4 << 20, dtype=torch.float32)})
    while not (Path(local) / "step-0000000001" / "COMMIT").exists():
        time.sleep(0.01)
    print("committed", flush=True)
    time.sleep(60)
""")


def test_a_process_killed_while_uploading_restarts_the_upload_from_the_local_copy(tmp_path, s3_bucket):
    url, options = s3_bucket
    local = tmp_path / "local"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(local), url, options["endpoint_url"], options["key"], options["secret"]],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    try:
        assert child.stdout.readline().strip() == "committed"
        time.sleep(0.5)  # part of the 16 MB is on its way at 4 MB/s
    finally:
        child.kill()
        child.wait()
    remote = remote_of(s3_bucket)
    assert catalog.list_steps(remote).committed == []
    assert any(n.startswith("PIN.") for n in remote.list("step-0000000001"))  # the killed upload's
    with manager(local, s3_bucket, keep_remote=1) as mgr:
        mgr.wait()
        assert mgr.tiers() == {1: "local+remote"}
        assert not [n for n in remote.list("step-0000000001") if n.startswith("PIN.")]  # the killed upload's went at the start
        target = {"w": torch.zeros(4 << 20)}
        assert mgr.restore(target) == 1
        for step in (2, 3):  # unchanged bytes: step 1's data file stays, borrowed, after keep_remote retires step 1
            mgr.save(step, target).wait()
    # the killed upload's pin went with step 1's retirement: nothing on the tier claims a save in flight
    assert catalog.list_steps(remote).committed == [3]
    for s in catalog.list_steps(remote).incomplete:
        assert not [n for n in remote.list(naming.step_dir(s)) if n.startswith("PIN.")], s
    assert collect.collect(remote, dry_run=True, scan_committed=False).pinned == []
    target = {"w": torch.zeros(4 << 20)}
    with manager(tmp_path / "elsewhere", s3_bucket) as mgr:
        assert mgr.restore(target) == 3 and torch.equal(target["w"], torch.arange(4 << 20, dtype=torch.float32))


def test_a_damaged_local_copy_is_read_from_the_remote_tier(tmp_path, s3_bucket, caplog):
    local = tmp_path / "local"
    with manager(local, s3_bucket) as mgr:
        mgr.save(1, state(1)).wait()
    pack = next((local / "step-0000000001").glob("*.pack"))
    with open(pack, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    target = blank()
    with manager(local, s3_bucket) as mgr:
        assert mgr.restore(target) == 1 and same(target, state(1))
    assert any("are damaged" in r.getMessage() and "from the remote tier" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    manifest = next((local / "step-0000000001").glob("manifest.*.json"))
    manifest.write_bytes(manifest.read_bytes().replace(b'"world_size":1', b'"world_size":2'))
    caplog.clear()
    target = blank()
    with manager(local, s3_bucket) as mgr:
        assert mgr.restore(target) == 1 and same(target, state(1))
    assert any("manifest of step 1 from the remote tier" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- retention and conflicts


def test_retention_on_both_tiers_keeps_steps_waiting_for_their_upload(tmp_path, s3_bucket):
    with manager(tmp_path / "local", s3_bucket, keep_local=1, keep_remote=2) as mgr:
        gate = threading.Event()
        real = mgr.remote_storage.upload_file

        def gated(*args, **kwargs):
            assert gate.wait(30)
            return real(*args, **kwargs)

        mgr.remote_storage.upload_file = gated
        mgr.save(1, state(1))
        mgr.save(2, state(2))  # step 1 is committed locally, its upload is held at the gate
        deadline = time.monotonic() + 20
        while catalog.list_steps(mgr.storage).committed != [1, 2]:
            assert time.monotonic() < deadline, catalog.list_steps(mgr.storage)
            time.sleep(0.01)
        time.sleep(0.2)
        assert catalog.list_steps(mgr.storage).committed == [1, 2]  # keep_local=1, but 1 is not on the remote tier yet
        gate.set()
        mgr.wait()
        assert mgr.tiers() == {1: "remote", 2: "local+remote"}
        for s in (3, 4, 5):
            mgr.save(s, state(s)).wait()
        assert mgr.tiers() == {4: "remote", 5: "local+remote"}
    assert catalog.list_steps(remote_of(s3_bucket)).committed == [4, 5]


def test_the_conditional_commit_refuses_a_second_writer(tmp_path, s3_bucket):
    a = manager(tmp_path / "a", s3_bucket)
    b = manager(tmp_path / "b", s3_bucket)
    try:
        a.save(5, state(5)).wait()
        with pytest.raises(CheckpointUploadError, match="already committed .* by another writer"):
            b.save(5, state(50)).wait()
        with manager(tmp_path / "c", s3_bucket) as c, pytest.raises(CheckpointError, match="already committed"):
            c.save(5, state(6))  # a manager that sees step 5 on the remote tier refuses it in save()
        # both race for step 6: exactly one commits it
        results = {}

        def race(name, mgr, seed):
            try:
                mgr.save(6, state(seed)).wait()
                results[name] = "won"
            except CheckpointUploadError as exc:
                results[name] = str(exc)

        threads = [threading.Thread(target=race, args=(n, m, s)) for n, m, s in (("a", a, 60), ("b", b, 61))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert list(results.values()).count("won") == 1, results
        loser = next(v for v in results.values() if v != "won")
        assert "already committed" in loser and "another writer" in loser, loser
    finally:
        a.close()
        b.close()
    winner = 60 if results["a"] == "won" else 61
    target = blank()
    with manager(tmp_path / "d", s3_bucket) as mgr:
        assert mgr.restore(target) == 6 and same(target, {**state(winner), "step": winner})
        assert mgr.restore(target, step=5) == 5 and same(target, state(5))  # a's, not b's
    result = collect.collect(remote_of(s3_bucket), dry_run=True)
    assert not result.problems and len(result.garbage) == 4, result  # the loser's pack and manifest, for steps 5 and 6


# ----------------------------------------------------------------------------- several ranks


def _bucket_args(s3_bucket, tmp_path):
    url, options = s3_bucket
    return str(tmp_path / "nodes"), url, options


def test_node_failure_restores_the_lost_rank_from_object_storage(tmp_path, s3_bucket):
    base, url, options = _bucket_args(s3_bucket, tmp_path)
    ref = str(tmp_path / "ref.pt")
    saved = run_ranks(_tiered.save_remote, 2, base, url, options, ref, tmp=tmp_path)
    assert [s["tier"] for s in saved] == ["local+remote"] * 2 and all(s["ok"] for s in saved)
    manifest = catalog.load_manifest(remote_of(s3_bucket), 1)
    # replicated data went up once in total: the ranks uploaded exactly the primary prefixes
    assert sum(s["uploaded"] for s in saved) == sum(f.primary_bytes for f in manifest.files)
    assert sum(f.primary_bytes for f in manifest.files) < sum(f.nbytes for f in manifest.files)  # replicas stay local

    shutil.rmtree(Path(base) / "node1")  # node 1 is replaced by an empty machine
    lines = run_ranks(_tiered.restore_remote, 2, base, url, options, ref, tmp=tmp_path)
    assert "from the remote tier" not in lines[0], lines[0]  # rank 0 reads its local copy
    assert "from the remote tier" in lines[1] and str(Path(base) / "node1") not in lines[1], lines[1]

    shutil.rmtree(base)  # a brand-new cluster: everything comes from the bucket
    lines = run_ranks(_tiered.restore_remote, 2, base, url, options, ref, tmp=tmp_path)
    assert all("from the remote tier" in line for line in lines), lines


def test_an_upload_failing_on_one_rank_fails_the_step_remotely_on_every_rank(tmp_path, s3_bucket):
    base, url, options = _bucket_args(s3_bucket, tmp_path)
    results = run_ranks(_tiered.upload_fails_on_one_rank, 2, base, url, options, 1, tmp=tmp_path)
    for first, tier, tiers, third in results:
        assert "upload of step 1" in first and "rank 1:" in first and "AccessDenied" in first, first
        assert tier == "local+remote" and tiers == repr({1: "local", 2: "local+remote"})  # 1's verdict may be news yet
        assert third == repr({1: "remote", 2: "local+remote", 3: "local+remote"})  # keep_local=2 once 1 is durable
    assert assert_remote_whole(remote_of(s3_bucket)) == [1, 2, 3]  # step 1's upload went again before 3's, on every rank


def test_failed_uploads_are_tried_again_by_every_rank_alike(tmp_path, s3_bucket):
    """docs/design.md (retention, local): with several ranks a failed upload is tried again before each next save,
    the same on every rank, at most 3 times; later uploads stay in step across the ranks."""
    base, url, options = _bucket_args(s3_bucket, tmp_path)
    results = run_ranks(_tiered.uploads_tried_again, 2, base, url, options, tmp=tmp_path)
    assert results[0] == results[1]
    # an upload is tried again before the upload numbered two after it (every rank knows its verdict by then):
    # save 3 retries 1; save 4: 1, 2; save 5: 1, 2, 3; save 6 (no faults): 2, 3, 4 (1 was tried 3 times again, and
    # 5 failed too recently); save 7 (faults again): 5; save 8: 5 (7 was deleted)
    assert results[0]["failed"] == [1, 2, 3, 4, 5, 7]
    assert sorted(results[0]["again"]) == [1, 1, 1, 2, 2, 2, 3, 3, 4, 5, 5]
    assert results[0]["tiers"] == {1: "local", **{s: "local+remote" for s in (2, 3, 4, 5, 6, 8)}}
    # each rank's record of a save whose upload succeeded on a later try says so (ok, and the try)
    assert results[0]["records"] == {1: (False, 4), 2: (True, 4), 3: (True, 3), 4: (True, 2), 5: (True, 3), 6: (True, 1),
                                     7: (False, 1), 8: (True, 1)}
    assert assert_remote_whole(remote_of(s3_bucket)) == [2, 3, 4, 5, 6, 8]


def test_an_upload_whose_ranks_name_different_steps_is_never_committed(tmp_path, s3_bucket):
    base, url, options = _bucket_args(s3_bucket, tmp_path)
    results = run_ranks(_tiered.uploads_out_of_order, 2, base, url, options, tmp=tmp_path)
    for got in results:
        assert "UploadRanksFailed" in got and "rank 1: its upload #99 is step 2, rank 0's is step 1" in got, got
    assert catalog.list_steps(remote_of(s3_bucket)).committed == []


def test_injected_crash_is_not_a_storage_error():
    assert not isinstance(InjectedCrash("x"), OSError)  # so no layer retries it: it stands for a dead process


def test_large_remote_reads_are_parallel_ranged_gets(s3_bucket):
    from checkpointing.storage import FsspecStorage

    url, options = s3_bucket
    storage = FsspecStorage(url, options, part_bytes=5 * MiB, max_concurrency=4, retry=FAST)
    data = torch.randint(0, 256, (17 * MiB,), dtype=torch.uint8).numpy().tobytes()
    storage.put("big", data)
    proxy = inject(storage, latency_s=0.05)
    buf = bytearray(13 * MiB + 5)
    storage.read_into("big", 3 * MiB + 1, memoryview(buf))
    assert bytes(buf) == data[3 * MiB + 1 : 16 * MiB + 6]
    assert proxy.count("cat_file") == 3 and proxy.peak["cat_file"] == 3  # three part-sized ranges, at once
    with pytest.raises(EOFError):
        storage.read_into("big", 10 * MiB, memoryview(bytearray(8 * MiB)))


def test_the_demo_runs_with_an_embedded_s3_and_restores_a_lost_node(tmp_path):
    pytest.importorskip("moto.server")
    demo = Path(__file__).parent.parent / "examples" / "demo.py"
    r = subprocess.run([sys.executable, str(demo), "--dir", str(tmp_path / "ckpt"), "--steps", "20", "--every", "5"],
                       capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = " ".join(r.stdout.split())  # rich wraps long lines
    assert "lost node" in out and "model identical" in out and "AdamW state identical" in out, r.stdout[-2000:]
    assert "embedded S3 server stopped" in out


def test_ranks_resume_an_interrupted_upload_together(tmp_path, s3_bucket):
    base, url, options = _bucket_args(s3_bucket, tmp_path)
    crashed = run_ranks(_tiered.crash_then_resume, 2, base, url, options, "crash", tmp=tmp_path)
    assert all("InjectedCrash" in c and "rank 0" in c for c in crashed), crashed
    assert catalog.list_steps(remote_of(s3_bucket)).incomplete == [1]
    assert run_ranks(_tiered.crash_then_resume, 2, base, url, options, "resume", tmp=tmp_path) == [{1: "local+remote"}] * 2
    assert assert_remote_whole(remote_of(s3_bucket)) == [1]


def test_a_restart_with_a_node_added_resumes_the_upload_and_restores_the_step_it_finishes(tmp_path, s3_bucket):
    """Two nodes save step 1 and die before its remote COMMIT; three ranks restart (node 2 new and empty):
    the old nodes send their files, the new rank takes part in the commit, and every rank restores step 1
    (the new rank from the remote tier, once the resumed upload finished)."""
    base, url, options = _bucket_args(s3_bucket, tmp_path)
    crashed = run_ranks(_tiered.crash_before_remote_commit, 2, base, url, options, False, tmp=tmp_path)
    assert all("InjectedCrash" in c for c in crashed), crashed
    out = run_ranks(_tiered.restart_and_restore, 3, base, url, options, tmp=tmp_path)
    assert [step for step, _ in out] == [1, 1, 1] and out[2][1] == {1: "remote"}, out
    assert assert_remote_whole(remote_of(s3_bucket)) == [1]


@pytest.mark.parametrize("shared", [True, False], ids=["one-node", "two-nodes"])
def test_a_restart_on_fewer_ranks_resumes_the_upload_when_it_holds_every_file(tmp_path, s3_bucket, shared, caplog):
    """Two ranks save step 1 and die before its remote COMMIT; one process restarts. On one node (a
    shared local tier) it holds both ranks' files and uploads them all; with the other node lost it
    cannot, says so, and the step stays local."""
    base, url, options = _bucket_args(s3_bucket, tmp_path)
    crashed = run_ranks(_tiered.crash_before_remote_commit, 2, base, url, options, shared, tmp=tmp_path)
    assert all("InjectedCrash" in c for c in crashed), crashed
    assert catalog.list_steps(remote_of(s3_bucket)).incomplete == [1]
    with caplog.at_level(logging.INFO, logger="checkpointing"):
        with CheckpointManager(f"{base}/node0", remote=url, storage_options=options) as mgr:
            mgr.wait()
            tiers = mgr.tiers()
    if shared:
        assert tiers == {1: "local+remote"} and assert_remote_whole(remote_of(s3_bucket)) == [1]
        tree = checkpointing.load(url, storage_options=options, keys=["w", "x"], rank=1)
        assert torch.equal(tree["w"], torch.arange(1 << 16, dtype=torch.float32)) and torch.equal(tree["x"], torch.full((1 << 18,), 1.0))
    else:
        assert tiers == {1: "local"} and catalog.list_steps(remote_of(s3_bucket)).committed == []
        assert "its upload cannot resume: no rank of this job holds 1 of its files" in caplog.text


def test_close_stops_the_remote_tiers_own_io_threads(tmp_path, s3_bucket):
    """A job that opens a manager per phase (the frameworks' plugins do) must not gather threads."""
    url, options = s3_bucket
    before = set(threading.enumerate())
    for i in range(3):
        with CheckpointManager(tmp_path / f"local{i}", remote=f"{url}/run{i}", storage_options=options) as mgr:
            mgr.save(1, {"w": torch.randn(1000)}).result(120)
    left = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("ckpt-")]
    assert left == [], left
    with CheckpointManager(tmp_path / "local0", read_only=True, remote=f"{url}/run0", storage_options=options) as mgr:
        assert mgr.steps() == [1]  # a later manager on the same tiers reads them


@pytest.mark.parametrize("refused, committed, left, says", [
    ("*step-0000000001*", [1, 5, 6], ["step-0000000001", "step-0000000005", "step-0000000006"], "delete step 1 "),
    ("*step-0000000001/*.pack*", [5, 6], ["step-0000000001", "step-0000000005", "step-0000000006"],
     "delete the files of retired step 1 "),
], ids=["its-commit", "its-pack-file"])
def test_a_step_retention_cannot_delete_holds_back_no_other(tmp_path, s3_bucket, caplog, refused, committed, left, says):
    """keep_remote=2 while the bucket refuses to delete step 1 (a retention lock, a policy), or only its pack file: the
    other steps are retired and their files removed as usual, and one warning names step 1. Every later step used to
    be kept (its COMMIT refused), or every later retired step's files (its pack refused): the bucket grew without bound."""
    remote = remote_of(s3_bucket)
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        with manager(tmp_path / "local", s3_bucket, keep_remote=2, keep_local=1) as mgr:
            mgr.save(1, state(1)).wait()
            inject(mgr.remote_storage, Fault("delete_objects", "denied", times=-1, path=refused))
            for step in range(2, 7):
                mgr.save(step, state(step)).wait()
            mgr.wait()
    assert catalog.list_steps(remote).committed == committed
    assert [name for name in remote.list("") if name.startswith("step-")] == left
    warned = [r.getMessage() for r in caplog.records if f"retention could not {says}" in r.getMessage()]
    assert len(warned) == 1 and ("checkpointing rm" in warned[0] or "gc" in warned[0]), warned


def test_a_directory_named_metrics_jsonl_costs_the_metrics_not_the_uploads(tmp_path, s3_bucket):
    """The upload thread copies metrics.jsonl to the remote tier after each upload: a directory of that name (a stray
    mkdir) used to end that thread with IsADirectoryError, and every later save and wait() hung."""
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "metrics.jsonl").mkdir()
    with manager(tmp_path / "local", s3_bucket) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, state(step)).wait().ok
        mgr.wait()
        assert mgr.tiers() == {1: "remote", 2: "local+remote", 3: "local+remote"}
    assert assert_remote_whole(remote_of(s3_bucket)) == [1, 2, 3]


def test_the_requests_of_an_upload_do_not_grow_with_the_steps_the_remote_tier_holds(tmp_path, s3_bucket):
    """keep_remote=None keeps every step: an upload then lists no step directory (the sweep for a failed upload's
    files runs after a failure, and first of all); the listing per save stayed N+1 requests at step N."""
    listed = []
    with manager(tmp_path / "local", s3_bucket, keep_local=2) as mgr:
        proxy = inject(mgr.remote_storage)
        for step in range(1, 13):
            before = proxy.count("list_objects_v2")
            mgr.save(step, state(step, n=1 << 10)).wait()
            listed.append(proxy.count("list_objects_v2") - before)
    assert max(listed[3:]) <= max(listed[:3]), listed  # the first upload sweeps; later ones list no more than it
    assert max(listed[6:]) == max(listed[3:6]), listed
    remote = remote_of(s3_bucket)
    proxy = inject(remote)
    assert catalog.list_steps(remote).committed == list(range(1, 13))
    assert proxy.count("list_objects_v2") == 1  # every key at once, not a listing per step directory
    assert_remote_whole(remote)


def test_a_given_up_uploads_files_are_swept_from_the_remote_tier_by_a_later_upload(tmp_path, s3_bucket):
    """Step 2's files land on the remote tier and its COMMIT is refused, at every try: once it is given up (tried 1+3
    times), a later upload's sweep removes them (they stayed for the rest of the run)."""
    logging.getLogger("checkpointing").setLevel(logging.CRITICAL)
    try:
        with manager(tmp_path / "local", s3_bucket, keep_local=2) as mgr:
            inject(mgr.remote_storage, Fault("put_object", "denied", times=-1, path=f"*{naming.step_dir(2)}/COMMIT"))
            for step in range(1, 13):
                try:
                    mgr.save(step, state(step, n=1 << 10)).wait()
                except CheckpointUploadError:
                    pass  # step 2's upload, and its tries again
    finally:
        logging.getLogger("checkpointing").setLevel(logging.NOTSET)
    remote = remote_of(s3_bucket)
    assert catalog.list_steps(remote).committed == [1] + list(range(3, 13))
    assert remote.list(naming.step_dir(2)) == []
