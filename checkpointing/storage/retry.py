"""Retries for remote storage: which errors are transient, how long to wait, and what to tell the user.

Layer: storage. Four parts, pure where possible:
- `classify(exc)` reads an exception (a botocore ClientError, one that s3fs translated into a
  builtin with the ClientError as its `__cause__`, a connection/timeout error, or a builtin OSError
  from a filesystem) and says what kind of failure it is. It imports no cloud SDK: it reads the
  `response` dict botocore attaches and the names of the exception's classes.
- `RetryPolicy` is capped exponential backoff with jitter; `retry_call` runs one operation under it,
  retrying only known-transient errors and translating everything else once, at this boundary:
  a missing object -> FileNotFoundError, a refused conditional create -> FileExistsError, a range past
  the end -> EOFError, anything else -> RemoteStorageError (what, where, how to fix).
- `Retrying` is that loop as a wrapper a backend is composed with: a policy plus the secrets to keep
  out of messages (redact.py). Every request FsspecStorage makes goes through one
  (endpoint.Endpoint.request), so no backend has a retry loop or an error translation of its own.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import random
import time
from typing import Callable, Iterable, Iterator, Mapping, TypeVar

from checkpointing.errors import CheckpointConfigError, CheckpointError
from checkpointing.storage.redact import redact

log = logging.getLogger("checkpointing")

T = TypeVar("T")


class ErrorKind(enum.Enum):
    TRANSIENT = "transient"  # retry with backoff
    MISSING = "missing"  # the object does not exist -> FileNotFoundError
    EXISTS = "exists"  # a conditional create found the object -> FileExistsError
    RANGE = "range"  # a ranged read past the end -> EOFError
    PERMANENT = "permanent"  # retrying cannot help -> RemoteStorageError at once
    UNKNOWN = "unknown"  # not a storage error at all (a bug): propagate unchanged


HINT_CREDENTIALS = "check the credentials (key/secret/token in storage_options) and the bucket policy"
HINT_BUCKET = "check the bucket name in the URL, the region and endpoint_url"
HINT_CLOCK = "check the system clock: the request signature is too far from the server's time"
HINT_TRANSIENT = "the service kept failing with transient errors: check endpoint_url and connectivity, or allow more RetryPolicy.attempts"
HINT_OTHER = "check the bucket name / credentials / endpoint_url"
HINT_FS_ACCESS = "check that this process may write and read there (the directories' owner and mode)"
HINT_FS_SPACE = "free space on that filesystem (or raise its quota or the process's file size limit)"
HINT_FS_OTHER = "check that path on the filesystem (a file where a directory belongs, or a device error)"
_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    kind: ErrorKind
    code: str | None = None  # the service's error code ("SlowDown", "NoSuchBucket"), when known
    status: int | None = None  # the HTTP status, when known
    hint: str = HINT_OTHER


_TRANSIENT_CODES = frozenset(
    "SlowDown SlowDownRead SlowDownWrite Throttling ThrottlingException ThrottledException RequestThrottled "
    "RequestThrottledException TooManyRequestsException RequestLimitExceeded BandwidthLimitExceeded "
    "RequestTimeout RequestTimeoutException InternalError InternalFailure ServiceUnavailable "
    "ServiceUnavailableException OperationAborted ConditionalRequestConflict IncompleteBody BadDigest "
    "XAmzContentSHA256Mismatch PriorRequestNotComplete 500 502 503 504".split()
)
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_EXISTS_CODES = frozenset({"PreconditionFailed", "412"})
_RANGE_CODES = frozenset({"InvalidRange", "416"})
_CREDENTIAL_CODES = frozenset(
    "AccessDenied Forbidden InvalidAccessKeyId SignatureDoesNotMatch ExpiredToken InvalidToken "
    "TokenRefreshRequired InvalidSecurity AllAccessDisabled AccountProblem NotSignedUp "
    "MissingSecurityHeader Unauthorized 401 403".split()
)
_BUCKET_CODES = frozenset(
    "NoSuchBucket InvalidBucketName PermanentRedirect AuthorizationHeaderMalformed "
    "IllegalLocationConstraintException 301 307".split()
)
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

# Exception classes are matched by name (anywhere in the MRO), so no SDK needs importing here:
# botocore (EndpointConnectionError, ReadTimeoutError, ...), aiohttp, urllib3, requests.
_TRANSIENT_TYPES = frozenset(
    "ConnectionError TimeoutError HTTPClientError ConnectionClosedError EndpointConnectionError "
    "ReadTimeoutError ConnectTimeoutError ResponseStreamingError IncompleteReadError IncompleteRead "
    "ClientPayloadError ServerDisconnectedError ClientConnectionError ServerTimeoutError "
    "ResponseParserError ChunkedEncodingError ProtocolError".split()
)
_CREDENTIAL_TYPES = frozenset(
    "NoCredentialsError PartialCredentialsError CredentialRetrievalError UnauthorizedSSOTokenError "
    "TokenRetrievalError".split()
)
_TRANSIENT_ERRNOS = frozenset(
    {errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.EREMOTEIO}
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then its causes/contexts (bounded: chains can be cyclic)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 8:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _response(exc: BaseException) -> tuple[str | None, int | None] | None:
    """(code, HTTP status) from a botocore-style `exc.response`, or None."""
    resp = getattr(exc, "response", None)
    if not isinstance(resp, Mapping):
        return None
    err = resp.get("Error") or {}
    meta = resp.get("ResponseMetadata") or {}
    code = err.get("Code") if isinstance(err, Mapping) else None
    status = meta.get("HTTPStatusCode") if isinstance(meta, Mapping) else None
    if code is None and status is None:
        return None
    return (str(code) if code is not None else None), (int(status) if isinstance(status, int) else None)


def _from_response(code: str | None, status: int | None) -> ErrorInfo:
    tables = (
        (_TRANSIENT_CODES, ErrorKind.TRANSIENT, HINT_TRANSIENT),
        (_BUCKET_CODES, ErrorKind.PERMANENT, HINT_BUCKET),
        (_MISSING_CODES, ErrorKind.MISSING, HINT_OTHER),
        (_EXISTS_CODES, ErrorKind.EXISTS, HINT_OTHER),
        (_RANGE_CODES, ErrorKind.RANGE, HINT_OTHER),
        (_CREDENTIAL_CODES, ErrorKind.PERMANENT, HINT_CREDENTIALS),
        (frozenset({"RequestTimeTooSkewed"}), ErrorKind.PERMANENT, HINT_CLOCK),
    )
    for key in (code, str(status) if status is not None else None):  # the code decides; the status if the code is unknown
        for names, kind, hint in tables:
            if key is not None and key in names:
                return ErrorInfo(kind, code, status, hint)
    if status in _TRANSIENT_STATUS:
        return ErrorInfo(ErrorKind.TRANSIENT, code, status, HINT_TRANSIENT)
    return ErrorInfo(ErrorKind.PERMANENT, code, status, HINT_OTHER)


def _from_type(exc: BaseException) -> ErrorInfo | None:
    names = {cls.__name__ for cls in type(exc).__mro__}
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return ErrorInfo(ErrorKind.MISSING)
    if isinstance(exc, FileExistsError):
        return ErrorInfo(ErrorKind.EXISTS)
    if isinstance(exc, EOFError):
        return ErrorInfo(ErrorKind.RANGE)
    if isinstance(exc, PermissionError) or names & _CREDENTIAL_TYPES:
        return ErrorInfo(ErrorKind.PERMANENT, hint=HINT_CREDENTIALS)
    if "NoRegionError" in names:
        return ErrorInfo(ErrorKind.PERMANENT, hint=HINT_BUCKET)
    if names & _TRANSIENT_TYPES:
        return ErrorInfo(ErrorKind.TRANSIENT, hint=HINT_TRANSIENT)
    if isinstance(exc, OSError):
        if exc.errno in _TRANSIENT_ERRNOS:
            return ErrorInfo(ErrorKind.TRANSIENT, hint=HINT_TRANSIENT)
        return ErrorInfo(ErrorKind.PERMANENT)
    if "BotoCoreError" in names or "ClientError" in names:
        return ErrorInfo(ErrorKind.PERMANENT)
    return None


def classify(exc: BaseException) -> ErrorInfo:
    """What kind of failure `exc` is. Pure: reads only the exception chain.

    A service response anywhere in the chain decides first (s3fs wraps a ClientError in a builtin
    whose type can mislead: NoSuchBucket becomes FileNotFoundError); then exception types, outermost
    first. An error this function does not recognise is UNKNOWN and must not be swallowed.
    """
    if isinstance(exc, RemoteStorageError):
        return exc.info  # already classified and retried below us: never retry it again
    for link in _chain(exc):
        found = _response(link)
        if found is not None:
            return _from_response(*found)
    for link in _chain(exc):
        info = _from_type(link)
        if info is not None:
            return info
    return ErrorInfo(ErrorKind.UNKNOWN)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with jitter: the n-th retry waits in [d/2, d], d = min(cap_s, base_s * 2**n).

    The default gives up after 6 attempts (about 3 s of waiting in total). An attempt of a request to
    an asynchronous store (s3fs) that has no answer after `request_timeout_s` plus its body's size at
    `min_rate_bytes_per_s` is cancelled and counts as a transient failure: a store that takes the bytes
    and never answers costs the retry budget, not the job.
    """

    attempts: int = 6
    base_s: float = 0.05
    cap_s: float = 2.0
    request_timeout_s: float = 60.0
    min_rate_bytes_per_s: float = float(1 << 20)

    def deadline_s(self, nbytes: int = 0) -> float:
        """How long one attempt of a request carrying (or fetching) `nbytes` may go unanswered."""
        return self.request_timeout_s + nbytes / self.min_rate_bytes_per_s

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise CheckpointConfigError(f"RetryPolicy.attempts={self.attempts}: must be >= 1 (1 = no retries)")
        if not self.request_timeout_s > 0 or not self.min_rate_bytes_per_s > 0:
            raise CheckpointConfigError(f"RetryPolicy(request_timeout_s={self.request_timeout_s}, min_rate_bytes_per_s="
                                        f"{self.min_rate_bytes_per_s}): both must be > 0")
        if self.base_s < 0 or self.cap_s < self.base_s:
            raise CheckpointConfigError(
                f"RetryPolicy(base_s={self.base_s}, cap_s={self.cap_s}): need 0 <= base_s <= cap_s"
            )

    def backoff_s(self, retry: int, rand: float) -> float:
        """Seconds to wait before retry number `retry` (0-based); `rand` is uniform in [0, 1)."""
        ceiling = min(self.cap_s, self.base_s * (2.0**min(retry, 62)))
        return ceiling / 2 + rand * ceiling / 2


