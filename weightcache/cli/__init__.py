"""The `weightcache` command line (click, thin): parse, build settings, call, map errors.

Every option also reads WEIGHTCACHE_<OPTION> from the environment (design §2), and every
settings object is built by its one builder in weightcache/options.py. Errors print one
sentence on stderr and exit with the code of design §2.2 (weightcache/cli/reporting.py);
stdout carries only results. The commands live by audience: fetching.py (`fetch`,
`publish`, `manifest`), node.py (`prefetch`, `daemon`), admin.py (`ls`, `verify`, `gc`, `demo`).
"""

from __future__ import annotations

import logging
import os
import sys

import click

from weightcache.cli.admin import demo, gc, ls_, verify
from weightcache.cli.fetching import fetch, manifest, publish
from weightcache.cli.node import daemon, prefetch
from weightcache.cli.reporting import Group

__all__ = [
    "daemon", "demo", "fetch", "gc", "ls_", "main", "manifest", "prefetch", "publish", "verify"
]  # fmt: skip


@click.group(
    cls=Group,
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


for _command in (fetch, publish, manifest, prefetch, daemon, ls_, verify, gc, demo):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]))
