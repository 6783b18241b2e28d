"""The Storage contract (checkpointing/storage/base.py), run against every backend.

Adding a backend = adding one entry to BACKENDS: a function (tmp_path, monkeypatch, addfinalizer) -> Storage.
The catalog tests at the bottom run over every backend too.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from checkpointing.tier import catalog
from checkpointing.tier import collect
from checkpointing.format import naming
from checkpointing.errors import CheckpointCorruptError, CheckpointNotFoundError, ManifestError
from checkpointing.format.manifest import ChunkRef, CommitMarker, Manifest, ShardEntry, TensorEntry, encode_commit, encode_manifest, manifest_digest
from checkpointing.storage import FsspecStorage, LocalStorage, RetryPolicy, Storage

SHM = Path("/dev/shm")


def _local_direct(tmp_path, monkeypatch, addfinalizer):
    return LocalStorage(tmp_path / "root", direct=True)


def _local_buffered(tmp_path, monkeypatch, addfinalizer):
    return LocalStorage(tmp_path / "root", direct=False)


def _local_shm(tmp_path, monkeypatch, addfinalizer):
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("no writable /dev/shm")
    root = SHM / f"ckpt-contract-{uuid.uuid4().hex}"
    addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    return LocalStorage(root, direct=True)


def _refuse_o_direct(monkeypatch, err: int, text: str) -> None:
    """Make opening with O_DIRECT fail with `err`, as a filesystem that does not support it would."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(err, text, str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def _local_direct_refused(tmp_path, monkeypatch, addfinalizer):
    """A filesystem that refuses O_DIRECT with EINVAL (older tmpfs, some network filesystems)."""
    _refuse_o_direct(monkeypatch, errno.EINVAL, "Invalid argument (O_DIRECT refused)")
    return LocalStorage(tmp_path / "root", direct=True)


def _memory(tmp_path, monkeypatch, addfinalizer):
    """fsspec's in-process memory filesystem, a unique root per test (its store is global)."""
    s = FsspecStorage(f"memory://ckpt-contract-{uuid.uuid4().hex}/root")
    addfinalizer(lambda: s.delete(""))
    return s


def _file_fsspec(tmp_path, monkeypatch, addfinalizer):
    """A local directory through FsspecStorage (file://), not LocalStorage."""
    return FsspecStorage(f"file://{tmp_path}/root")


def _s3(tmp_path, monkeypatch, addfinalizer):
    """A fresh bucket on the session's moto server (127.0.0.1). Multipart streams: tests/test_remote_storage.py."""
    import s3_server

    url, options = s3_server.new_bucket()
    s = FsspecStorage(url, options, part_bytes=5 << 20, retry=RetryPolicy(attempts=3, base_s=0.01, cap_s=0.05))
    addfinalizer(s.close)
    return s


BACKENDS: dict[str, Callable] = {
    "local-direct": _local_direct,
    "local-buffered": _local_buffered,
    "local-shm": _local_shm,
    "local-direct-refused": _local_direct_refused,
    "memory": _memory,
    "file-fsspec": _file_fsspec,
    "s3": _s3,
}


@pytest.fixture(params=list(BACKENDS))
def storage(request, tmp_path, monkeypatch) -> Storage:
    return BACKENDS[request.param](tmp_path, monkeypatch, request.addfinalizer)


def all_names(storage: Storage, prefix: str = "") -> list[str]:
    """Every object below `prefix`, recursively (via list only)."""
    out = []
    for name in storage.list(prefix):
        path = f"{prefix}/{name}" if prefix else name
        children = storage.list(path)
        out.append(path)
        out.extend(all_names(storage, path) if children else [])
    return out


def no_temporaries(storage: Storage) -> None:
    leftovers = [n for n in all_names(storage) if ".tmp-" in n]
    assert not leftovers, leftovers


