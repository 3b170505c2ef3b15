"""How the command line fails: one `weightcache: error:` line on stderr and the exit code of
design §2.2, never a traceback, for weightcache errors, the environment's OSErrors and
click's usage errors alike."""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from weightcache.errors import UsageError, WeightcacheError, no_space

F = TypeVar("F", bound=Callable[..., Any])


def reports_errors(fn: F) -> F:
    """Turn weightcache errors into one stderr sentence and its exit code (design §2.2)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WeightcacheError as e:
            fail(e, _named_sources(str(e)))
        except OSError as e:
            error = os_error(e)
            if error is None:
                raise
            fail(error, _named_sources(str(error)))
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
    full = no_space(e)
    if full is not None:
        return full
    hint = _OS_HINTS.get(e.errno or 0)
    if hint is None:
        return None
    where = f" ({e.filename})" if e.filename else ""
    return UsageError(f"{e.strerror or e}{where}: {hint}")


def fail(error: WeightcacheError, source: str = "") -> None:
    click.echo(f"weightcache: error: {one_line(str(error))}{source}", err=True)
    sys.exit(error.exit_code)


#: The most of a message printed: the part a server or a file can make long comes last.
MAX_MESSAGE = 2000


def one_line(text: str) -> str:
    """`text` as one line of at most MAX_MESSAGE characters: a store's error message, a
    header or a file name may hold line breaks and terminal escapes, and a second line
    reading `weightcache: error: ...` or `ready` must not appear under ours."""
    text = re.sub(r"[\x00-\x1f\x7f]+", " ", text)
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _named_sources(message: str) -> str:
    """ "; it came from the environment variable X" for each path or text option of the
    running command whose value `message` names and which the environment set: found bad
    only when used (a cache dir through a file), it is still a value the user did not
    type."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return ""
    names = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if not isinstance(value, str | os.PathLike) or len(os.fspath(value)) < 2:
            continue
        if os.fspath(value) not in message or not isinstance(param, click.Option):
            continue
        if ctx.get_parameter_source(param.name or "") is ParameterSource.ENVIRONMENT:
            names += [n for n in [_variable(param)] if n and n not in message]
    return "".join(f"; it came from the environment variable {n}" for n in names)


def _variable(param: click.Option) -> str | None:
    """The environment variable click took `param`'s value from (the first one set)."""
    names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
    return next((n for n in names if os.environ.get(n)), None)


class Group(click.Group):
    """Usage errors too are one `weightcache: error:` line with exit code 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """No command at all: the help on stdout, exit 0 (click would raise it as a usage
        error, which `main` below would print as one behind `weightcache: error:`)."""
        if not args and not ctx.resilient_parsing:
            click.echo(ctx.get_help())
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)  # set on UsageError and its subclasses
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            source = _environment_source(e, sys.argv[1:])
            message = e.format_message().rstrip(".") if source else e.format_message()
            # click lists "" (an empty variable) first among a flag's values: ", 0, 1, ..."
            message = message.replace("Recognized values: , ", "Recognized values: ")
            click.echo(f"weightcache: error: {one_line(message)}{source}{hint}", err=True)
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
    name = _variable(param)
    return f"; it came from the environment variable {name}" if name else ""
