"""The `weightcache` command line (click, thin): parse, build settings, call, map errors.

Every option also reads WEIGHTCACHE_<OPTION> from the environment (SPEC §2.2). Errors
print one sentence on stderr and exit with the SPEC code; stdout carries only results.
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

from weightcache.config import Source, StoreSettings, parse_duration, parse_rate, parse_size
from weightcache.errors import NoSpaceError, UsageError, WeightcacheError

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("weightcache")


def _env(option: str) -> str:
    return "WEIGHTCACHE_" + option.upper().replace("-", "_")


def _converter(parse: Callable[[str, str], Any], what: str) -> Callable[..., Any]:
    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
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
        click.option("--endpoint-url", envvar=[_env("endpoint-url"), "AWS_ENDPOINT_URL"],
                     help="S3-compatible endpoint (default: the AWS chain's)."),
        click.option("--bwlimit", envvar=_env("bwlimit"),
                     callback=_converter(parse_rate, "--bwlimit"),
                     help="Bytes per second over all connections, e.g. 2G (default: none)."),
        click.option("--max-concurrency", envvar=_env("max-concurrency"), type=int,
                     default=StoreSettings.max_concurrency, show_default=True,
                     help="Ranged GETs in flight at most."),
        click.option("--part-size", envvar=_env("part-size"), default="16MiB",
                     show_default=True, callback=_converter(parse_size, "--part-size"),
                     help="Size of each ranged GET."),
        click.option("--timeout", envvar=_env("timeout"), default="5m", show_default=True,
                     callback=_converter(parse_duration, "--timeout"),
                     help="Give up (exit 6) after this long without a byte from the store."),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


def cache_dir_option(fn: F) -> F:
    return click.option(
        "--cache-dir", envvar=_env("cache-dir"), required=True,
        type=click.Path(file_okay=False, path_type=Path), help="The node's cache directory.",
    )(fn)  # fmt: skip


def settings_from(kw: dict[str, Any]) -> StoreSettings:
    return StoreSettings(
        endpoint_url=kw.pop("endpoint_url") or None,
        bwlimit=kw.pop("bwlimit"),
        max_concurrency=kw.pop("max_concurrency"),
        part_size=kw.pop("part_size"),
        timeout=kw.pop("timeout"),
    )


def reports_errors(fn: F) -> F:
    """Turn weightcache errors into one stderr sentence and the SPEC exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WeightcacheError as e:
            _fail(e)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                _fail(NoSpaceError(f"no space left on the cache disk ({e}); free space or "
                                   "lower --capacity"))  # fmt: skip
            raise
        except KeyboardInterrupt:
            click.echo("weightcache: interrupted; partial files are kept for resume", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


def _fail(error: WeightcacheError) -> None:
    click.echo(f"weightcache: error: {error}", err=True)
    sys.exit(error.exit_code)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", count=True, help="More logs on stderr (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
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
@click.option("--name", envvar=_env("name"), help="Model name (default: SOURCE's next-to-last segment).")
@click.option("--revision", envvar=_env("revision"), help="Revision (default: SOURCE's last segment).")
@store_options
@click.option("--json", "as_json", is_flag=True, envvar=_env("json"),
              help="Print one JSON object (path, hit, bytes_from_origin, seconds, throughput).")
@click.option("--pod-uid", envvar=["POD_UID", _env("pod-uid")],
              help="The Pod's UID (downward API); leases the revision while the Pod lives.")
@reports_errors
def fetch(source: str, cache_dir: Path, name: str | None, revision: str | None,
          as_json: bool, pod_uid: str | None, **store: Any) -> None:  # fmt: skip
    """Make SOURCE ready in the cache and print its local path (InitContainer mode)."""
    from weightcache.fetch import check_hit
    from weightcache.layout import Layout, check_segment

    src = Source.parse(source, name, revision)
    check_segment(src.name, "model name")
    check_segment(src.revision, "revision")
    settings = settings_from(store)
    layout = Layout.open(cache_dir)
    result = check_hit(layout, src, pod_uid)
    if result is None:
        result = _fetch_miss(layout, settings, src, pod_uid)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    else:
        click.echo(result.path)


def _fetch_miss(layout: Any, settings: StoreSettings, src: Source, pod_uid: str | None) -> Any:
    from weightcache.fetch import Fetcher
    from weightcache.progress import Progress

    progress = Progress(src.label, 0)
    fetcher = Fetcher(layout, settings, observer=progress)
    try:
        return fetcher.fetch(src, pod_uid)
    finally:
        progress.close()


@main.command()
@click.argument("local_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dest")
@store_options
@reports_errors
def publish(local_dir: Path, dest: str, **store: Any) -> None:
    """Hash LOCAL_DIR, write its SHA256SUMS, upload it all to DEST (s3://bucket/prefix/name/rev)."""
    from weightcache.publish import publish as do_publish

    manifest = do_publish(local_dir, Source.parse(dest), settings_from(store))
    log.info("published %d files to %s", manifest.count(b"\n"), dest)
    click.echo(dest.rstrip("/"))


if __name__ == "__main__":  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]))
