"""Credentials never leave the storage layer: which values are secret, and how to hide them (pure).

Layer: storage (pure helpers). `secret_values` finds the credentials a caller handed in
(storage_options, a password in the URL) once, when a remote tier is opened; every message built from
a storage error then passes through `redact` with them (retry.Retrying does it for every request), and
every URL shown to a user passes through `redact_url`.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping
from urllib.parse import urlsplit, urlunsplit

_SECRET_KEY = re.compile(r"key|secret|token|passw|credential|signature|sas|auth", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """An option named so holds a credential (its value is never shown, and taken as the text given)."""
    return bool(_SECRET_KEY.search(name))


def secret_values(options: Mapping[str, object] | None, url: str = "") -> tuple[str, ...]:
    """String values in `options` (nested too) whose names look like credentials, and the user info in `url`."""
    found: list[str] = []

    def walk(obj: object, name: str) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, str(k))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, name)
        elif isinstance(obj, str) and len(obj) >= 4 and is_secret_name(name):
            found.append(obj)

    walk(options or {}, "")
    parts = urlsplit(url) if "://" in url else None
    for part in (parts.password, parts.username) if parts is not None else ():  # user info: an access key id, its secret
        if part and len(part) >= 4:
            found.append(part)
    return tuple(sorted(set(found), key=len, reverse=True))


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every one of `secrets` replaced by '***' (longest first: `secret_values` sorts them)."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def redact_url(url: str) -> str:
    """`url` without user info or query values: 's3://user:pw@bucket/p?sig=x' -> 's3://***@bucket/p?sig=***'."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(f"{kv.split('=', 1)[0]}=***" if "=" in kv else kv for kv in parts.query.split("&")) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