class RemoteStorageError(CheckpointError, OSError):
    """A remote storage operation failed for good: a permanent error, or transient ones past the retry budget."""

    def __init__(self, what: str, where: str, cause: BaseException, info: ErrorInfo, attempts: int, secrets: Iterable[str] = ()) -> None:
        self.what, self.where, self.info, self.attempts = what, where, info, attempts
        detail = ", ".join(p for p in (info.code, f"HTTP {info.status}" if info.status else None) if p)
        said = str(cause) or ("no answer within the request's time limit (RetryPolicy.request_timeout_s)" if isinstance(cause, TimeoutError) else "")
        text = f"{cause} ({detail})" if detail else f"{type(cause).__name__}: {said}"  # a service code says more than a type
        reason = redact(text, secrets)
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"{what} {where} failed{tries}: {reason}; {info.hint}")


def translate(exc: Exception, *, what: str, where: str, attempts: int = 1, secrets: Iterable[str] = ()) -> BaseException:
    """The exception to raise for `exc` at the storage boundary (the Storage protocol's builtins, or RemoteStorageError)."""
    info = classify(exc)
    if info.kind is ErrorKind.UNKNOWN or isinstance(exc, RemoteStorageError):
        return exc
    if info.kind is ErrorKind.MISSING:
        return FileNotFoundError(errno.ENOENT, f"{where}: no such object")
    if info.kind is ErrorKind.EXISTS:
        return FileExistsError(errno.EEXIST, f"{where} already exists (conditional create refused)")
    if info.kind is ErrorKind.RANGE:
        return EOFError(f"{where}: the requested range is past the end of the object")
    if isinstance(exc, OSError) and exc.errno is not None and _on_a_filesystem(where):  # not a service: no credentials
        hint = HINT_FS_ACCESS if isinstance(exc, PermissionError) else HINT_FS_SPACE if exc.errno in _SPACE_ERRNOS else HINT_FS_OTHER
        info = dataclasses.replace(info, hint=hint if info.kind is not ErrorKind.TRANSIENT else info.hint)
    return RemoteStorageError(what, where, exc, info, attempts, secrets)


