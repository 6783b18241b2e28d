"""FsspecStorage beyond the shared contract: retries, permanent errors, multipart uploads, conditional
create, credential redaction, pacing. S3 tests run against a real moto server on 127.0.0.1
(tests/s3_server.py); failures are injected by wrapping the real filesystem (tests/faults.py).
The storage contract itself runs on memory://, file:// and S3 in tests/test_storage_contract.py.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid

import pytest
from faults import Fault, InjectedCrash, inject
from s3_server import KEY, SECRET, client, new_bucket, s3_bucket, s3_endpoint, storage_options  # noqa: F401 - fixtures

from checkpointing.errors import CheckpointConfigError, CheckpointError
from checkpointing.storage import FsspecStorage, LocalStorage, RemoteStorageError, RetryPolicy, open_storage
from checkpointing.storage.redact import redact_url, secret_values
from checkpointing.storage.retry import HINT_BUCKET, HINT_CREDENTIALS, ErrorKind, classify, retry_call

MiB = 1 << 20
FAST = RetryPolicy(attempts=4, base_s=0.001, cap_s=0.005)


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def _s3fs_error(code: str, status: int):
    from s3fs.errors import translate_boto_error

    return translate_boto_error(_client_error(code, status))


def s3_storage(bucket: tuple[str, dict], **kwargs) -> FsspecStorage:
    url, options = bucket
    kwargs.setdefault("retry", FAST)
    kwargs.setdefault("part_bytes", 5 * MiB)
    return FsspecStorage(url, options, **kwargs)


def pending_uploads(url: str) -> list:
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    return client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def stream_bytes(storage, path: str, data: bytes, piece: int = 3 * MiB + 17, *, abort_on_error: bool = True) -> None:
    """Write `data` through a stream in odd-sized pieces; on an error abort it, as the pack writer does
    (a crashed process aborts nothing: abort_on_error=False)."""
    w = storage.open_stream(path)
    view = memoryview(data)
    try:
        for i in range(0, len(data), piece):
            w.write(view[i : i + piece])
        w.close()
    except Exception:
        if abort_on_error:
            w.abort()
        raise


# ---------------------------------------------------------------- classification and backoff (pure)


class TestClassify:
    @pytest.mark.parametrize(
        "code, status, kind",
        [
            ("SlowDown", 503, ErrorKind.TRANSIENT),
            ("InternalError", 500, ErrorKind.TRANSIENT),
            ("RequestTimeout", 400, ErrorKind.TRANSIENT),  # the code decides over the status
            ("ConditionalRequestConflict", 409, ErrorKind.TRANSIENT),
            ("Whatever", 502, ErrorKind.TRANSIENT),
            ("Throttling", 400, ErrorKind.TRANSIENT),
            ("NoSuchKey", 404, ErrorKind.MISSING),
            ("404", 404, ErrorKind.MISSING),  # HEAD responses carry no body
            ("PreconditionFailed", 412, ErrorKind.EXISTS),
            ("InvalidRange", 416, ErrorKind.RANGE),
            ("NoSuchBucket", 404, ErrorKind.PERMANENT),
            ("AccessDenied", 403, ErrorKind.PERMANENT),
            ("InvalidAccessKeyId", 403, ErrorKind.PERMANENT),
            ("SignatureDoesNotMatch", 403, ErrorKind.PERMANENT),
            ("EntityTooSmall", 400, ErrorKind.PERMANENT),
        ],
    )
    def test_service_errors_raw_and_as_s3fs_translates_them(self, code, status, kind):
        assert classify(_client_error(code, status)).kind is kind
        translated = _s3fs_error(code, status)  # e.g. NoSuchBucket arrives as a FileNotFoundError
        info = classify(translated)
        assert (info.kind, info.code, info.status) == (kind, code, status)

    def test_hints_say_what_to_check(self):
        assert classify(_client_error("NoSuchBucket", 404)).hint == HINT_BUCKET
        assert classify(_client_error("InvalidAccessKeyId", 403)).hint == HINT_CREDENTIALS
        assert "clock" in classify(_client_error("RequestTimeTooSkewed", 403)).hint

    def test_connection_errors_are_transient(self):
        from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError

        for exc in (
            ConnectionResetError(errno.ECONNRESET, "reset"),
            BrokenPipeError(),
            TimeoutError(),
            EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
            ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
            ConnectionClosedError(endpoint_url="http://127.0.0.1:1"),
            OSError(errno.EBUSY, "busy"),
        ):
            assert classify(exc).kind is ErrorKind.TRANSIENT, exc
        assert classify(NoCredentialsError()).kind is ErrorKind.PERMANENT
        assert classify(NoCredentialsError()).hint == HINT_CREDENTIALS

    def test_builtins_and_bugs(self):
        assert classify(FileNotFoundError("x")).kind is ErrorKind.MISSING
        assert classify(IsADirectoryError("x")).kind is ErrorKind.MISSING
        assert classify(FileExistsError("x")).kind is ErrorKind.EXISTS
        assert classify(PermissionError("x")).kind is ErrorKind.PERMANENT
        assert classify(OSError(errno.ENOSPC, "full")).kind is ErrorKind.PERMANENT
        assert classify(ValueError("a bug")).kind is ErrorKind.UNKNOWN
        assert classify(InjectedCrash()).kind is ErrorKind.UNKNOWN

    def test_a_cause_chain_is_read(self):
        try:
            try:
                raise _client_error("SlowDown", 503)
            except Exception as inner:
                raise RuntimeError("wrapped") from inner
        except RuntimeError as outer:
            assert classify(outer).kind is ErrorKind.TRANSIENT


class TestRetryPolicy:
    def test_backoff_grows_is_capped_and_jittered(self):
        p = RetryPolicy(attempts=10, base_s=0.1, cap_s=1.0)
        assert [p.backoff_s(n, 1.0) for n in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0])
        assert [p.backoff_s(n, 0.0) for n in range(5)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5])
        assert p.backoff_s(10_000, 0.5) == pytest.approx(0.75)

    @pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"base_s": -1}, {"base_s": 2, "cap_s": 1}])
    def test_invalid_policies(self, kwargs):
        with pytest.raises(CheckpointConfigError):
            RetryPolicy(**kwargs)

    def test_transient_errors_are_retried_then_succeed(self):
        errors = [_s3fs_error("SlowDown", 503), ConnectionResetError(errno.ECONNRESET, "reset")]
        slept: list[float] = []

        def op():
            if errors:
                raise errors.pop(0)
            return "ok"

        policy = RetryPolicy(attempts=3, base_s=0.1, cap_s=1.0)
        assert retry_call(op, policy, what="put", where="s3://b/x", sleep=slept.append, rand=lambda: 1.0) == "ok"
        assert slept == pytest.approx([0.1, 0.2])

    def test_giving_up_and_permanent_and_unknown(self):
        calls = []

        def always(exc):
            def op():
                calls.append(1)
                raise exc

            return op

        with pytest.raises(RemoteStorageError, match=r"put s3://b/x failed after 3 attempts: .*SlowDown.*503") as info:
            retry_call(always(_s3fs_error("SlowDown", 503)), RetryPolicy(3, 0, 0), what="put", where="s3://b/x", sleep=lambda s: None)
        assert len(calls) == 3 and info.value.attempts == 3 and isinstance(info.value, (CheckpointError, OSError))
        calls.clear()
        with pytest.raises(RemoteStorageError, match="check the credentials"):
            retry_call(always(_s3fs_error("AccessDenied", 403)), RetryPolicy(5, 0, 0), what="put", where="w", sleep=lambda s: None)
        assert len(calls) == 1  # permanent: no retry
        calls.clear()
        with pytest.raises(ValueError, match="a bug"):  # not a storage error: unchanged, not retried
            retry_call(always(ValueError("a bug")), RetryPolicy(5, 0, 0), what="put", where="w", sleep=lambda s: None)
        assert len(calls) == 1
        with pytest.raises(FileNotFoundError, match="s3://b/x: no such object"):
            retry_call(always(_s3fs_error("NoSuchKey", 404)), FAST, what="read", where="s3://b/x")


class TestRedaction:
    def test_urls(self):
        assert redact_url("s3://bucket/run1") == "s3://bucket/run1"
        assert redact_url("sftp://me:hunter22@host:22/ckpt") == "sftp://***@host:22/ckpt"
        assert redact_url("az://c/p?sig=abcdef&sv=1") == "az://c/p?sig=***&sv=***"
        assert redact_url("/plain/path") == "/plain/path"

    def test_secret_values(self):
        options = {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value", "endpoint_url": "http://127.0.0.1:9",
                   "client_kwargs": {"aws_session_token": "tok-123456"}, "anon": False}
        assert set(secret_values(options, "sftp://u:pw-9999@h/x")) == {"AKIAEXAMPLE", "s3cr3t-value", "tok-123456", "pw-9999"}
        # an access key id in the URL's user info is a credential too (a name of under 4 characters is not hidden)
        assert set(secret_values({}, "s3://AKIAINURL:pw-9999@bucket/x")) == {"AKIAINURL", "pw-9999"}


# ---------------------------------------------------------------- construction and the factory


def test_open_storage_picks_the_backend(tmp_path):
    assert isinstance(open_storage(tmp_path / "local"), LocalStorage)
    mem = open_storage(f"memory://ckpt-{uuid.uuid4().hex}/x", max_concurrency=2)
    assert isinstance(mem, FsspecStorage) and mem.max_concurrency == 2 and mem.supports_conditional_create
    assert isinstance(open_storage(f"file://{tmp_path}/f"), FsspecStorage)
    with pytest.raises(CheckpointConfigError, match="apply only to URLs"):
        open_storage(tmp_path, {"key": "k"})


def test_invalid_configuration_is_refused_with_a_fix():
    with pytest.raises(CheckpointConfigError, match="S3 parts are at least 5 MiB"):
        FsspecStorage("s3://bucket/x", {"anon": True}, part_bytes=MiB)
    with pytest.raises(CheckpointConfigError, match="names no bucket"):
        FsspecStorage("s3://", {"anon": True})
    with pytest.raises(CheckpointConfigError, match="no filesystem for nosuchproto://"):
        FsspecStorage("nosuchproto://x/y")
    with pytest.raises(CheckpointConfigError, match="not a URL"):
        FsspecStorage("/just/a/path")
    with pytest.raises(CheckpointConfigError, match="max_concurrency"):
        FsspecStorage("memory://x", max_concurrency=0)


# ---------------------------------------------------------------- retries against the real server


def test_transient_faults_are_retried_on_every_operation(s3_bucket):
    s = s3_storage(s3_bucket)
    faults = inject(
        s,
        Fault("put_object", "slowdown", times=2),
        Fault("cat_file", "reset"),
        Fault("head_object", "timeout"),
        Fault("list_objects_v2", "internal"),
        Fault("upload_part", "slowdown", path="*big"),
        Fault("complete_multipart_upload", "reset"),
    )
    s.put("a/x", b"hello")
    assert s.get("a/x") == b"hello"
    assert s.size("a/x") == 5
    assert s.list("a") == ["x"]
    data = os.urandom(11 * MiB)
    stream_bytes(s, "a/big", data)
    assert s.get("a/big") == data
    assert all(f.fired == f.times for f in faults.faults), [(f.op, f.fired) for f in faults.faults]
    assert faults.count("put_object") == 3 and faults.count("complete_multipart_upload") == 2


def test_the_retry_wrapper_takes_a_new_policy_for_later_requests():
    """Every request runs under the storage's retry wrapper; setting `retry` replaces its policy."""
    s = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/r", retry=RetryPolicy(attempts=1))
    faults = inject(s, Fault("pipe_file", "reset", times=2))
    with pytest.raises(RemoteStorageError, match=r"put memory://.*/r/a failed: ConnectionResetError"):
        s.put("a", b"x")  # one attempt: the transient error is final
    s.retry = FAST
    assert s.retry == FAST
    s.put("a", b"x")  # the second fault is retried under the new policy
    assert s.get("a") == b"x" and faults.count("pipe_file") == 3
    s.delete("")


