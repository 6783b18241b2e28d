"""The peer socket's framing: JSON messages and raw byte runs over one TCP connection (layer: peer; I/O).

A message is `CKP1` + a 4-byte big-endian length + that many bytes of canonical JSON (an object).
Raw bytes (a manifest, a file's contents) follow the message that announces their length. Every
socket operation has the connection's timeout: a peer that sends or takes nothing for that long is
taken for dead or hung. Socket failures become one `PeerLinkError` naming the peer (`who`).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from checkpointing.format.manifest import canonical_json
from checkpointing.peer.types import PeerLinkError

MAGIC = b"CKP1"
VERSION = 1
MAX_MESSAGE = 1 << 20  # messages are small: a file list at most; data travels as raw bytes


class Link:
    """One connection to a peer, named `who` in errors ('peer rank 2 at 127.0.0.1:40123')."""

    def __init__(self, sock: socket.socket, who: str, timeout_s: float) -> None:
        self.sock, self.who, self.timeout_s = sock, who, timeout_s
        sock.settimeout(timeout_s)

    @classmethod
    def connect(cls, host: str, port: int, who: str, timeout_s: float) -> "Link":
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise PeerLinkError(f"cannot connect to {who}: {_reason(exc)} (is its process alive?)") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock, who, timeout_s)

    def send(self, msg: dict[str, Any], payload: bytes | memoryview = b"") -> None:
        body = canonical_json(msg)
        self.send_raw(MAGIC + struct.pack(">I", len(body)) + body)
        if payload:
            self.send_raw(payload)

    def send_raw(self, data: bytes | memoryview) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise self._lost("sending to", exc) from None

    def recv(self) -> dict[str, Any]:
        head = self.recv_bytes(8)
        if head[:4] != MAGIC:
            raise PeerLinkError(f"{self.who} does not speak the peer-copy protocol (got {bytes(head[:4])!r})")
        (n,) = struct.unpack(">I", head[4:])
        if n > MAX_MESSAGE:
            raise PeerLinkError(f"{self.who} sent a message of {n} bytes (at most {MAX_MESSAGE}): not a peer-copy message")
        try:
            msg = json.loads(self.recv_bytes(n))
        except ValueError as exc:
            raise PeerLinkError(f"{self.who} sent a malformed message ({exc})") from None
        if not isinstance(msg, dict):
            raise PeerLinkError(f"{self.who} sent a malformed message (not an object)")
        return msg

    def recv_bytes(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def recv_into(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                got = self.sock.recv_into(view[done:])
            except OSError as exc:
                raise self._lost("receiving from", exc) from None
            if got == 0:
                raise PeerLinkError(f"{self.who} closed the connection {len(view) - done} bytes early (it died or gave up)")
            done += got

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _lost(self, doing: str, exc: OSError) -> PeerLinkError:
        return PeerLinkError(f"{doing} {self.who}: {_reason(exc, self.timeout_s)}")


def _reason(exc: OSError, timeout_s: float | None = None) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return (f"no progress for {timeout_s:g} s (the peer is hung, dead, or far slower; raise timeout_s if it is only slow)"
                if timeout_s else "timed out")
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there: the process is gone)"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return f"the connection was reset ({type(exc).__name__}: the peer died or closed it)"
    return f"{type(exc).__name__}: {exc}"


def expect(msg: dict[str, Any], who: str, *keys: str) -> None:
    """The message is an error reply (raise it) or lacks a field (a protocol error)."""
    if msg.get("ok") is False:
        raise PeerLinkError(f"{who} refused: {msg.get('error', 'no reason given')}")
    missing = [k for k in keys if k not in msg]
    if missing:
        raise PeerLinkError(f"{who} sent a message without {missing}: not this protocol version ({VERSION})")
