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


def parse_rate(text: str, what: str = "rate") -> int:
    """`2G` or `2G/s` -> bytes per second."""
    return parse_size(str(text).removesuffix("/s"), what)


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
        return cls(bytes=size)

    def __str__(self) -> str:
        """As `parse` reads it back: `85%` or `500GiB`."""
        return f"{self.percent:g}%" if self.percent is not None else format_size(self.bytes or 0)

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


#: The schemes a source may have; a plain absolute path is a `file://` source.
SCHEMES = ("s3", "file", "gs", "az", "abfs", "hf", "http", "https")
_S3 = r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])"
#: A GCS bucket name: 3-63 characters, or up to 222 in dotted (domain) names.
_GS = r"gs://([a-z0-9][a-z0-9._\-]{1,220}[a-z0-9])"
# Azure: a container name (3-63 of a-z 0-9 -, no "--"), abfs:// with its account's host.
_CONTAINER = r"[a-z0-9](?:[a-z0-9]|-(?!-)){1,61}[a-z0-9]"
_AZURE = (
    ("az", rf"az://({_CONTAINER})"),
    ("abfs", rf"abfs://({_CONTAINER}@[a-z0-9]{{3,24}}\.dfs\.core\.windows\.net)"),
)
#: http(s)://host[:port]: no user:password@ (a marker would record it), no query, no fragment.
_HTTP = r"(https?)://([A-Za-z0-9.\-]+(?::\d{1,5})?|\[[0-9A-Fa-f:.]+\](?::\d{1,5})?)(/[^?#]*)?"
_SOURCE_FORMS = (
    "s3://bucket/prefix/<name>/<revision>, gs://bucket/prefix/<name>/<revision>, "
    "az://container/prefix/<name>/<revision>, "
    "abfs://container@account.dfs.core.windows.net/prefix/<name>/<revision>, "
    "https://host/path/<name>/<revision>, file:///path/<name>/<revision>, "
    "/path/<name>/<revision> or hf://org/repo@revision"
)
# Patterns used only by some commands or sources are kept as text and compiled on first
# use (re caches them): compiling them all at import delayed every fetch (design §4).
#: A Hub repository's owner or name (the Hub's own rule: letters, digits, . _ -, not
#: starting or ending with . or -, no `--` or `..`).
_HUB_PART = r"(?!.*(--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
#: A full git commit id: the only Hub revision that names one content for good.
HUB_COMMIT = r"[0-9a-f]{40}"


def _split_source(text: str) -> tuple[str, str, str] | None:
    """(scheme, bucket, path) of a source or prefix URL, or None if it is none of the forms;
    the path is "" or starts with "/". A `file://` URL and a plain absolute path are the
    same source, of bucket "". The callers split the path and refuse bad segments."""
    text = text.strip()
    m = re.fullmatch(_S3 + r"(/.*)?", text)
    if m is not None:
        return "s3", m.group(1), m.group(2) or ""
    m = re.fullmatch(_GS + r"(/.*)?", text)
    if m is not None:
        return "gs", m.group(1), m.group(2) or ""
    for scheme, pattern in _AZURE:
        m = re.fullmatch(pattern + r"(/.*)?", text)
        if m is not None:
            return scheme, m.group(1), m.group(2) or ""
    if text.startswith("hf://"):
        return "hf", "", "/" + text[len("hf://") :]
    m = re.fullmatch(_HTTP, text)
    if m is not None:  # the host (and port) is the bucket
        return m.group(1), m.group(2).lower(), m.group(3) or ""
    if text.startswith("file://"):
        text = text[len("file://") :]  # file://host/... has no leading slash: refused below
    if not text.startswith("/"):
        return None
    return "file", "", text


def _bad_segment(segments: list[str] | tuple[str, ...]) -> bool:
    return any(s in ("", ".", "..") or "\0" in s for s in segments)