def aligned_buffer(data: bytes, align: int) -> tuple[mmap.mmap, memoryview]:
    """`data` zero-padded to a multiple of `align`, in page-aligned memory (O_DIRECT needs both)."""
    n = max(align, -(-len(data) // align) * align)
    buf = mmap.mmap(-1, n)
    buf[: len(data)] = data
    return buf, memoryview(buf)


PAYLOAD = bytes(range(256)) * 41 + b"tail"  # 10500 bytes: not a multiple of anything useful


# ---------------------------------------------------------------- put / get


class TestContract:
    def test_put_get_roundtrip(self, storage):
        storage.put("a.bin", PAYLOAD)
        assert storage.get("a.bin") == PAYLOAD
        assert storage.size("a.bin") == len(PAYLOAD)
        storage.put("dir/sub/b.bin", b"")
        assert storage.get("dir/sub/b.bin") == b""
        assert storage.size("dir/sub/b.bin") == 0
        storage.put("m.bin", memoryview(PAYLOAD)[10:20])
        assert storage.get("m.bin") == PAYLOAD[10:20]
        no_temporaries(storage)

    def test_put_overwrites(self, storage):
        storage.put("x/a", b"first version, longer")
        storage.put("x/a", b"second")
        assert storage.get("x/a") == b"second"
        assert storage.list("x") == ["a"]
        no_temporaries(storage)

    def test_put_overwrite_is_atomic_for_readers(self, storage):
        """A reader sees the old or the new object, never a mix or a partial one."""
        old, new = b"A" * 300_000, b"B" * 200_000
        storage.put("obj", old)
        stop = threading.Event()
        errors: list[BaseException] = []

        def writer():
            try:
                for i in range(30):
                    storage.put("obj", new if i % 2 == 0 else old)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            finally:
                stop.set()

        t = threading.Thread(target=writer)
        t.start()
        seen = set()
        while not stop.is_set():
            got = storage.get("obj")
            assert got in (old, new), (len(got), got[:1], got[-1:])
            seen.add(got[:1])
        t.join()
        assert not errors, errors
        assert storage.get("obj") == old
        no_temporaries(storage)

    def test_exclusive_put(self, storage):
        storage.put("s/COMMIT", b"one", exclusive=True)
        with pytest.raises(FileExistsError):
            storage.put("s/COMMIT", b"two", exclusive=True)
        assert storage.get("s/COMMIT") == b"one"
        no_temporaries(storage)
        storage.put("s/COMMIT", b"three")  # a non-exclusive put may replace it
        assert storage.get("s/COMMIT") == b"three"

    def test_exclusive_put_races_have_one_winner(self, storage):
        results: list[str] = []
        barrier = threading.Barrier(8)

        def attempt(i):
            barrier.wait()
            try:
                storage.put("race/COMMIT", f"writer {i}".encode(), exclusive=True)
                results.append(f"won {i}")
            except FileExistsError:
                results.append("lost")

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [r for r in results if r.startswith("won")]
        assert len(results) == 8 and len(winners) == 1
        assert storage.get("race/COMMIT") == f"writer {winners[0].split()[1]}".encode()
        no_temporaries(storage)

    def test_missing_objects(self, storage):
        with pytest.raises(FileNotFoundError):
            storage.get("nope")
        with pytest.raises(FileNotFoundError):
            storage.get("no/such/dir/file")
        with pytest.raises(FileNotFoundError):
            storage.read_into("nope", 0, memoryview(bytearray(4)))
        with pytest.raises(FileNotFoundError):
            storage.size("nope")

    def test_paths_below_a_file_are_missing(self, storage):
        """'missing objects raise FileNotFoundError' holds when a parent is a file, too; delete stays a no-op."""
        storage.put("f", b"file")
        with pytest.raises(FileNotFoundError):
            storage.get("f/x")
        with pytest.raises(FileNotFoundError):
            storage.size("f/x")
        with pytest.raises(FileNotFoundError):
            storage.read_into("f/x", 0, memoryview(bytearray(1)))
        assert storage.list("f") == []
        storage.delete("f/x")
        assert storage.get("f") == b"file"

    def test_mtime(self, storage):
        """When an object last changed, as the store records it (object stores: to the second)."""
        before = time.time()
        storage.put("d/a", PAYLOAD)
        after = time.time()
        first = storage.mtime("d/a")
        assert before - 2 <= first <= after + 2, (before, first, after)
        storage.put("d/a", b"changed")
        assert first <= storage.mtime("d/a") <= time.time() + 2
        with pytest.raises(FileNotFoundError):
            storage.mtime("nope")
        with pytest.raises(FileNotFoundError):
            storage.mtime("d/a/below")  # below a file: missing too

    def test_exists_with_size(self, storage):
        """True only for an object of exactly that size (what a resumed upload skips)."""
        storage.put("d/a", PAYLOAD)
        storage.put("d/empty", b"")
        assert storage.exists_with_size("d/a", len(PAYLOAD))
        assert not storage.exists_with_size("d/a", len(PAYLOAD) - 1)
        assert not storage.exists_with_size("d/a", len(PAYLOAD) + 1)
        assert storage.exists_with_size("d/empty", 0)
        assert not storage.exists_with_size("d/empty", 1)
        assert not storage.exists_with_size("nope", 0)
        assert not storage.exists_with_size("d/a/below", 0)
        storage.delete("d/a")
        assert not storage.exists_with_size("d/a", len(PAYLOAD))

    def test_sizes_of_many_objects(self, storage):
        """Storage.sizes: each object's size, None where missing, in directories listed whole
        (object stores) or not, a directory named like an object, nested and root objects."""
        want = {f"step-0000000003/r{r:05d}.pack": r * 7 for r in range(12)}
        want.update({f"step-0000000001/r{r:05d}.pack": 100 + r for r in range(5)})
        want.update({"top": 3, "step-0000000003/sub/deep": 9})
        for path, n in want.items():
            storage.put(path, b"x" * n)
        asked = [*want, "step-0000000003/r99999.pack", "step-0000000003/sub", "missing/dir/x", "nope", "top/below"]
        assert storage.sizes(asked) == {**want, "step-0000000003/r99999.pack": None, "step-0000000003/sub": None,
                                        "missing/dir/x": None, "nope": None, "top/below": None}
        assert storage.sizes([]) == {}

    def test_read_into_ranges(self, storage):
        storage.put("d/f", PAYLOAD)
        for offset, n in [(0, len(PAYLOAD)), (0, 1), (100, 4096), (len(PAYLOAD) - 7, 7), (5000, 0)]:
            buf = bytearray(n)
            storage.read_into("d/f", offset, memoryview(buf))
            assert bytes(buf) == PAYLOAD[offset : offset + n]
        # into a slice of a larger buffer: bytes around it are untouched
        big = bytearray(b"\xee" * 100)
        storage.read_into("d/f", 10, memoryview(big)[30:40])
        assert big[:30] == b"\xee" * 30 and big[30:40] == PAYLOAD[10:20] and big[40:] == b"\xee" * 60

    @pytest.mark.parametrize("offset, n", [(0, len(PAYLOAD) + 1), (len(PAYLOAD) - 3, 4), (len(PAYLOAD), 1), (len(PAYLOAD) + 100, 8)])
    def test_read_past_end(self, storage, offset, n):
        storage.put("f", PAYLOAD)
        with pytest.raises(EOFError):
            storage.read_into("f", offset, memoryview(bytearray(n)))

    def test_list(self, storage):
        assert storage.list("") == []
        storage.put("step-0000000002/b", b"1")
        storage.put("step-0000000002/a", b"1")
        storage.put("step-0000000001/x/y", b"1")
        storage.put("top", b"1")
        assert storage.list("") == ["step-0000000001", "step-0000000002", "top"]
        assert storage.list("step-0000000002") == ["a", "b"]
        assert storage.list("step-0000000001") == ["x"]
        assert storage.list("step-0000000001/x") == ["y"]
        assert storage.list("missing") == []
        assert storage.list("missing/deeper") == []

    def test_delete(self, storage):
        storage.put("d/one", b"1")
        storage.put("d/two/three", b"3")
        storage.put("keep", b"k")
        storage.delete("d/one")
        assert storage.list("d") == ["two"]
        with pytest.raises(FileNotFoundError):
            storage.get("d/one")
        storage.delete("d")  # a directory goes with everything in it
        assert storage.list("") == ["keep"]
        with pytest.raises(FileNotFoundError):
            storage.get("d/two/three")
        storage.delete("d")  # missing: no-op
        storage.delete("never/was/here")
        assert storage.get("keep") == b"k"

    def test_remove_dir_removes_only_what_is_empty(self, storage):
        """gc removes a step directory with remove_dir: never what a writer created in it meanwhile."""
        storage.put("d/one", b"1")
        storage.remove_dir("d")  # not empty: stays
        assert storage.get("d/one") == b"1"
        storage.delete("d/one")
        storage.remove_dir("d")
        assert "d" not in storage.list("")
        storage.put("d/two", b"2")  # a writer can create it again
        assert storage.list("d") == ["two"]
        storage.put("stray", b"s")
        storage.remove_dir("stray")  # a plain object of that name goes too
        assert "stray" not in storage.list("")
        storage.remove_dir("missing")  # missing: no-op
        assert storage.list("") == ["d"]

    # ------------------------------------------------------------ streams

    @pytest.mark.parametrize("length", [0, 1, 4095, 4096, 4097, 3 * 4096 + 123])
    def test_stream_aligned_writes_then_a_short_last_write(self, storage, length):
        data = os.urandom(length)
        w = storage.open_stream("step-0000000001/r00000.abc.pack")
        align = w.alignment
        assert align >= 1 and (align & (align - 1)) == 0
        buf, view = aligned_buffer(data, max(align, 4096))
        block = 2 * max(align, 4096)
        pos = 0
        while pos < length:  # full aligned blocks, then the short tail as it is
            n = min(block, length - pos)
            w.write(view[pos : pos + n])
            pos += n
        w.close()
        view.release()
        buf.close()
        assert storage.get("step-0000000001/r00000.abc.pack") == data
        assert storage.size("step-0000000001/r00000.abc.pack") == length
        assert storage.list("step-0000000001") == ["r00000.abc.pack"]

    def test_stream_abort_removes_the_file(self, storage):
        w = storage.open_stream("s/p.pack")
        buf, view = aligned_buffer(b"x" * 8192, max(w.alignment, 4096))
        w.write(view[:4096])
        w.abort()
        view.release()
        buf.close()
        with pytest.raises(FileNotFoundError):
            storage.get("s/p.pack")
        assert "p.pack" not in storage.list("s")
        w.abort()  # twice: harmless

    def test_stream_abort_keeps_other_objects(self, storage):
        storage.put("s/other", b"o")
        w = storage.open_stream("s/p.pack")
        w.abort()
        assert storage.list("s") == ["other"]

    def test_stream_and_puts_leave_no_temporaries(self, storage):
        for i in range(5):
            storage.put(f"step-000000000{i}/manifest.t.json", b"{}")
            storage.put(f"step-000000000{i}/COMMIT", b"c", exclusive=True)
        no_temporaries(storage)


def test_shm_backend_streams_with_or_without_o_direct(tmp_path, monkeypatch, request):
    """tmpfs may or may not accept O_DIRECT (Linux >= 6.6 does); either way the stream works."""
    s = _local_shm(tmp_path, monkeypatch, request.addfinalizer)
    w = s.open_stream("p")
    assert w.alignment in (1, 4096)
    w.abort()


def test_refused_o_direct_falls_back_to_buffered(tmp_path, monkeypatch, request):
    s = _local_direct_refused(tmp_path, monkeypatch, request.addfinalizer)
    w = s.open_stream("p")
    assert w.alignment == 1
    w.write(memoryview(b"abc"))
    w.close()
    assert s.get("p") == b"abc"


def test_other_o_direct_errors_are_not_swallowed(tmp_path, monkeypatch):
    _refuse_o_direct(monkeypatch, errno.EACCES, "Permission denied")
    s = LocalStorage(tmp_path, direct=True)
    with pytest.raises(PermissionError):
        s.open_stream("p")


def test_failed_put_leaves_no_temporary(tmp_path, monkeypatch):
    s = LocalStorage(tmp_path, direct=False)

    def boom(src, dst, **kwargs):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        s.put("d/a", b"data")
    assert s.list("d") == []


# ---------------------------------------------------------------- catalog (end to end over each backend)


def make_manifest(step: int, token: str = "tok") -> Manifest:
    pack = naming.pack_name(step, 0, token)
    tree = {"dict": [["w", {"tensor": 0}], ["step", {"value": step}]]}
    tensors = (TensorEntry("w", "float32", (4,), (ShardEntry((0,), (4,), (ChunkRef(pack, 0, 16, "xxh3-128:" + "1" * 32),)),)),)
    return Manifest.single(step, tree, tensors)


def commit_step(storage, step: int, token: str = "tok") -> Manifest:
    m = make_manifest(step, token)
    storage.put(naming.pack_name(step, 0, token), b"\0" * 16)
    catalog.commit(storage, m, token)
    return m


class TestCatalog:
    def test_commit_list_load(self, storage):
        assert catalog.list_steps(storage) == catalog.StepListing([], [])
        m5 = commit_step(storage, 5)
        m12 = commit_step(storage, 12)
        storage.put("metrics.jsonl", b"{}\n")  # not a step: ignored
        storage.put("step-junk/x", b"")  # not a step: ignored
        listing = catalog.list_steps(storage)
        assert listing.committed == [5, 12] and listing.incomplete == []
        assert catalog.load_manifest(storage, 5) == m5
        assert catalog.load_manifest(storage, 12) == m12
        names = storage.list(naming.step_dir(12))
        assert sorted(names) == sorted(["COMMIT", "manifest.tok.json", "r00000.tok.pack"])
        marker = catalog.read_commit(storage, 12)
        assert marker.manifest == naming.manifest_name(12, "tok")
        assert marker.manifest_digest == manifest_digest(storage.get(marker.manifest))
        no_temporaries(storage)

    def test_a_step_commits_once(self, storage):
        commit_step(storage, 3, "first")
        with pytest.raises(FileExistsError):
            commit_step(storage, 3, "second")
        assert catalog.load_manifest(storage, 3) == make_manifest(3, "first")

    def test_a_step_committed_again_reads_its_new_manifest(self, storage):
        """Manifests are kept decoded by the digest their COMMIT names, never by step: a step deleted and
        committed again with other content reads back the new content."""
        first = commit_step(storage, 6, "first")
        assert catalog.load_manifest(storage, 6) == first
        collect.delete_step(storage, 6)
        second = commit_step(storage, 6, "second")
        assert second != first and catalog.load_manifest(storage, 6) == second

    def test_step_without_commit_is_incomplete(self, storage):
        commit_step(storage, 1)
        storage.put(naming.pack_name(2, 0, "crashed"), b"partial")  # a save that died before its manifest
        storage.put(naming.manifest_name(3, "crashed"), encode_manifest(make_manifest(3)))  # ... before COMMIT
        listing = catalog.list_steps(storage)
        assert listing.committed == [1] and listing.incomplete == [2, 3]
        for step in (2, 3, 99):
            with pytest.raises(CheckpointNotFoundError):
                catalog.load_manifest(storage, step)

    def test_stray_file_named_like_a_step(self, storage):
        """A file (not a directory) named step-NNNNNNNNNN is a user's, not a step: listed as none, never collected
        (CheckpointManager.__init__ removes incomplete steps: it used to delete such a file); a step directory
        that an object of its own name sits beside (object stores) is a step still."""
        commit_step(storage, 1)
        storage.put(naming.step_dir(5), b"stray")
        assert catalog.list_steps(storage) == catalog.StepListing([1], [])
        with pytest.raises(CheckpointNotFoundError):
            catalog.load_manifest(storage, 5)
        collect.delete_step(storage, 5)
        collect.collect(storage)
        assert storage.get(naming.step_dir(5)) == b"stray"
        if storage.url.startswith("s3://"):
            storage.put(f"{naming.step_dir(5)}/manifest.0123456789ab.json", b"{}")  # a retired step's leftover
            assert catalog.list_steps(storage) == catalog.StepListing([1], [5])
            collect.collect(storage)
            assert storage.list(naming.step_dir(5)) == [] and storage.get(naming.step_dir(5)) == b"stray"

    def test_delete_step_removes_commit_first(self, storage):
        commit_step(storage, 1)
        commit_step(storage, 2)
        # a crash right after delete_step's first operation: only COMMIT is gone
        storage.delete(naming.commit_name(1))
        listing = catalog.list_steps(storage)
        assert listing.committed == [2] and listing.incomplete == [1]
        with pytest.raises(CheckpointNotFoundError):
            catalog.load_manifest(storage, 1)
        collect.delete_step(storage, 1)  # finishing the interrupted delete works
        collect.delete_step(storage, 2)
        assert catalog.list_steps(storage) == catalog.StepListing([], [])
        assert storage.list("") == []
        collect.delete_step(storage, 7)  # deleting a step that is not there: no-op

    def test_delete_step_order_is_commit_then_manifest_then_data(self, storage, monkeypatch):
        commit_step(storage, 4)
        calls = []
        real = storage.delete
        real_rmdir = storage.remove_dir
        monkeypatch.setattr(storage, "delete", lambda p: (calls.append(p), real(p))[1])
        monkeypatch.setattr(storage, "remove_dir", lambda p: (calls.append(("rmdir", p)), real_rmdir(p))[1])
        collect.delete_step(storage, 4)
        sdir = naming.step_dir(4)
        assert calls[0] == f"{sdir}/COMMIT"
        assert calls[1] == f"{sdir}/manifest.tok.json"
        assert all(c.endswith(".pack") for c in calls[2:-1]) and len(calls) > 3
        assert calls[-1] == ("rmdir", sdir)

    def test_damaged_manifest_is_corrupt(self, storage):
        commit_step(storage, 8)
        path = naming.manifest_name(8, "tok")
        data = bytearray(storage.get(path))
        data[data.index(b'"step":8')+7] = ord("9")  # still valid JSON, different bytes
        storage.put(path, bytes(data))
        with pytest.raises(CheckpointCorruptError, match="damaged"):
            catalog.load_manifest(storage, 8)
        storage.put(path, b"")
        with pytest.raises(CheckpointCorruptError):
            catalog.load_manifest(storage, 8)
        storage.delete(path)
        with pytest.raises(CheckpointCorruptError, match="missing"):
            catalog.load_manifest(storage, 8)

    def test_damaged_commit_marker(self, storage):
        commit_step(storage, 9)
        storage.put(naming.commit_name(9), b"\x00garbage")
        with pytest.raises(ManifestError) as info:
            catalog.load_manifest(storage, 9)
        assert naming.commit_name(9) in str(info.value)

    def test_commit_marker_naming_another_step_or_outside_its_directory(self, storage):
        m = commit_step(storage, 10)
        good = catalog.read_commit(storage, 10)
        # a COMMIT copied from step 10 into step 11
        storage.put(naming.commit_name(11), storage.get(naming.commit_name(10)))
        with pytest.raises(ManifestError, match="names step 10"):
            catalog.load_manifest(storage, 11)
        # a COMMIT of step 12 pointing at step 10's (valid) manifest
        storage.put(naming.commit_name(12), encode_commit(CommitMarker(12, good.manifest, good.manifest_digest)))
        with pytest.raises(ManifestError, match="outside its step directory"):
            catalog.load_manifest(storage, 12)
        # a manifest for another step committed under this one
        data = storage.get(good.manifest)
        storage.put(naming.manifest_name(13, "tok"), data)
        storage.put(naming.commit_name(13), encode_commit(CommitMarker(13, naming.manifest_name(13, "tok"), manifest_digest(data))))
        with pytest.raises(ManifestError, match="expected 13"):
            catalog.load_manifest(storage, 13)
        assert catalog.load_manifest(storage, 10) == m

    def test_apply_retention(self, storage):
        for step in (1, 2, 3, 4, 5):
            commit_step(storage, step)
        assert collect.apply_retention(storage, None) == []
        assert collect.apply_retention(storage, 2, protect=1) == [2, 3]
        assert catalog.list_steps(storage).committed == [1, 4, 5]
        assert collect.apply_retention(storage, 1) == [1, 4]
        assert catalog.list_steps(storage) == catalog.StepListing([5], [])


def test_a_new_root_is_made_durable_in_its_parent_before_anything_is_created_in_it(tmp_path, monkeypatch):
    """format.md, "Write order", 0: the root and each missing parent, mkdir then fsync of its parent."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    LocalStorage(tmp_path / "a" / "b" / "ck")
    assert synced[:3] == [str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b")]
    synced.clear()
    LocalStorage(tmp_path / "x", fsync=False)
    assert synced == [] and (tmp_path / "x").is_dir()


def test_gc_removes_a_killed_puts_temporaries_at_the_root_and_nothing_else(tmp_path):
    import torch

    from checkpointing import CheckpointManager, load

    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
    left = ["metrics.jsonl.tmp-0123456789ab", "TIER.tmp-aaaaaaaaaaaa"]
    for name in left + ["metrics.jsonl.tmp-cccccccccccc"]:
        (tmp_path / "ck" / name).write_bytes(b"partial")
    for name in left:  # a killed process's, two hours ago; the third is a put in flight now in another process
        os.utime(tmp_path / "ck" / name, (time.time() - 7200, time.time() - 7200))
    mine = ["notes.txt", "metrics.jsonl.tmp-xyz", "model.tmp-0123456789abc", "notes.tmp-0123456789ab"]  # the user's
    for name in mine:
        (tmp_path / "ck" / name).write_bytes(b"keep")
    for name in ("eval.tmp-0123456789ab", "metrics.jsonl.tmp-0123456789ac"):  # directories: never a put's temporary
        (tmp_path / "ck" / name).mkdir()
        (tmp_path / "ck" / name / "scores.json").write_text("{}")
        mine.append(name)
    storage = LocalStorage(tmp_path / "ck")
    assert {g.path for g in collect.collect(storage, min_age_s=3 * 3600).garbage} == set()  # younger than min_age_s
    assert {g.path for g in collect.collect(storage).garbage} == set(left)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name in left + mine) == sorted(mine)
    assert (tmp_path / "ck" / "metrics.jsonl.tmp-cccccccccccc").exists()
    assert load(tmp_path / "ck")["w"].sum() == 4
