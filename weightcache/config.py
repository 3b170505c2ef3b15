"""Settings: built once from the CLI options, frozen, validated at construction.

Units are explicit: sizes in bytes, rates in bytes per second, durations in seconds.
Binary suffixes (`K`, `M`, `G`, `T`, with or without `iB`) are powers of 1024, as in
rclone and s5cmd; `KB`, `MB`, `GB`, `TB` are powers of 1000.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightcache.errors import UsageError

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


@dataclass(frozen=True)
class Capacity:
    """A cache bound: absolute bytes, or a percentage of the cache filesystem."""

    bytes: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str) -> Capacity:
        text = str(text).strip()
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                pct = -1.0
            if not 0 < pct <= 100:
                raise UsageError(f"invalid capacity {text!r}: a percentage must be in (0, 100]")
            return cls(percent=pct)
        size = parse_size(text, "capacity")
        if size <= 0:
            raise UsageError(f"invalid capacity {text!r}: it must be more than zero")
        return cls(bytes=size)

    def resolve(self, filesystem_bytes: int) -> int:
        """The bound in bytes, given the size of the cache filesystem."""
        if self.bytes is not None:
            return self.bytes
        assert self.percent is not None
        return int(filesystem_bytes * self.percent / 100)


@dataclass(frozen=True)
class StoreSettings:
    """How weightcache talks to the object store (every store-facing command takes these)."""

    #: None: the AWS chain decides (AWS_ENDPOINT_URL, config), else AWS S3 itself.
    endpoint_url: str | None = None
    #: Bytes per second over all connections of the process; None = unlimited.
    bwlimit: int | None = None
    #: Upper bound on ranged GETs in flight. 16 saturates a 25 Gbps NIC with 16 MiB parts
    #: on S3-class latency while staying far below the per-prefix request limits.
    max_concurrency: int = 16
    #: Ranged GET size. 16 MiB measured best on SeaweedFS (benchmarks/), within the
    #: 8-64 MiB range of SPEC §4; small enough that a retried part costs little.
    part_size: int = 16 << 20
    #: Give up (exit 6) when no byte has arrived from the store for this many seconds.
    timeout: float = 300.0
    #: Attempts per request before a transient failure is final.
    max_attempts: int = 8

    def __post_init__(self) -> None:
        if self.endpoint_url is not None and not re.match(r"https?://", self.endpoint_url):
            raise UsageError(
                f"invalid endpoint URL {self.endpoint_url!r}: it must start with http:// "
                "or https://"
            )
        if self.bwlimit is not None and self.bwlimit <= 0:
            raise UsageError("invalid --bwlimit: it must be more than zero (omit it for none)")
        if not 1 <= self.max_concurrency <= 1024:
            raise UsageError("invalid --max-concurrency: it must be between 1 and 1024")
        if not (256 << 10) <= self.part_size <= (5 << 30):
            raise UsageError("invalid --part-size: it must be between 256KiB and 5GiB")
        if self.timeout <= 0:
            raise UsageError("invalid --timeout: it must be more than zero, such as 5m")
        if self.max_attempts < 1:
            raise UsageError("invalid attempt count: it must be at least 1")


@dataclass(frozen=True)
class Source:
    """A model revision in the object store: s3://bucket/prefix/<name>/<revision>."""

    bucket: str
    prefix: str  # key prefix of the revision, no leading or trailing slash
    name: str
    revision: str

    @classmethod
    def parse(cls, url: str, name: str | None = None, revision: str | None = None) -> Source:
        m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(.+?)/*", url.strip())
        segments = m.group(2).split("/") if m else []
        if m is None or len(segments) < 2 or any(s in ("", ".", "..") for s in segments):
            raise UsageError(
                f"invalid source {url!r}: expected s3://bucket/prefix/<name>/<revision>"
            )
        return cls(
            bucket=m.group(1),
            prefix="/".join(segments),
            name=name or segments[-2],
            revision=revision or segments[-1],
        )

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def label(self) -> str:
        return f"{self.name}/{self.revision}"

    def key(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}"
