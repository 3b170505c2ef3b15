"""Every command-line option shared by several commands, with its WEIGHTCACHE_* variable.

Design §2: every option also reads WEIGHTCACHE_<OPTION> from the environment; sizes,
rates and durations are parsed (and rejected with a clear message, exit 2) here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from weightcache.config import (
    Capacity,
    OriginSettings,
    parse_duration,
    parse_rate,
    parse_size,
)
from weightcache.errors import UsageError

F = TypeVar("F", bound=Callable[..., Any])


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


def store_options(fn: F) -> F:
    """The object-store options every store-facing command shares."""
    options = [
        click.option(
            "--endpoint-url",
            envvar=[env("endpoint-url"), "AWS_ENDPOINT_URL"],
            help="S3-compatible endpoint (default: the AWS chain's).",
        ),
        click.option(
            "--bwlimit",
            envvar=env("bwlimit"),
            callback=converter(parse_rate, "--bwlimit"),
            help="Bytes per second over all connections, e.g. 2G (default: none).",
        ),
        click.option(
            "--max-concurrency",
            envvar=env("max-concurrency"),
            type=int,
            default=OriginSettings.max_concurrency,
            show_default=True,
            help="Ranged GETs in flight at most.",
        ),
        click.option(
            "--part-size",
            envvar=env("part-size"),
            default="16MiB",
            show_default=True,
            callback=converter(parse_size, "--part-size"),
            help="Size of each ranged GET.",
        ),
        click.option(
            "--timeout",
            envvar=env("timeout"),
            default="5m",
            show_default=True,
            callback=converter(parse_duration, "--timeout"),
            help="Give up (exit 6) after this long without a byte from the store.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def cache_dir_option(fn: F) -> F:
    return click.option(
        "--cache-dir",
        envvar=env("cache-dir"),
        required=True,
        type=click.Path(file_okay=False, path_type=Path),
        help="The node's cache directory.",
    )(fn)


def settings_from(kw: dict[str, Any]) -> OriginSettings:
    """Pop the store options out of a command's keyword arguments into settings."""
    return OriginSettings(
        endpoint_url=kw.pop("endpoint_url") or None,
        bwlimit=kw.pop("bwlimit"),
        max_concurrency=kw.pop("max_concurrency"),
        part_size=kw.pop("part_size"),
        timeout=kw.pop("timeout"),
    )


def node_options(fn: F) -> F:
    """Options shared by `daemon` and `prefetch`."""
    options = [
        click.option(
            "--models",
            "models_file",
            envvar=env("models"),
            required=True,
            type=click.Path(dir_okay=False, path_type=Path),
            help="The models file (YAML: models: [{source, name, revision, pin}]), usually "
            "a mounted ConfigMap.",
        ),
        click.option(
            "--high-watermark",
            envvar=env("high-watermark"),
            type=float,
            default=0.95,
            show_default=True,
            help="Evict when usage passes this fraction of --capacity...",
        ),
        click.option(
            "--low-watermark",
            envvar=env("low-watermark"),
            type=float,
            default=0.85,
            show_default=True,
            help="...down to this fraction.",
        ),
        click.option(
            "--kubelet-pods-dir",
            envvar=env("kubelet-pods-dir"),
            default="/var/lib/kubelet/pods",
            show_default=True,
            # Search permission is all the lease check needs (and all the node preparation
            # grants, docs/deploy.md): click's default readable check would refuse it.
            type=click.Path(file_okay=False, readable=False, path_type=Path),
            help="Read-only kubelet pod directories: a lease ends when its Pod's "
            "directory is gone.",
        ),
        min_free_option,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def peer_options(fn: F) -> F:
    """Peer-to-peer between node daemons (design §8); off unless --peer-addr is given."""
    options = [
        click.option(
            "--peer-addr",
            envvar=env("peer-addr"),
            help="HOST:PORT to serve blobs to the other nodes' daemons, and fetch from them.",
        ),
        click.option(
            "--peer-token",
            envvar=env("peer-token"),
            help="Secret every peer request must carry (required with --peer-addr); set "
            "WEIGHTCACHE_PEER_TOKEN from a Secret rather than putting it on the command line.",
        ),
        click.option(
            "--peer-upload-limit",
            envvar=env("peer-upload-limit"),
            default="1G",
            show_default=True,
            callback=converter(parse_rate, "--peer-upload-limit"),
            help="Bytes per second served to peers, all together.",
        ),
        click.option(
            "--peers",
            "peer_list",
            envvar=env("peers"),
            help="Static peers HOST:PORT,... (tests, small clusters); this node's own is skipped.",
        ),
        click.option(
            "--peer-service",
            envvar=env("peer-service"),
            help="NAME:PORT of the headless Service whose DNS addresses are the peers.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _parse_min_free(text: str, what: str) -> Capacity:
    return Capacity.parse(text, what, zero_ok=True)


def min_free_option(fn: F) -> F:
    """--min-free: the floor of free disk space the cache never takes (daemon, prefetch, gc)."""
    return click.option(
        "--min-free",
        envvar=env("min-free"),
        default="20%",
        show_default=True,
        callback=converter(_parse_min_free, "--min-free"),
        help="Free space to keep on the cache's disk, counting every file on it: bytes "
        "(100G) or percent of the filesystem; the cache evicts to keep it, and a download "
        "that cannot is exit 5. The default stays above the kubelet's image garbage "
        "collection (85% used) and Pod eviction (10-15% free) on a shared disk. 0 turns "
        "it off.",
    )(fn)


def capacity_option(required: bool, help: str) -> Callable[[F], F]:
    return click.option(
        "--capacity",
        envvar=env("capacity"),
        required=required,
        callback=converter(lambda text, _: Capacity.parse(text), "--capacity"),
        help=help,
    )
