"""The fetch socket's protocol and its client: `fetch` asks the node daemon over a Unix
socket in the cache dir (the daemon's side: weightcache/daemon/coordinator.py).

Protocol: the client sends one JSON line (at most 64 KiB, within 5 s of connecting)
`{"op": "fetch", "source": ..., "name": ..., "revision": ..., "pod_uid": ...}` (or
`"op": "hit"`, fire and forget, for metrics). The daemon answers with JSON lines:
`{"event": "accepted"}` at once, `{"event": "waiting"}` every HEARTBEAT seconds, and finally
`{"event": "done", "result": {...}}` or `{"event": "error", "exit_code": N, "message": "..."}`.
A request the daemon cannot read gets an error event instead of "accepted". Instead of
accepting, the daemon may answer `{"event": "refused", "message": "..."}` (a source outside
its `--allow-source` prefixes): the Pod then fetches alone, with its own credentials.

A hung daemon must not hang a Pod (design §5): the client falls back to fetching alone when
the socket is absent, refuses, does not accept within ACCEPT_TIMEOUT, goes silent for
SILENCE_TIMEOUT, or closes the connection before its verdict (a stopping daemon does: it
never answers an error it caused by stopping). Falling back is always safe: the cache's
correctness never depends on who downloads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from weightcache.config import parse_pod_uid
from weightcache.errors import UsageError, WeightcacheError
from weightcache.sourceurl import Source

log = logging.getLogger(__name__)

HEARTBEAT = 1.0
ACCEPT_TIMEOUT = 2.0
SILENCE_TIMEOUT = 10.0
#: The most bytes of a Unix socket's path (`sun_path`: 108 with its NUL, Linux).
SUN_PATH_MAX = 107


@contextlib.contextmanager
def socket_address(path: Path) -> Iterator[str]:
    """`path` as `bind` and `connect` take it: itself, or, when it is longer than a Unix
    socket's address may be (a deep --cache-dir), the same file reached through an open
    descriptor of its directory (`/proc/self/fd/N/NAME`, which Linux resolves like the
    path). Raises OSError if the directory cannot be opened."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


class DaemonError(WeightcacheError):
    """An error the daemon reported for our fetch, with the daemon's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def request(source: Source, pod_uid: str | None, op: str = "fetch") -> bytes:
    payload = {
        "op": op,
        "source": source.url,
        "name": source.name,
        "revision": source.revision,
        "pod_uid": pod_uid,
    }
    return json.dumps(payload).encode() + b"\n"


def parse_request(line: bytes) -> dict[str, Any]:
    """The request a Pod sent, checked field by field (the daemon trusts no Pod); the
    pod_uid normalised, "" read as none. Raises ValueError saying what is wrong."""
    try:
        msg = json.loads(line)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(msg, dict):
        raise ValueError(f"a JSON object expected, not {type(msg).__name__}")
    if msg.get("op", "fetch") not in ("fetch", "hit"):
        raise ValueError(f'unknown "op" {str(msg.get("op"))[:40]!r}: use "fetch" or "hit"')
    if not isinstance(msg.get("source"), str):
        raise ValueError(f'"source" must be a string, not {type(msg.get("source")).__name__}')
    for key in ("name", "revision", "pod_uid"):
        if not isinstance(msg.get(key), str | None):
            raise ValueError(f'"{key}" must be a string or null, not {type(msg[key]).__name__}')
    try:
        msg["pod_uid"] = parse_pod_uid(msg["pod_uid"], "pod_uid") if msg.get("pod_uid") else None
    except UsageError as e:
        raise ValueError(str(e)) from None
    return msg


def ask_daemon(
    socket_path: Path,
    source: Source,
    pod_uid: str | None,
    accept_timeout: float = ACCEPT_TIMEOUT,
    silence_timeout: float = SILENCE_TIMEOUT,
) -> dict[str, Any] | None:
    """Have the daemon fetch; its result dict, or None to fall back to fetching alone.

    Raises DaemonError when the daemon tried and failed (its verdict is final).
    """
    if not socket_path.exists():
        return None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(accept_timeout)
        with socket_address(socket_path) as address:
            sock.connect(address)
        sock.sendall(request(source, pod_uid))
        reader = sock.makefile("rb")
    except OSError as e:
        log.info("node daemon not reachable at %s (%s); fetching alone", socket_path, e)
        return None
    with contextlib.closing(sock), contextlib.closing(reader):
        try:
            first = _read_event(reader)
            if first.get("event") == "refused":
                log.warning("%s; fetching alone with this Pod's credentials", first.get("message"))
                return None
            if first.get("event") != "accepted":
                log.warning("node daemon answered %r; fetching alone", first)
                return None
            sock.settimeout(silence_timeout)
            while True:
                msg = _read_event(reader)
                if msg.get("event") == "done":
                    result: dict[str, Any] = msg["result"]
                    return result
                if msg.get("event") == "error":
                    raise DaemonError(str(msg["message"]), _exit_code(msg["exit_code"]))
        except (OSError, ValueError, KeyError) as e:
            log.warning("node daemon stopped answering (%s); fetching alone", e)
            return None


def notify_hit(socket_path: Path, source: Source, pod_uid: str | None) -> None:
    """Tell the daemon about a hit, for its metrics; never waits more than 50 ms."""
    if not socket_path.exists():
        return
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.05)
        with socket_address(socket_path) as address:
            s.connect(address)
        s.sendall(request(source, pod_uid, op="hit"))


def _exit_code(value: Any) -> int:
    """The daemon's exit code; ValueError (fall back) for anything that is not a number."""
    try:
        return int(value)
    except TypeError:
        raise ValueError(f"an error event with exit code {value!r}") from None


def _read_event(reader: Any) -> dict[str, Any]:
    line = reader.readline(65536)
    if not line:
        raise ValueError("connection closed")
    try:
        msg = json.loads(line)
    except RecursionError:
        raise ValueError(f"not an event: {line[:80]!r}") from None
    if not isinstance(msg, dict):
        raise ValueError(f"not an event: {line[:80]!r}")
    return msg
