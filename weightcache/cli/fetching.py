"""`fetch` (a Pod's InitContainer) and `publish`: the commands that move a revision."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from weightcache.cli.reporting import reports_errors
from weightcache.config import Capacity, OriginSettings, format_duration, parse_pod_uid
from weightcache.errors import UsageError
from weightcache.options import (
    cache_dir_option,
    converter,
    env,
    fetch_min_free_option,
    option,
    origin_settings,
    positive_duration,
    require_sha256_option,
    store_options,
)
from weightcache.progress import LOG_INTERVAL, TTY_INTERVAL, human
from weightcache.sourceurl import Source

if TYPE_CHECKING:
    from collections.abc import Callable

    from weightcache.fetch import FetchResult

log = logging.getLogger("weightcache")


@click.command()
@click.argument("source")
@cache_dir_option
@option(
    "--name",
    parse=lambda text, what: _given(text, what, "next-to-last segment"),
    help="Model name (default: SOURCE's next-to-last segment; hf://: org--repo).",
)
@option(
    "--revision",
    parse=lambda text, what: _given(text, what, "last segment"),
    help="Revision (default: SOURCE's last segment; hf://: after the @).",
)
@store_options
@require_sha256_option
@option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (path, hit, bytes_from_origin, seconds, throughput).",
)
@option(
    "--pod-uid",
    envvar=["POD_UID", env("pod-uid")],
    callback=converter(parse_pod_uid, "POD_UID"),
    help="The Pod's UID (downward API); leases the revision while the Pod lives.",
)
@option(
    "--daemon/--no-daemon",
    "use_daemon",
    default=True,
    show_default=False,
    envvar=env("daemon"),
    help="Let the node daemon download when it runs (default) or fetch alone.",
)
@fetch_min_free_option
@option(
    "--progress-interval",
    parse=positive_duration,
    help=f"Seconds between progress reports (default: {format_duration(TTY_INTERVAL)} on a "
    f"TTY, else {format_duration(LOG_INTERVAL)}).",
)
@reports_errors
def fetch(
    source: str,
    cache_dir: Path,
    name: str | None,
    revision: str | None,
    as_json: bool,
    pod_uid: str | None,
    use_daemon: bool,
    min_free: Capacity,
    progress_interval: float | None,
    require_sha256: bool,
    **store: Any,
) -> None:
    """Make SOURCE ready in the cache and print its local path (InitContainer mode).

    SOURCE: s3://bucket/prefix/name/rev, /path/name/rev (or file://), https://host/path/name/rev,
    gs://bucket/prefix/name/rev, az://container/prefix/name/rev, hf://org/repo@revision.
    """
    # What a fetch imports and builds before its download starts lives on: the collector's
    # passes over it would only delay the first GET (see `uncollected`). On again, with all
    # that frozen, once the download starts (`_collect_again`).
    gc.disable()
    try:
        result = _ready(source, cache_dir, name, revision, pod_uid, use_daemon, min_free,
                        progress_interval, require_sha256, store)  # fmt: skip
        if as_json:
            click.echo(json.dumps(result.to_dict()))
        else:
            click.echo(result.path)
    finally:
        # The process ends here, and the Pod's containers wait for it: its teardown's
        # garbage collection need not traverse every object made so far (measured: 15-40
        # ms less).
        _collect_again()


def _given(text: str, what: str, default: str) -> str:
    """A --name or --revision that says something: `--revision "$UNSET"` falling back to
    SOURCE's segment would fetch another revision than the one the caller meant."""
    if not text.strip():
        raise UsageError(f"{what} is empty; give a value, or omit {what} to take SOURCE's "
                         f"{default}")  # fmt: skip
    return text


def _collect_again() -> None:
    """The collector on again, what was made so far frozen (never traversed again)."""
    gc.freeze()
    gc.enable()


def _ready(
    source: str,
    cache_dir: Path,
    name: str | None,
    revision: str | None,
    pod_uid: str | None,
    use_daemon: bool,
    min_free: Capacity,
    progress_interval: float | None,
    require_sha256: bool,
    store: dict[str, Any],
) -> FetchResult:
    """The revision made ready (a hit, or a miss fetched): its FetchResult. With
    `require_sha256`, SourceError unless a sha256 verified every file, however it came."""
    from weightcache.cache.layout import Layout, check_revision
    from weightcache.fetch import check_hit

    src = Source.parse(source, name, revision)
    settings = origin_settings(store)
    if not src.pinned:  # an hf:// branch or tag: its commit is the cache's revision
        from weightcache.fetch import resolve

        src = resolve(src, settings.timeout)
    check_revision(src.name, src.revision)
    layout = Layout.open(cache_dir)
    result = check_hit(layout, src, pod_uid)
    if result is not None and use_daemon and layout.socket.exists():
        from weightcache.daemon.fetchsocket import notify_hit  # imports socket: only on this path

        notify_hit(layout.socket, src, pod_uid)
    if result is None:
        result = _fetch_miss(layout, settings, src, pod_uid, use_daemon, min_free,
                             progress_interval, require_sha256)  # fmt: skip
    if require_sha256:  # a hit, or the daemon's fetch, knew nothing of this policy
        from weightcache.fetch import refuse_unless_sha256

        refuse_unless_sha256(layout, src)
    return result


