"""The node agent's commands: `prefetch` (converge once) and `daemon` (run)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from weightcache.cli.reporting import reports_errors
from weightcache.errors import UsageError, WeightcacheError
from weightcache.options import (
    cache_dir_option,
    capacity_option,
    daemon_settings,
    node_options,
    option,
    origin_settings,
    peer_options,
    serving_options,
    store_options,
)
from weightcache.sourceurl import parse_allow_sources

if TYPE_CHECKING:
    from weightcache.daemon.daemon import Daemon

log = logging.getLogger("weightcache")


def _daemon(cache_dir: Path, kw: dict[str, Any]) -> Daemon:
    """The daemon of the cache at `cache_dir`, its settings built from the options `kw`."""
    from weightcache.cache.layout import Layout
    from weightcache.daemon.daemon import Daemon

    origin, settings = origin_settings(kw), daemon_settings(kw)
    return Daemon(Layout.open(cache_dir), origin, settings)


@click.command()
@cache_dir_option
@node_options
@capacity_option(False, "Optional bound while prefetching: bytes (500G) or percent (85%).")
@store_options
@reports_errors
def prefetch(cache_dir: Path, **kw: Any) -> None:
    """Converge once to the models file, then exit 0 when every listed revision is ready."""
    daemon = _daemon(cache_dir, kw)
    daemon.load_models()  # missing or invalid: exit 2
    if not daemon.desired.models and not daemon.desired.problems:
        log.warning("the models file %s lists no models", daemon.settings.models_file)
    daemon.converge_once()
    errors: list[WeightcacheError] = [UsageError(p) for p in daemon.desired.problems]
    errors += list(daemon.failures.values())
    for spec in daemon.desired.models:  # stdout: the path of every ready revision
        key = (spec.source.name, spec.source.revision)
        if key not in daemon.failures:
            click.echo(daemon.layout.revision_dir(*key))
    if errors:
        raise errors[0]


@click.command()
@cache_dir_option
@node_options
@capacity_option(True, "Cache bound: bytes (500G) or percent of the filesystem (85%).")
@serving_options
@option(
    "--allow-source",
    "allow_sources",
    multiple=True,
    parse=parse_allow_sources,
    help="Fetch for Pods only sources under this prefix: s3://bucket[/prefix], gs://, az://, "
    "https://host/path, file:///dir or hf://org[/repo] (repeatable; the "
    "variable takes several, space-separated). Default: the parent of each source of the "
    "models file. Other Pods fetch alone, with their own credentials.",
)
@peer_options
@store_options
@reports_errors
def daemon(cache_dir: Path, **kw: Any) -> None:
    """Run the node agent: prefetch, evict, coordinate fetches, serve metrics and peers."""
    import signal

    from weightcache.cli.signals import calling_on

    agent = _daemon(cache_dir, kw)
    with calling_on((signal.SIGTERM, signal.SIGINT), agent.stop):
        agent.run()