def test_lost_response_to_a_complete_is_not_a_failure(s3_bucket):
    """CompleteMultipartUpload landed but its response was lost: the retry must not lose the object."""
    s = s3_storage(s3_bucket)
    inject(s, Fault("complete_multipart_upload", "lost"))
    data = os.urandom(6 * MiB)
    stream_bytes(s, "obj", data)
    assert s.get("obj") == data


def test_persistent_transient_errors_give_up_with_a_clear_error(s3_bucket):
    s = s3_storage(s3_bucket, retry=RetryPolicy(attempts=3, base_s=0.001, cap_s=0.002))
    faults = inject(s, Fault("put_object", "slowdown", times=-1))
    with pytest.raises(RemoteStorageError) as info:
        s.put("step/m.json", b"{}")
    msg = str(info.value)
    assert f"put {s.url}/step/m.json failed after 3 attempts" in msg and "SlowDown" in msg and "RetryPolicy" in msg
    assert faults.count("put_object") == 3


def test_permanent_errors_fail_fast_without_leaking_credentials(s3_endpoint, caplog):
    caplog.set_level(logging.DEBUG)
    options = storage_options()
    missing = FsspecStorage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run", options, retry=RetryPolicy(attempts=6, base_s=1, cap_s=1))
    spy = inject(missing)
    with pytest.raises(RemoteStorageError) as info:
        missing.put("step-0000000001/COMMIT", b"x", exclusive=True)
    assert spy.count("put_object") == 1  # permanent: no retry
    err = info.value
    assert isinstance(err, OSError) and isinstance(err, CheckpointError)
    assert "NoSuchBucket" in str(err) and "check the bucket name" in str(err) and "step-0000000001/COMMIT" in str(err)
    with pytest.raises(RemoteStorageError, match="NoSuchBucket"):
        missing.get("x")  # not a FileNotFoundError: a missing bucket is a configuration error
    with pytest.raises(RemoteStorageError, match="NoSuchBucket"):
        missing.list("")

    denied = FsspecStorage(new_bucket()[0], options, retry=FAST)
    faults = inject(denied, Fault("put_object", "denied", times=-1))
    with pytest.raises(RemoteStorageError, match="AccessDenied.*check the credentials") as info2:
        denied.put("a", b"x")
    assert faults.count("put_object") == 1
    assert "no-such-bucket" in caplog.text  # the SDK's debug logs were captured, and hold no secret
    for text in (str(err), repr(err), str(info2.value), repr(missing), repr(denied), missing.url, caplog.text):
        assert SECRET not in text
    for text in (str(err), str(info2.value), repr(missing)):
        assert KEY not in text


