"""The `weightcache` command line (click, thin): parse, build settings, call, map errors.

Every option also reads WEIGHTCACHE_<OPTION> from the environment (design §2), and every
settings object is built by its one builder in weightcache/options.py. Errors print one
sentence on stderr and exit with the code of design §2.2 (weightcache/cli/reporting.py);
stdout carries only results. The commands live by audience: fetching.py (`fetch`,
`publish`, `manifest`), node.py (`prefetch`, `daemon`), admin.py (`ls`, `verify`, `gc`, `demo`),
each imported only when one of its commands runs (or `--help` lists them): a `fetch` (a Pod's
InitContainer, on the way to its first GET) loads no other command's options.
"""

from __future__ import annotations

import contextlib
import gc as _gc  # not `gc`: that name is the `weightcache gc` command (`__all__`)
import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator


@contextlib.contextmanager
def uncollected() -> Iterator[None]:
    """The cyclic garbage collector off inside, for imports and set-up whose objects all
    live on; on leaving, what was made is frozen (never traversed again) and the collector
    is on again if it was. Measured: its passes over a cold fetch's imports cost ~8 ms
    before the first GET (design §4, Time to first byte)."""
    enabled = _gc.isenabled()
    _gc.disable()
    try:
        yield
    finally:
        _gc.freeze()
        if enabled:
            _gc.enable()


with uncollected():
    import click

    from weightcache.cli.reporting import Group

__all__ = [
    "daemon", "demo", "fetch", "gc", "ls_", "main", "manifest", "prefetch", "publish", "verify"
]  # fmt: skip

#: Each command: (its module under weightcache.cli, its attribute there).
_COMMANDS = {
    "fetch": ("fetching", "fetch"),
    "publish": ("fetching", "publish"),
    "manifest": ("fetching", "manifest"),
    "prefetch": ("node", "prefetch"),
    "daemon": ("node", "daemon"),
    "ls": ("admin", "ls_"),
    "verify": ("admin", "verify"),
    "gc": ("admin", "gc"),
    "demo": ("admin", "demo"),
}


def _load(name: str) -> click.Command:
    module, attr = _COMMANDS[name]
    with uncollected():
        loaded = importlib.import_module(f"weightcache.cli.{module}")
    command: click.Command = getattr(loaded, attr)
    if not any(p.name == "verbose" for p in command.params):
        command.params += _log_options()
    return command


def _log_options() -> list[click.Parameter]:
    """-v and -q after the command too (`weightcache fetch URL -v`), as a user types them:
    they add to those given before it."""
    return [
        click.Option(["-v", "--verbose"], count=True, expose_value=False, callback=_relevel,
                     help="More logs on stderr (-vv for debug)."),
        click.Option(["-q", "--quiet"], is_flag=True, expose_value=False, callback=_relevel,
                     help="Only errors on stderr."),
    ]  # fmt: skip


def _relevel(ctx: click.Context, param: click.Parameter, value: int | bool) -> None:
    if not value:
        return
    before = ctx.parent.params if ctx.parent is not None else {}
    verbose, quiet = before.get("verbose", 0), before.get("quiet", False)
    if param.name == "verbose":
        verbose += int(value)
    else:
        quiet = True
    _set_level(verbose, quiet)


def _set_level(verbose: int, quiet: bool) -> None:
    level = logging.ERROR if quiet else (logging.DEBUG if verbose > 1 else logging.INFO)
    logging.getLogger().setLevel(level)
    logging.getLogger("botocore").setLevel(logging.WARNING if verbose < 2 else logging.NOTSET)


class _LazyGroup(Group):
    """The commands of `_COMMANDS`, each module imported on the first look at one of them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)  # as click.Group lists its own

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return _load(cmd_name) if cmd_name in _COMMANDS else None

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """An unknown command name is refused with the closest one, if any is close."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in _COMMANDS:
            import difflib

            close = difflib.get_close_matches(name, _COMMANDS, n=1)
            if close:
                ctx.fail(f"No such command {name!r}. Did you mean {close[0]!r}?")
        return super().resolve_command(ctx, args)


def __getattr__(attr: str) -> click.Command:
    """`from weightcache.cli import fetch` (and the others) still works: loaded on use."""
    for name, (_, command_attr) in _COMMANDS.items():
        if command_attr == attr:
            return _load(name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


@click.group(
    cls=_LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option("-v", "--verbose", count=True, help="More logs on stderr (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
@click.version_option(package_name="weightcache", prog_name="weightcache")
def main(verbose: int, quiet: bool) -> None:
    """Idempotent model-weight fetcher and node-local cache daemon."""
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _set_level(verbose, quiet)


if __name__ == "__main__":  # pragma: no cover
    main(prog_name=os.path.basename(sys.argv[0]))
