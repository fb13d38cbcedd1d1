"""The HTTP client of verify's serving engines: one deadline per request, no redirects, a size cap.

`request_json(url, method, body, timeout=..., max_bytes=...)` sends one request and returns the decoded
JSON answer, or raises `EngineFailure` in words a server author can act on:
- one deadline covers connecting, sending and receiving the whole body (a server that trickles bytes
  forever fails at the deadline, not never: a watchdog shuts the socket when it passes);
- a redirect (3xx) is not followed: it fails, naming where it pointed (the POST would otherwise arrive
  at another host as a bodiless GET);
- an answer larger than `max_bytes` (`--engine-max-bytes`, default 64 MiB: a scoring answer of 16k
  tokens is about 4 MB) fails as soon as its header or its bytes pass the cap;
- an HTTP error status, a body that is not JSON, an unreachable server: each says which.
Standard library only.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from typing import Any

from .process import EngineFailure

__all__ = ["request_json", "engine_max_bytes", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 64 << 20
CHUNK = 1 << 16


def engine_max_bytes() -> int:
    """The largest answer accepted, in bytes (`POSENC_ENGINE_MAX_BYTES`, `--engine-max-bytes`; default 64 MiB)."""
    return int(os.environ.get("POSENC_ENGINE_MAX_BYTES", DEFAULT_MAX_BYTES))


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EngineFailure(f"{url}: not an http:// or https:// URL")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=max(timeout, 1e-3))
    path = parts.path or "/"
    return conn, path + (f"?{parts.query}" if parts.query else "")


def request_json(url: str, method: str = "GET", body: Any = None, *, timeout: float, max_bytes: int | None = None
                 ) -> Any:
    """`method url` with `body` as JSON; the answer's JSON. Raises EngineFailure (see the module)."""
    cap = engine_max_bytes() if max_bytes is None else int(max_bytes)
    where = urllib.parse.urlsplit(url).path or "/"
    deadline = time.monotonic() + timeout
    conn, path = _connection(url, timeout)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", "Accept-Encoding": "identity"})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            target = resp.getheader("Location") or "(no Location header)"
            raise EngineFailure(f"{where}: the server answered HTTP {resp.status}, a redirect to {target}; verify does "
                                "not follow redirects (give the URL of the server itself)")
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise EngineFailure(f"{where}: the answer announces {int(declared)} bytes, more than the cap of {cap} "
                                "(--engine-max-bytes)")
        raw = _read_body(resp, cap, where, deadline)
    except EngineFailure:
        raise
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or time.monotonic() >= deadline:
            raise EngineFailure(f"{where}: no complete answer from {url} within {timeout:g} s (--engine-timeout covers "
                                "connecting, sending and the whole body)") from None
        raise EngineFailure(f"{where}: no answer from {url} ({type(exc).__name__}: {exc})") from None
    finally:
        watchdog.cancel()
        conn.close()
    if expired.is_set():
        raise EngineFailure(f"{where}: no complete answer from {url} within {timeout:g} s (--engine-timeout covers "
                            "connecting, sending and the whole body)")
    if resp.status >= 400:
        raise EngineFailure(f"{where}: HTTP {resp.status}: {raw[:400].decode(errors='replace')}")
    try:
        return json.loads(raw)
    except ValueError:
        raise EngineFailure(f"{where}: malformed answer (not JSON): {raw[:200]!r}") from None


def _read_body(resp: http.client.HTTPResponse, cap: int, where: str, deadline: float) -> bytes:
    parts, have = [], 0
    while True:
        if time.monotonic() >= deadline:
            raise OSError("deadline passed")
        chunk = resp.read1(CHUNK) if hasattr(resp, "read1") else resp.read(CHUNK)
        if not chunk:
            return b"".join(parts)
        have += len(chunk)
        if have > cap:
            raise EngineFailure(f"{where}: the answer passed the cap of {cap} bytes (--engine-max-bytes) before it "
                                "ended")
        parts.append(chunk)