def test_credentials_in_the_url_are_redacted():
    s = FsspecStorage("memory://user:pa55word-x@ckpt/run")  # memory ignores them; the URL must not show them
    assert "pa55word-x" not in repr(s) and "pa55word-x" not in s.url


# ---------------------------------------------------------------- multipart uploads


def test_multipart_stream_round_trips_with_parallel_parts(s3_bucket):
    s = s3_storage(s3_bucket, max_concurrency=4)
    faults = inject(s, latency_s=0.05)  # each request takes a little while, so overlap is visible
    data = os.urandom(20 * MiB + 12345)
    stream_bytes(s, "step-0000000001/r00000.t.pack", data)
    assert s.get("step-0000000001/r00000.t.pack") == data
    assert faults.count("upload_part") == 5 and faults.count("create_multipart_upload") == 1
    assert 1 < faults.peak["upload_part"] <= 4
    head = client().head_object(Bucket=s3_bucket[0][5:].split("/")[0], Key="root/step-0000000001/r00000.t.pack")
    assert head["ETag"].endswith('-5"')  # the server assembled it from 5 parts
    buf = bytearray(1000)
    s.read_into("step-0000000001/r00000.t.pack", 7 * MiB - 10, memoryview(buf))
    assert bytes(buf) == data[7 * MiB - 10 : 7 * MiB + 990]
    s.close()