def _on_a_filesystem(where: str) -> bool:
    """Whether `where` (a request's URL) is on a filesystem of this machine: file://, or a plain path."""
    return where.startswith(("file://", "local://", "/")) or "://" not in where


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str,
    where: str,
    secrets: Iterable[str] = (),
    sleep: Callable[[float], None] = time.sleep,
    rand: Callable[[], float] = random.random,
) -> T:
    """`fn()`, retried on transient errors under `policy`; other errors translated at once (see `translate`).

    `fn` must be safe to repeat: callers pass idempotent requests, or handle the ambiguity themselves
    (a conditional create retried after a lost response may find its own object: see FsspecStorage.put).
    """
    secrets = tuple(secrets)
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below; unknown errors re-raised unchanged
            info = classify(exc)
            if info.kind is ErrorKind.TRANSIENT and attempt < policy.attempts:
                delay = policy.backoff_s(attempt - 1, rand())
                log.info(
                    "checkpointing: %s %s: transient %s (attempt %d/%d), retrying in %.2fs",
                    what, where, info.code or type(exc).__name__, attempt, policy.attempts, delay,
                )
                sleep(delay)
                continue
            raise translate(exc, what=what, where=where, attempts=attempt, secrets=secrets) from exc
    raise AssertionError("unreachable")  # pragma: no cover


@dataclasses.dataclass(frozen=True)
class Retrying:
    """The retry wrapper: runs one request under `policy`, errors translated once with `secrets` redacted.

    A backend is composed with one (FsspecStorage through its Endpoint) and sends every request
    through `__call__`; replacing it (dataclasses.replace) changes the policy for later requests.
    """

    policy: RetryPolicy
    secrets: tuple[str, ...] = ()

    def __call__(self, what: str, where: str, fn: Callable[[], T]) -> T:
        """`fn()`, retried on transient errors (see `retry_call`); `what` and `where` name it in messages."""
        return retry_call(fn, self.policy, what=what, where=where, secrets=self.secrets)

    def translate(self, exc: Exception, *, what: str, where: str) -> BaseException:
        """The exception to raise for `exc`, raised outside a request (see `translate`)."""
        return translate(exc, what=what, where=where, secrets=self.secrets)

    def redact(self, text: str) -> str:
        return redact(text, self.secrets)