@dataclass(frozen=True)
class Source:
    """A model revision at its origin: s3://bucket/prefix/<name>/<revision> (gs:// alike),
    an Azure container's az://container/... or abfs://container@account.dfs.core.windows.net/...
    (bucket: the part before the first slash), http(s)://host[:port]/path/<name>/<revision>
    (bucket the host and port, lowercased), a directory on a mounted filesystem,
    file:///path/<name>/<revision> (bucket "", `prefix` the path without its leading
    slash), or a model repository of the Hugging Face Hub, hf://org/repo@revision (bucket
    "", `prefix` the repo id, name `org--repo`, revision the branch, tag or commit:
    `resolve` pins it to its commit before the cache is looked at). Design §4, Revision
    sources."""

    bucket: str
    prefix: str  # key prefix (or path) of the revision, no leading or trailing slash
    name: str
    revision: str
    scheme: str = "s3"

    @classmethod
    def parse(cls, url: str, name: str | None = None, revision: str | None = None) -> Source:
        """Raises UsageError for anything but the forms above, and for a path with an
        empty, `.` or `..` segment (the same rules for every scheme)."""
        split = _split_source(url)
        if split is not None and split[0] == "hf":
            return cls._parse_hub(url, split[2][1:], name, revision)
        segments = split[2][1:].rstrip("/").split("/") if split else []
        if split is None or len(segments) < 2 or _bad_segment(segments):
            raise UsageError(f"invalid source {url!r}: expected {_SOURCE_FORMS}")
        return cls(
            bucket=split[1],
            prefix="/".join(segments),
            name=name or segments[-2],
            revision=revision or segments[-1],
            scheme=split[0],
        )

    @classmethod
    def _parse_hub(cls, url: str, path: str, name: str | None, revision: str | None) -> Source:
        """hf://org/repo[@revision]: the revision is `revision`, else the URL's, else main."""
        repo, _, ref = path.partition("@")
        parts = repo.rstrip("/").split("/")
        ref = revision or ref or "main"
        if len(parts) != 2 or not all(re.fullmatch(_HUB_PART, p) for p in parts) or (
            not ref.isprintable() or " " in ref or ".." in ref.split("/")
        ):  # fmt: skip
            raise UsageError(
                f"invalid source {url!r}: expected hf://org/repo@revision (a branch, a tag or "
                "a commit; main if omitted), such as hf://Qwen/Qwen3-8B@main"
            )
        return cls("", "/".join(parts), name or "--".join(parts), ref, "hf")

    @property
    def pinned(self) -> bool:
        """Whether the revision names one content for good: always, except an hf:// branch
        or tag (a full commit id is pinned), which `fetch.revision.resolve` pins."""
        return self.scheme != "hf" or re.fullmatch(HUB_COMMIT, self.revision) is not None

    @property
    def url(self) -> str:
        """The canonical URL (what markers record): a plain path reads as file:///path."""
        if self.scheme == "hf":
            return f"hf://{self.prefix}@{self.revision}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}"

    @property
    def label(self) -> str:
        return f"{self.name}/{self.revision}"

    def key(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}"


@dataclass(frozen=True, order=True)
class SourcePrefix:
    """A bucket and key prefix (or a directory) the node daemon may fetch under for Pods
    (`--allow-source`).

    Matching is by scheme and whole path segments: s3://models/team covers
    s3://models/team/llama/v1, never s3://models/teamB/llama/v1 nor file:///models/team/...
    (design §5, who may ask: else the socket is a confused deputy).
    """

    bucket: str
    segments: tuple[str, ...] = ()  # () covers the whole bucket
    scheme: str = "s3"

    @classmethod
    def parse(cls, text: str, what: str = "--allow-source") -> SourcePrefix:
        """`s3://bucket`, `s3://bucket/a/b/` (gs:// alike), `file:///mnt/models`, `/mnt/models`,
        `https://host[:port]/a/b` (a whole host: `https://host`), `az://container/a`,
        `hf://org` or `hf://org/repo` (every revision). Raises UsageError; a file prefix
        must name a directory below the root."""
        split = _split_source(str(text))
        segments = tuple(split[2].strip("/").split("/")) if split else ()
        if segments == ("",) and split and split[0] != "file":
            segments = ()
        hub_bad = bool(split and split[0] == "hf" and (len(segments) > 2 or "@" in text))
        if split is None or _bad_segment(segments) or hub_bad:
            raise UsageError(
                f"invalid {what} {text!r}: expected s3://bucket or s3://bucket/prefix, "
                "gs://bucket/prefix, az://container/prefix, https://host/path, "
                "file:///directory, or hf://org or hf://org/repo, such as s3://models/team-a, "
                "file:///mnt/models, https://models.example.com/team-a or hf://Qwen"
            )
        return cls(split[1], segments, split[0])

    @classmethod
    def parent_of(cls, source: Source) -> SourcePrefix:
        """The source URL without its last segment: every revision of a listed model (an
        hf:// source's repository)."""
        keep = None if source.scheme == "hf" else -1
        return cls(source.bucket, tuple(source.prefix.split("/"))[:keep], source.scheme)

    def covers(self, source: Source) -> bool:
        parts = tuple(source.prefix.split("/"))
        return (source.scheme, source.bucket) == (self.scheme, self.bucket) and parts[
            : len(self.segments)
        ] == self.segments

    def __str__(self) -> str:
        if self.scheme == "hf":
            return "hf://" + "/".join(self.segments)
        return "/".join((f"{self.scheme}://{self.bucket}", *self.segments))


def parse_allow_sources(
    values: tuple[str, ...], what: str = "--allow-source"
) -> tuple[SourcePrefix, ...] | None:
    """The daemon's `--allow-source` values; None when none is given (the default then
    comes from the models file). Raises UsageError."""
    if not values:
        return None
    return tuple(sorted({SourcePrefix.parse(v, what) for v in values}))


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
    if not (ok and port.isdigit() and low <= int(port) <= 65535 and (host or listen)):
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