def test_upload_file_parallel_parts_bounded_memory(s3_bucket, tmp_path):
    s = s3_storage(s3_bucket, max_concurrency=2)
    faults = inject(s, Fault("upload_part", "reset", path="*pack"), latency_s=0.05)
    data = os.urandom(16 * MiB)
    src = tmp_path / "r0.pack"
    src.write_bytes(data)
    s.upload_file(src, "s/r0.pack", length=15 * MiB + 3)  # a prefix of the file: 4 parts
    assert s.get("s/r0.pack") == data[: 15 * MiB + 3]
    assert faults.count("upload_part") == 5  # 4 parts, one retried
    assert faults.peak["upload_part"] == 2  # parallel, never more than max_concurrency
    s.upload_file(src, "s/small", length=100)  # small: one PutObject
    assert s.get("s/small") == data[:100] and faults.count("put_object") == 1
    with pytest.raises(EOFError, match="bytes short"):
        s.upload_file(src, "s/too-long", length=17 * MiB)
    assert s.list("s") == ["r0.pack", "small"] and pending_uploads(s3_bucket[0]) == []


# ---------------------------------------------------------------- nothing partial is ever visible


@pytest.mark.parametrize("kind", ["truncate", "short", "crash"])
def test_a_broken_multipart_upload_is_never_visible(s3_bucket, kind):
    s = s3_storage(s3_bucket, max_concurrency=2)
    inject(s, Fault("upload_part", kind, times=-1, skip=1))  # part 1 fine, every later part broken
    data = os.urandom(12 * MiB)
    with pytest.raises((RemoteStorageError, InjectedCrash, OSError)):
        stream_bytes(s, "s/p.pack", data, abort_on_error=kind != "crash")
    with pytest.raises(FileNotFoundError):
        s.get("s/p.pack")
    assert s.list("s") == []
    if kind != "crash":
        assert pending_uploads(s3_bucket[0]) == []  # aborted: no parts left behind


