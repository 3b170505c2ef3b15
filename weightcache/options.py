"""Every command-line option shared by several commands, and the settings built from them.

Design §2: every option also reads WEIGHTCACHE_<OPTION> from the environment; sizes, rates,
durations and addresses are parsed (and rejected with a clear message, exit 2) here, once.
A default is stated once, in weightcache/config.py, by the settings it feeds, and
shown in --help from there. Each settings object has one builder here (`origin_settings`,
`peer_settings`, `daemon_settings`) that pops its options out of a command's keyword
arguments: the commands build settings only through them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import click

from weightcache.config import (
    DEFAULT_PEER_UPLOAD_LIMIT,
    DEFAULT_PEER_VIEW,
    HIGH_WATERMARK,
    INTERVAL,
    KUBELET_PODS_DIR,
    LOW_WATERMARK,
    MIN_FREE,
    Capacity,
    OriginSettings,
    PeerSettings,
    check_concurrency,
    check_endpoint_url,
    check_part_size,
    check_peer_token,
    format_duration,
    format_size,
    parse_duration,
    parse_hostport,
    parse_rate,
    parse_size,
    positive,
)
from weightcache.errors import UsageError

if TYPE_CHECKING:
    from weightcache.cache.eviction import Watermarks
    from weightcache.daemon.daemon import DaemonSettings

F = TypeVar("F", bound=Callable[..., Any])


class Option(Protocol):
    """A click option decorator: it keeps the decorated function's type."""

    def __call__(self, fn: F, /) -> F: ...


def env(option: str) -> str:
    return "WEIGHTCACHE_" + option.upper().replace("-", "_")


