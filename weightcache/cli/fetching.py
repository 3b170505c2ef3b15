"""`fetch` (a Pod's InitContainer) and `publish`: the commands that move a revision."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from weightcache.cli.reporting import reports_errors
from weightcache.config import Capacity, format_duration, parse_pod_uid
from weightcache.errors import UsageError
from weightcache.ops.fetching import FetchSettings, ready
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
from weightcache.progress import LOG_INTERVAL, TTY_INTERVAL
from weightcache.sourceurl import Source

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

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
        src = Source.parse(source, name, revision)
        settings = FetchSettings(
            cache_dir=cache_dir,
            origin=origin_settings(store),
            pod_uid=pod_uid,
            use_daemon=use_daemon,
            min_free=min_free,
            progress_interval=progress_interval,
            require_sha256=require_sha256,
        )
        result = ready(src, settings, started=_collect_again, interrupts=_on_sigterm)
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


def _on_sigterm(stop: Callable[[], None]) -> AbstractContextManager[object]:
    """SIGTERM (the kubelet deleting the Pod): the downloads stop after their current read,
    the part states are saved, and the fetch says so on its way out (exit 143)."""
    import signal

    from weightcache.cli.signals import calling_on

    return calling_on((signal.SIGTERM,), stop)


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