def test_a_truncated_part_is_retried_and_the_object_is_exact(s3_bucket):
    s = s3_storage(s3_bucket)
    inject(s, Fault("upload_part", "truncate", times=2))
    data = os.urandom(11 * MiB)
    stream_bytes(s, "p", data)
    assert s.get("p") == data


def test_abort_discards_uploaded_parts(s3_bucket):
    s = s3_storage(s3_bucket)
    w = s.open_stream("s/p.pack")
    w.write(memoryview(os.urandom(11 * MiB)))  # two parts on their way
    w.abort()
    w.abort()
    assert s.list("s") == [] and pending_uploads(s3_bucket[0]) == []


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_a_crash_before_the_rename_leaves_only_a_temporary(scheme, tmp_path):
    """Streams (and on file://, puts) write a temporary and rename it: a crash in between hides the object."""
    url = f"memory://ckpt-{uuid.uuid4().hex}/r" if scheme == "memory" else f"file://{tmp_path}/r"
    s = FsspecStorage(url, retry=FAST)
    inject(s, Fault("mv", "crash", times=-1), Fault("link", "crash"))
    w = s.open_stream("d/p.pack")
    w.write(memoryview(b"partial"))
    with pytest.raises(InjectedCrash):
        w.close()
    if scheme == "file":
        with pytest.raises(InjectedCrash):
            s.put("d/manifest.json", b"{}")
        with pytest.raises(InjectedCrash):
            s.put("d/COMMIT", b"c", exclusive=True)
    names = s.list("d")
    assert not any(n in names for n in ("manifest.json", "COMMIT", "p.pack")), names
    s.delete("")


# ---------------------------------------------------------------- conditional create


def test_conditional_create_has_one_winner_across_clients(s3_bucket):
    """Eight writers on two separate clients (two 'hosts') race for one COMMIT: S3 picks one."""
    clients = [s3_storage(s3_bucket), s3_storage(s3_bucket)]
    spy = inject(clients[0])
    barrier = threading.Barrier(8)
    results: dict[int, str] = {}

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            clients[i % 2].put("step-0000000007/COMMIT", f"writer {i}".encode(), exclusive=True)
            results[i] = "won"
        except FileExistsError:
            results[i] = "lost"

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, r in results.items() if r == "won"]
    assert len(results) == 8 and len(winners) == 1, results
    assert clients[1].get("step-0000000007/COMMIT") == f"writer {winners[0]}".encode()
    assert all("IfNoneMatch" in kw for op, _, kw in spy.calls if op == "put_object")  # the store decided, not us
    assert clients[0].supports_conditional_create