def converter(parse: Callable[[Any, str], Any], what: str) -> Callable[..., Any]:
    def convert(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        try:
            return parse(value, what)
        except UsageError as e:
            raise click.BadParameter(str(e)) from e

    return convert


def option(name: str, *decls: str, parse: Callable[[Any, str], Any] | None = None,
           default: Any = None, **kw: Any) -> Option:  # fmt: skip
    """`--name`, also read from WEIGHTCACHE_NAME; `parse(text, "--name")` converts the value
    (UsageError: exit 2); a `default` is shown in --help."""
    if parse is not None:
        kw["callback"] = converter(parse, name)
    if default is not None:
        kw["default"] = default
        kw.setdefault("show_default", True)
    kw.setdefault("envvar", env(name.lstrip("-")))
    decorator: Option = click.option(name, *decls, **kw)
    return decorator


def _all(fn: F, options: list[Option]) -> F:
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _listen_address(text: str, what: str) -> tuple[str, int]:
    """A HOST:PORT to listen on: port 0 is any free one, no host every interface."""
    return parse_hostport(text, what, listen=True)


def _metrics_address(text: str, what: str) -> tuple[str, int]:
    """As `_listen_address`; no host is every IPv4 interface, as 0.0.0.0."""
    host, port = _listen_address(text, what)
    return host or "0.0.0.0", port


def _peer_list(text: str, what: str) -> tuple[tuple[str, int], ...]:
    return tuple(parse_hostport(p, f"{what} entry") for p in text.split(",") if p.strip())


def _parse_min_free(text: str, what: str) -> Capacity:
    """0 turns the floor off; 100% would be a floor no disk ever keeps."""
    return Capacity.parse(text, what, zero_ok=True, full_ok=False)


# Values checked here, where they enter, and not only by the settings they feed: a click
# error names the WEIGHTCACHE_* variable a bad value came from (cli/reporting.py).


def positive_duration(text: str, what: str) -> float:
    """A duration above zero: 0 would spin a loop or give up at once."""
    return positive(parse_duration(text, what), what, ", such as 5m")


def _bwlimit(text: str, what: str) -> int:
    return positive(parse_rate(text, what), what, " (omit it for none)")


def _peer_token(text: str, what: str) -> str:
    """A usable token, or "" for none given (`peer_settings` says it is needed)."""
    return check_peer_token(text, what) if text.strip() else ""


def _upload_limit(text: str, what: str) -> int:
    return positive(parse_rate(text, what), what)


def _part_size(text: str, what: str) -> int:
    return check_part_size(parse_size(text, what), what)


def _fraction(value: float, what: str) -> float:
    if not 0 < value <= 1:
        raise UsageError(f"invalid {what} {value}: it must be a fraction in (0, 1]")
    return value


class _CacheDirPath(click.Path):
    """A directory path that is not empty: `--cache-dir "$UNSET"` would be the working
    directory."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("it is empty; give the node's cache directory", param, ctx)
        return super().convert(value, param, ctx)


# -- the object store: OriginSettings ---------------------------------------------------------


def store_options(fn: F) -> F:
    """The object-store options every store-facing command shares (`origin_settings`)."""
    return _all(fn, [
        option("--endpoint-url", envvar=[env("endpoint-url"), "AWS_ENDPOINT_URL"],
               parse=check_endpoint_url, help="S3-compatible endpoint (default: the AWS chain's)."),
        option("--bwlimit", parse=_bwlimit,
               help="Bytes per second over all connections, e.g. 2G (default: none)."),
        option("--max-concurrency", type=int, parse=check_concurrency,
               default=OriginSettings.max_concurrency,
               help="Ranged GETs (publish: upload parts) in flight at most."),
        option("--part-size", parse=_part_size, default=format_size(OriginSettings.part_size),
               help="Size of each ranged GET (publish: of each upload part, 5MiB at least)."),
        option("--timeout", parse=positive_duration,
               default=format_duration(OriginSettings.timeout),
               help="Give up (exit 6) after this long with less than 1KiB from the store."),
    ])  # fmt: skip


def origin_settings(kw: dict[str, Any]) -> OriginSettings:
    """Pop the store options out of a command's keyword arguments into settings."""
    return OriginSettings(
        endpoint_url=kw.pop("endpoint_url") or None,
        bwlimit=kw.pop("bwlimit"),
        max_concurrency=kw.pop("max_concurrency"),
        part_size=kw.pop("part_size"),
        timeout=kw.pop("timeout"),
    )


# -- the node agent: DaemonSettings -----------------------------------------------------------


def cache_dir_option(fn: F) -> F:
    return option("--cache-dir", required=True, help="The node's cache directory.",
                  type=_CacheDirPath(file_okay=False, path_type=Path))(fn)  # fmt: skip


def node_options(fn: F) -> F:
    """Options shared by `daemon` and `prefetch` (`daemon_settings`)."""
    return _all(fn, [
        option("--models", "models_file", required=True,
               type=click.Path(dir_okay=False, path_type=Path),
               help="The models file (YAML: models: [{source, name, revision, pin}]), usually "
               "a mounted ConfigMap."),
        option("--high-watermark", type=float, parse=_fraction, default=HIGH_WATERMARK,
               help="Evict when usage passes this fraction of --capacity..."),
        option("--low-watermark", type=float, parse=_fraction, default=LOW_WATERMARK,
               help="...down to this fraction."),
        # Search permission is all the lease check needs (and all the node preparation
        # grants, docs/deploy.md): click's default readable check would refuse it.
        option("--kubelet-pods-dir", default=str(KUBELET_PODS_DIR),
               type=click.Path(file_okay=False, readable=False, path_type=Path),
               help="Read-only kubelet pod directories: a lease ends when its Pod's "
               "directory is gone."),
        min_free_option,
        require_sha256_option,
    ])  # fmt: skip


def serving_options(fn: F) -> F:
    """What only the long-running `daemon` takes besides `node_options` and `peer_options`."""
    return _all(fn, [
        option("--metrics-addr", parse=_metrics_address, default="0.0.0.0:9402",
               help="HOST:PORT for /metrics, /healthz and /readyz ([::]:9402 for IPv6)."),
        option("--node-name",
               help="Label this node weightcache.io/<name>=<revision> when ready (needs RBAC)."),
        option("--interval", parse=positive_duration, default=format_duration(INTERVAL),
               help="How often to check the models file, leases and capacity."),
    ])  # fmt: skip


def require_sha256_option(fn: F) -> F:
    """--require-sha256: only bytes a sha256 verified (fetch, daemon, prefetch)."""
    return option(
        "--require-sha256", is_flag=True,
        help="Refuse a revision whose files a SHA256SUMS or a sha256 of their store does not "
        "verify: a CRC32, CRC32C, CRC64, MD5 or SHA-1 the store vouches with catches "
        "accidents, not a forged object (exit 3).",
    )(fn)  # fmt: skip


def min_free_option(fn: F) -> F:
    """--min-free: the floor of free disk space the cache never takes (daemon, prefetch, gc)."""
    return option(
        "--min-free", parse=_parse_min_free, default=str(MIN_FREE),
        help="Free space to keep on the cache's disk, counting every file on it: bytes "
        "(100G) or percent of the filesystem; the cache evicts to keep it, and a download "
        "that cannot is exit 5. The default stays above the kubelet's image garbage "
        "collection (85% used) and Pod eviction (10-15% free) on a shared disk. 0 turns "
        "it off.",
    )(fn)  # fmt: skip


def fetch_min_free_option(fn: F) -> F:
    """--min-free for `fetch` downloading alone: off unless given, since a workstation's
    disk is its own; the manifests pass the node's floor (the daemon's default)."""
    return option(
        "--min-free", parse=_parse_min_free, default="0",
        help="When fetching alone (no daemon), refuse (exit 5) a download that would leave "
        "less than this free on the cache's disk, counting every file on it: bytes (100G) "
        f"or percent of the filesystem. Nothing evicts for a fetch alone. Default 0 (off); "
        f"on a node, pass the daemon's ({MIN_FREE}).",
    )(fn)  # fmt: skip


def capacity_option(required: bool, help: str) -> Option:
    return option("--capacity", parse=lambda text, _: Capacity.parse(text), required=required,
                  help=help)  # fmt: skip


def watermarks(high: float, low: float) -> Watermarks:
    from weightcache.cache.eviction import Watermarks  # sqlite3 and the store: not on a hit

    try:
        return Watermarks(high, low)
    except ValueError as e:
        raise UsageError(
            f"invalid watermarks: --low-watermark {low} is above --high-watermark {high}; "
            "evicting stops at the low one, so it must not be above the high one"
        ) from e


def daemon_settings(kw: dict[str, Any]) -> DaemonSettings:
    """Pop the node options (`node_options`, `--capacity`; for `daemon` also
    `serving_options`, `--allow-source` and `peer_options`) out of a command's keyword
    arguments into settings; what `prefetch` does not take keeps its default."""
    from weightcache.daemon.daemon import DaemonSettings  # the daemon's imports: not on a hit

    return DaemonSettings(
        models_file=kw.pop("models_file"),
        capacity=kw.pop("capacity"),
        min_free=kw.pop("min_free"),
        watermarks=watermarks(kw.pop("high_watermark"), kw.pop("low_watermark")),
        kubelet_pods_dir=kw.pop("kubelet_pods_dir"),
        metrics_addr=kw.pop("metrics_addr", None),
        interval=kw.pop("interval", INTERVAL),
        node_name=kw.pop("node_name", None),
        allow_sources=kw.pop("allow_sources", None),
        require_sha256=kw.pop("require_sha256"),
        peer=peer_settings(kw),
    )


# -- peers: PeerSettings ----------------------------------------------------------------------


def peer_options(fn: F) -> F:
    """Peer-to-peer between node daemons (design §8); off unless --peer-addr is given."""
    return _all(fn, [
        option("--peer-addr", parse=_listen_address,
               help="HOST:PORT to serve blobs to the other nodes' daemons, and fetch from "
               "them ([::]:9401 for IPv6)."),
        option("--peer-token", parse=_peer_token,
               help="Secret every peer request must carry (required with --peer-addr); set "
               "WEIGHTCACHE_PEER_TOKEN from a Secret rather than putting it on the command "
               "line."),
        option("--peer-upload-limit", parse=_upload_limit,
               default=format_size(DEFAULT_PEER_UPLOAD_LIMIT),
               help="Bytes per second served to peers, all together."),
        option("--peers", "peer_list", parse=_peer_list,
               help="Static peers HOST:PORT,... (tests, small clusters); this node's own is "
               "skipped."),
        option("--peer-service", parse=parse_hostport,
               help="NAME:PORT of the headless Service whose DNS addresses are the peers."),
        option("--peer-view", type=click.IntRange(min=1), default=DEFAULT_PEER_VIEW,
               help="Peers whose pieces a download watches at most: a random sample when "
               "there are more (a HEAD of each twice a second)."),
    ])  # fmt: skip


def peer_settings(kw: dict[str, Any]) -> PeerSettings | None:
    """Pop the peer options out of a command's keyword arguments into settings; None when
    --peer-addr is not given (or the command has no peer options)."""
    addr, token = kw.pop("peer_addr", None), kw.pop("peer_token", None)
    limit, static, service = (kw.pop(k, None) for k in (
        "peer_upload_limit", "peer_list", "peer_service"))  # fmt: skip
    view = kw.pop("peer_view", None)
    view = DEFAULT_PEER_VIEW if view is None else view
    if addr is None:
        if static or service:
            raise UsageError("--peers and --peer-service need --peer-addr to be set")
        return None
    if not token:
        raise UsageError(
            "--peer-addr needs --peer-token (set WEIGHTCACHE_PEER_TOKEN from a Secret): "
            "without it anyone who reaches the port could read the cache"
        )
    return PeerSettings(listen=addr, token=token.strip(), upload_limit=limit,
                        static=static or (), service=service, view=view)  # fmt: skip