def _fetch_miss(
    layout: Any,
    settings: OriginSettings,
    src: Source,
    pod_uid: str | None,
    use_daemon: bool,
    min_free: Capacity,
    progress_interval: float | None,
    require_sha256: bool,
) -> FetchResult:
    from weightcache.cache.alone import registered
    from weightcache.daemon.fetchsocket import ask_daemon
    from weightcache.fetch import Fetcher, FetchResult
    from weightcache.progress import Progress

    if use_daemon:
        answer = ask_daemon(layout.socket, src, pod_uid)
        if answer is not None:
            answer.pop("throughput", None)
            # Our mount of the cache, not the daemon's: they may differ (initcontainer/).
            answer["path"] = str(layout.revision_dir(src.name, src.revision))
            return FetchResult(**answer)
    if layout.read_only:
        raise _read_only_miss(layout, src, use_daemon)
    progress = Progress(src.label, 0, interval=progress_interval, started=_collect_again)
    # No peers: every GET is origin.
    fetcher = Fetcher(
        layout, settings, observer=progress, reserve=_keep_free(layout, src, min_free)
    )
    # SIGTERM (the kubelet deleting the Pod): the downloads stop after their current read,
    # the part states are saved, and the fetch says so on its way out (exit 143).
    import signal

    from weightcache.cli.signals import calling_on

    # Fetching alone: the node daemon counts us through the cache dir (design §6).
    try:
        with (
            calling_on((signal.SIGTERM,), fetcher.interrupt),
            registered(
                layout,
                src.name,
                src.revision,
                lambda: progress.inflight,
                lambda: progress.throttles,
            ),
        ):
            return fetcher.fetch(src, pod_uid, require_sha256)
    finally:
        progress.close()


def _keep_free(layout: Any, src: Source, min_free: Capacity) -> Callable[[int], None]:
    """The Fetcher's `reserve` for a fetch alone: nothing evicts for it, so a download
    that would leave less than --min-free free on the cache disk is NoSpaceError (exit 5)
    before its first byte."""
    from weightcache.errors import NoSpaceError

    def reserve(need: int) -> None:
        size, free = layout.disk_space()
        floor = min_free.resolve(size)
        if floor and free - need < floor:
            raise NoSpaceError(
                f"{src.label} needs {human(need)} but the cache disk at {layout.root} has "
                f"{human(free)} free and --min-free keeps {human(floor)} of it free; nothing "
                "evicts for a fetch alone: free space on the disk (weightcache gc), lower "
                "--min-free, or let the node daemon fetch it"
            )

    return reserve


def _read_only_miss(layout: Any, src: Source, use_daemon: bool) -> UsageError:
    """A miss on a read-only cache (the Pods' mount, initcontainer/): only the node daemon
    can bring the revision in."""
    why = "--no-daemon was given" if not use_daemon else (
        f"no node daemon answers on {layout.socket}")  # fmt: skip
    return UsageError(
        f"{src.label} is not in the cache at {layout.root}, which is mounted read-only, and "
        f"{why}: a read-only cache fetches only through the daemon; start the weightcache "
        "DaemonSet on this node, or mount the cache read-write (initcontainer/components/"
        "read-write)"
    )


@click.command()
@click.argument("local_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dest")
@option("--force", is_flag=True,
        help="Replace a revision already published with other content (nodes that cached "
        "it keep serving its old bytes: publish to a new revision instead).")  # fmt: skip
@store_options
@reports_errors
def publish(local_dir: Path, dest: str, force: bool, **store: Any) -> None:
    """Hash LOCAL_DIR and upload it with its SHA256SUMS to DEST (s3://bucket/prefix/name/rev).

    LOCAL_DIR is only read. A Hugging Face snapshot folder (.../snapshots/<commit>) works:
    its links into the repo's blobs/ are followed. DEST already published with this
    content is left as it is; with other content it is refused without --force.
    """
    from weightcache.ops.publish import publish as do_publish

    do_publish(local_dir, Source.parse(dest), origin_settings(store), force)
    click.echo(dest.rstrip("/"))


@click.command()
@click.argument("source")
@option("--write", is_flag=True, help="Put the manifest at SOURCE/SHA256SUMS (one PUT).")
@option("--force", is_flag=True, help="With --write: replace a SHA256SUMS that differs.")
@store_options
@reports_errors
def manifest(source: str, write: bool, force: bool, **store: Any) -> None:
    """Hash every file under SOURCE (any source `fetch` takes) where it is, with parallel
    ranged reads and no local copy, and print its SHA256SUMS; --write puts it there instead
    (s3:// and gs://).

    Memory: at most --max-concurrency buffers of --part-size (256MiB by default).
    """
    from weightcache.ops.manifest import manifest as make

    data = make(source, origin_settings(store), write, force)
    if not write:
        click.echo(data, nl=False)