def test_conditional_create_retried_after_a_lost_response(s3_bucket):
    s = s3_storage(s3_bucket)
    faults = inject(s, Fault("put_object", "lost"))
    s.put("s/COMMIT", b"mine", exclusive=True)  # landed, response lost, retry finds our own bytes
    assert faults.count("put_object") == 2 and s.get("s/COMMIT") == b"mine"
    with pytest.raises(FileExistsError, match="already exists"):
        s3_storage(s3_bucket).put("s/COMMIT", b"theirs", exclusive=True)
    assert s.get("s/COMMIT") == b"mine"


# ---------------------------------------------------------------- pacing


def test_bandwidth_limit_paces_uploads(tmp_path):
    s = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/r", part_bytes=MiB // 4, max_bytes_per_s=8 * MiB)
    src = tmp_path / "f"
    src.write_bytes(os.urandom(2 * MiB))
    start = time.monotonic()
    s.upload_file(src, "f")
    elapsed = time.monotonic() - start
    assert elapsed >= 0.2, elapsed  # 2 MiB at 8 MiB/s: the first quarter MiB goes at once, the rest waits
    assert s.get("f") == src.read_bytes()
    s.delete("")


def test_sizes_list_a_directory_rather_than_ask_per_object(s3_bucket):
    """Rank 0's remote commit checks every rank's file of a step: one HEAD each was a round trip
    per rank. A directory with several wanted objects is listed instead; only what the listing does
    not show is asked for by itself."""
    s = s3_storage(s3_bucket)
    files = {f"step-0000000002/r{r:05d}.pack": 1000 + r for r in range(40)}
    for path, n in files.items():
        s.put(path, b"\0" * n)
    s.put("step-0000000001/r00000.pack", b"old")
    faults = inject(s)
    got = s.sizes([*files, "step-0000000002/r99999.pack", "step-0000000001/r00000.pack"])
    assert got == {**files, "step-0000000002/r99999.pack": None, "step-0000000001/r00000.pack": 3}
    assert faults.count("list_objects_v2") == 1
    assert faults.count("head_object") == 2  # the one the listing did not show, the lone file of step 1


def test_sizes_ask_for_what_a_lagging_listing_leaves_out(tmp_path):
    """A store whose listing lags behind its writes: objects it does not show are asked for one by one."""
    from checkpointing.storage import sizes

    storage = LocalStorage(tmp_path)
    for r in range(6):
        storage.put(f"d/f{r}", b"x" * r)
    listings = []

    def lagging(directory: str) -> dict[str, int]:
        listings.append(directory)
        return {f"f{r}": r for r in range(3)}  # the last three not yet listed

    got = sizes.listed_or_one_by_one(storage, [f"d/f{r}" for r in range(6)] + ["d/gone"], lagging)
    assert got == {**{f"d/f{r}": r for r in range(6)}, "d/gone": None}
    assert listings == ["d"]


@pytest.fixture
def silent_endpoint():
    """An HTTP endpoint on 127.0.0.1 that takes every byte sent to it and never answers."""
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    conns: list = []

    def drain(conn) -> None:
        while conn.recv(1 << 16):
            pass

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    srv.close()
    for conn in conns:
        conn.close()


def test_a_store_that_takes_the_bytes_and_never_answers_costs_the_retry_budget_not_the_job(silent_endpoint):
    storage = FsspecStorage("s3://bucket/run", {"endpoint_url": silent_endpoint, "key": KEY, "secret": SECRET,
                                                "client_kwargs": {"region_name": "us-east-1"}},
                            retry=RetryPolicy(attempts=2, base_s=0.01, cap_s=0.02, request_timeout_s=0.5))
    outcome: dict = {}

    def put() -> None:
        try:
            storage.put("step-0000000001/COMMIT", b"x" * 100_000, exclusive=True)
        except RemoteStorageError as exc:
            outcome["error"] = str(exc)

    worker = threading.Thread(target=put, daemon=True)
    worker.start()
    worker.join(120)  # a guard against a hang, not a speed check: the put gives up after two attempts of about 0.6 s
    assert not worker.is_alive(), "a put to a store that never answers did not give up"
    assert "failed after 2 attempts: FSTimeoutError: no answer within the request's time limit (RetryPolicy.request_timeout_s)" in \
        outcome.get("error", ""), outcome
    with pytest.raises(CheckpointConfigError, match="request_timeout_s=0"):
        RetryPolicy(request_timeout_s=0)
