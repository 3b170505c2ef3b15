"""Settings: built once from the CLI options, frozen, validated at construction.

Units are explicit: sizes in bytes, rates in bytes per second, durations in seconds.
Binary suffixes (`K`, `M`, `G`, `T`, with or without `iB`) are powers of 1024, as in
rclone and s5cmd; `KB`, `MB`, `GB`, `TB` are powers of 1000.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from weightcache.errors import UsageError

_N = TypeVar("_N", int, float)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "ti": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_DURATIONS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}
_NUMBER = r"\s*(\d+(?:\.\d+)?)\s*"


def is_digits(text: str) -> bool:
    """Only ASCII digits: what int() takes back. str.isdigit() also says yes to `²`, which
    int() refuses (a server's header holding one ended a fetch in a traceback)."""
    return text.isascii() and text.isdigit()


def parse_size(text: str, what: str = "size") -> int:
    """`2G`, `500MiB`, `1.5GB`, `4096` -> bytes. Raises UsageError."""
    m = re.fullmatch(_NUMBER + r"([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise UsageError(
            f"invalid {what} {text!r}: use a number of bytes with an optional unit, "
            "such as 8M, 500MiB or 2G"
        )
    return int(float(m.group(1)) * _UNITS[unit])


#: Bit rates, spelt out as bits (`2Gbit`, `100Mbps`): powers of 1000, as links are sold.
_BIT_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BITS = re.compile(_NUMBER + r"([kmgt]?)(?:bit|bps)\s*", re.IGNORECASE)
#: `2Gb`, `100mb`, `2Gib`: a b that some read as bits and others as bytes.
_AMBIGUOUS = re.compile(_NUMBER + r"([kmgtKMGT][iI]?)b\s*")


def parse_rate(text: str, what: str = "rate") -> int:
    """`2G`, `2G/s`, `2GB/s` -> bytes per second; `2Gbit`, `2Gbit/s`, `2Gbps` -> bits per
    second, in bytes. Refuses a lowercase b after a prefix (`2Gb`) as ambiguous."""
    body = str(text).removesuffix("/s")
    bits = _BITS.fullmatch(body)
    if bits is not None:
        return int(float(bits.group(1)) * _BIT_PREFIXES[bits.group(2).lower()]) // 8
    ambiguous = _AMBIGUOUS.fullmatch(body)
    if ambiguous is not None:
        n, prefix = ambiguous.group(1), ambiguous.group(2)[0].upper()
        raise UsageError(
            f"invalid {what} {text!r}: ambiguous, {prefix}b may mean bits or bytes; write "
            f"{n}{prefix}B or {n}{prefix}iB for bytes per second, {n}{prefix}bit for bits"
        )
    return parse_size(body, what)


def parse_duration(text: str, what: str = "duration") -> float:
    """`30s`, `10m`, `1h`, `250ms`, `5` -> seconds. Raises UsageError."""
    m = re.fullmatch(_NUMBER + r"(ms|s|m|h|)\s*", str(text))
    if m is None:
        raise UsageError(f"invalid {what} {text!r}: use a duration such as 30s, 10m or 1h")
    return float(m.group(1)) * _DURATIONS[m.group(2)]


def format_size(n: int) -> str:
    """Bytes as `parse_size` reads them back: `16MiB`, `1GiB`, or plain bytes."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def format_duration(seconds: float) -> str:
    """Seconds as `parse_duration` reads them back: `5m`, `2s`, `250ms`."""
    for unit, factor in (("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    return f"{seconds * 1000:g}ms"


@dataclass(frozen=True)
class Capacity:
    """A cache bound: absolute bytes, or a percentage of the cache filesystem."""

    bytes: int | None = None
    percent: float | None = None

    @classmethod
    def parse(
        cls, text: str, what: str = "capacity", zero_ok: bool = False, full_ok: bool = True
    ) -> Capacity:
        """`500G` or `85%`; `what` names the option in errors; `zero_ok` accepts 0 (and
        0%), for a bound that 0 turns off (--min-free); `full_ok=False` refuses 100%, for a
        floor of free space (the whole disk free can never be kept)."""
        text = str(text).strip()
        valid = ("[0, " if zero_ok else "(0, ") + ("100]" if full_ok else "100)")
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                pct = -1.0
            above_low = pct >= 0 if zero_ok else pct > 0
            if not (above_low and (pct <= 100 if full_ok else pct < 100)):
                raise UsageError(f"invalid {what} {text!r}: a percentage must be in {valid}")
            return cls(percent=pct)
        try:
            size = parse_size(text, what)
        except UsageError as e:
            raise UsageError(f"{e}, or a percentage of the cache filesystem such as 85%") from e
        if size < 0 or (size == 0 and not zero_ok):
            raise UsageError(f"invalid {what} {text!r}: it must be more than zero")
        if text.isdigit() and 0 < size <= 100:  # `--capacity 85`: surely not 85 bytes
            raise UsageError(
                f"invalid {what} {text!r}: for a percentage of the cache filesystem write "
                f"{text}%; for a size, give its unit ({text}G, or {text}B for bytes)"
            )
        return cls(bytes=size)

    def __str__(self) -> str:
        """As `parse` reads it back: `85%`, `500GiB`, `85B`."""
        if self.percent is not None:
            return f"{self.percent:g}%"
        text = format_size(self.bytes or 0)
        return f"{text}B" if text.isdigit() else text

    def resolve(self, filesystem_bytes: int) -> int:
        """The bound in bytes, given the size of the cache filesystem."""
        if self.bytes is not None:
            return self.bytes
        assert self.percent is not None
        return int(filesystem_bytes * self.percent / 100)


# -- the node daemon's defaults: its options and DaemonSettings read them from here ------------

#: The free space the cache never takes from its disk (--min-free), counting every file on
#: it. The kubelet garbage-collects images above 85% disk usage and evicts Pods below 10-15%
#: free (its defaults) on the same disk: 20% keeps the cache clear of both.
MIN_FREE = Capacity(percent=20.0)
#: The kubelet's pod directories (read-only hostPath): a lease ends when its Pod's is gone.
KUBELET_PODS_DIR = Path("/var/lib/kubelet/pods")
#: Seconds between looks at the models file, leases and capacity (--interval).
INTERVAL = 2.0
#: Evict when usage passes HIGH_WATERMARK x capacity, down to LOW_WATERMARK x capacity: the
#: gap makes eviction run in batches rather than at every download.
HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.85


@dataclass(frozen=True)
class OriginSettings:
    """How weightcache talks to the object store (every store-facing command takes these)."""

    #: None: the AWS chain decides (AWS_ENDPOINT_URL, config), else AWS S3 itself.
    endpoint_url: str | None = None
    #: Bytes per second over all connections of the process; None = unlimited.
    bwlimit: int | None = None
    #: Upper bound on ranged GETs in flight. 16 saturates a 25 Gbps NIC with 16 MiB parts
    #: on S3-class latency while staying far below the per-prefix request limits.
    max_concurrency: int = 16
    #: Ranged GET size. 16 MiB measured best on SeaweedFS (benchmarks/); small
    #: enough that a retried part costs little.
    part_size: int = 16 << 20
    #: Give up (exit 6) when no byte has arrived from the store for this many seconds.
    timeout: float = 300.0
    #: Attempts per request before a transient failure is final.
    max_attempts: int = 8

    def __post_init__(self) -> None:
        if self.endpoint_url is not None:
            check_endpoint_url(self.endpoint_url)
        if self.bwlimit is not None:
            positive(self.bwlimit, "--bwlimit", " (omit it for none)")
        check_concurrency(self.max_concurrency)
        check_part_size(self.part_size)
        positive(self.timeout, "--timeout", ", such as 5m")
        if self.max_attempts < 1:
            raise UsageError("invalid attempt count: it must be at least 1")


# The checks of OriginSettings, also run by the options where a value enters (click
# callbacks), so that a bad value from WEIGHTCACHE_* is reported naming its variable.

#: Ranged GETs of at least 256 KiB keep the request count sane; 5 GiB is S3's largest part.
MIN_PART_SIZE, MAX_PART_SIZE = 256 << 10, 5 << 30
MAX_CONCURRENCY = 1024


def check_endpoint_url(url: str, what: str = "endpoint URL") -> str:
    """`url` if it is http(s)://...; else UsageError naming `what`."""
    if not re.match(r"https?://", url):
        raise UsageError(f"invalid {what} {url!r}: it must start with http:// or https://")
    return url


def check_concurrency(n: int, what: str = "--max-concurrency") -> int:
    if not 1 <= n <= MAX_CONCURRENCY:
        raise UsageError(f"invalid {what}: it must be between 1 and {MAX_CONCURRENCY}")
    return n


def check_part_size(n: int, what: str = "--part-size") -> int:
    if not MIN_PART_SIZE <= n <= MAX_PART_SIZE:
        raise UsageError(
            f"invalid {what}: it must be between {format_size(MIN_PART_SIZE)} and "
            f"{format_size(MAX_PART_SIZE)}"
        )
    return n


def positive(value: _N, what: str, hint: str = "") -> _N:
    """`value` if above zero (a rate, a duration); else UsageError naming `what`."""
    if not value > 0:
        raise UsageError(f"invalid {what}: it must be more than zero{hint}")
    return value


def parse_hostport(text: str, what: str, listen: bool = False) -> tuple[str, int]:
    """`host:port`, `[v6]:port` -> (host, port), the host without brackets. An IPv6 address
    needs its brackets (in `fd00::1:9401` the port is ambiguous). A `listen` address may
    have port 0 (any free port) and an empty host (`:9402`, every interface). Raises
    UsageError naming `what`."""
    text = text.strip()
    if text.startswith("["):
        host, close, port = text[1:].partition("]:")
        ok = bool(close) and ":" in host
    else:
        host, _, port = text.rpartition(":")
        ok = ":" not in host
    low = 0 if listen else 1
    if not (ok and is_digits(port) and low <= int(port) <= 65535 and (host or listen)):
        raise UsageError(
            f"invalid {what} {text!r}: use HOST:PORT, such as 10.0.0.7:9401 or [fd00::7]:9401"
        )
    return host, int(port)


def format_hostport(host: str, port: int | str) -> str:
    """`host:port`, an IPv6 host in brackets: the inverse of `parse_hostport`, for
    messages and URLs (`"http://" + format_hostport(...)`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


#: A Kubernetes object UID (RFC 4122 form, as the downward API gives metadata.uid).
_POD_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def parse_pod_uid(text: str, what: str = "POD_UID") -> str:
    """A Pod UID as Kubernetes writes it (lowercase 8-4-4-4-12 hex). Raises UsageError:
    the UID names a directory under the kubelet's pods dir, so nothing else may pass."""
    uid = text.strip().lower()
    if not re.fullmatch(_POD_UID, uid):
        raise UsageError(
            f"invalid {what} {text[:80]!r}: expected a Kubernetes Pod UID such as "
            "0f6c2a4e-5b1d-4c3e-9a7f-2d8e6b1c0a94; set it from the downward API "
            "(fieldRef: metadata.uid) or leave it unset"
        )
    return uid


#: Printable ASCII without spaces (a valid header value), long enough not to be guessed.
_PEER_TOKEN = r"[\x21-\x7e]{16,}"
#: 1 GiB/s = 8.6 Gbit/s: a fraction of a GPU node's NIC, so that serving peers never starves
#: the node's own downloads and inference traffic.
DEFAULT_PEER_UPLOAD_LIMIT = 1 << 30
#: Peers a swarming node watches (HEADs twice a second) at most: a random sample of the
#: membership past that (design §8, Swarm). benchmarks/swarmsim.py at 40 to 1,000 nodes: one
#: store copy with 16 or 32, the last node ready 1-9% sooner with 16, at half the HEADs.
DEFAULT_PEER_VIEW = 16


@dataclass(frozen=True)
class PeerSettings:
    """Peer-to-peer for one daemon; the daemon runs without peers when this is None."""

    #: Where this node serves its blobs: ("0.0.0.0", 9401) in the DaemonSet.
    listen: tuple[str, int]
    #: The shared secret every peer request carries (from a Secret); 16+ printable chars.
    token: str = field(repr=False)
    #: Bytes per second uploaded to peers, all requests together; None: unlimited.
    upload_limit: int | None = DEFAULT_PEER_UPLOAD_LIMIT
    #: The other daemons as (host, port), for tests and small clusters; self is skipped.
    static: tuple[tuple[str, int], ...] = ()
    #: (DNS name, port) of the headless Service whose addresses are the daemons.
    service: tuple[str, int] | None = None
    #: Peers whose pieces one swarm download watches at most (a sample past that).
    view: int = DEFAULT_PEER_VIEW

    def __post_init__(self) -> None:
        if self.view < 1:
            raise UsageError(f"invalid --peer-view {self.view}: watch at least one peer")
        check_peer_token(self.token)
        if self.static and self.service:
            raise UsageError("use either --peers or --peer-service to find peers, not both")
        if self.upload_limit is not None:
            positive(self.upload_limit, "--peer-upload-limit")


def check_peer_token(token: str, what: str = "--peer-token") -> str:
    """`token` without surrounding blanks if it is a usable peer secret; else UsageError."""
    token = token.strip()
    if not re.fullmatch(_PEER_TOKEN, token):
        raise UsageError(
            f"invalid {what}: use at least 16 printable characters without spaces, such as "
            "the output of `openssl rand -hex 32`"
        )
    return token
