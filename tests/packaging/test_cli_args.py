"""The weightcache command lines in the manifests are valid invocations of the real CLI.

Each container that runs the weightcache image contributes its command + args, taken from
the rendered YAML. They are parsed by the console script's own click objects (the one
pyproject.toml installs as `weightcache`), exactly as click does before invoking a
subcommand, so an unknown option, a missing argument or a value that an option's type or
callback rejects fails here instead of in a CrashLoopBackOff.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Values for downward-API environment variables, which have no literal value in YAML.
FIELD_REF_PLACEHOLDERS = {
    "metadata.uid": "00000000-0000-4000-8000-000000000000",
    "spec.nodeName": "gpu-node-0",
    "metadata.namespace": "weightcache",
    "metadata.name": "weightcache-abcde",
}


def console_script() -> Any:
    """The click command behind `weightcache` (pyproject [project.scripts])."""
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][
        "weightcache"
    ]
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def entrypoint() -> list[str]:
    """The image's ENTRYPOINT, used when a container sets no command."""
    match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", (REPO / "Dockerfile").read_text(), re.M)
    assert match, "Dockerfile has no exec-form ENTRYPOINT"
    result: list[str] = json.loads(match.group(1))
    return result


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of $(VAR) in command and args ($$ escapes, unknown stays)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        arg,
    )


def cli_args(container: Any) -> list[str]:
    """The arguments the console script receives in this container (argv[1:])."""
    env = container_environment(container)
    command = container.spec.get("command") or entrypoint()
    argv = [expand(a, env) for a in (*command, *container.spec.get("args", []))]
    assert Path(argv[0]).name == "weightcache", (
        f"{container.where} runs {argv[0]!r}, not the weightcache console script"
    )
    return argv[1:]


def parse(main: Any, args: list[str]) -> Any:
    """Parse `weightcache ARGS` down to the leaf command's context, invoking nothing.

    Mirrors click.Group.invoke: make the group's context, resolve the subcommand, make its
    context with the remaining args. Raises click.UsageError (or a subclass) when invalid.
    """
    import click

    ctx = main.make_context("weightcache", list(args))
    command = main
    while isinstance(command, click.Group):
        protected = getattr(ctx, "_protected_args", None)
        if protected is None:  # click < 8.2
            protected = ctx.protected_args
        rest = [*protected, *ctx.args]
        assert rest, f"`weightcache {' '.join(args)}` names no subcommand"
        name, command, rest = command.resolve_command(ctx, rest)
        assert command is not None
        ctx = command.make_context(name, rest, parent=ctx)
    return ctx


def container_environment(container: Any) -> dict[str, str]:
    env = {}
    for e in container.spec.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = FIELD_REF_PLACEHOLDERS[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def option_param(ctx: Any, flag: str) -> Any:
    params = [p for p in ctx.command.params if flag in getattr(p, "opts", [])]
    assert params, f"`{ctx.command_path}` has no {flag} option"
    return params[0]


def commands(command: Any) -> list[Any]:
    """A click command and every subcommand under it."""
    import click

    found = [command]
    if isinstance(command, click.Group):  # its commands load on demand: ask the group
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            found += commands(command.get_command(ctx, name))
    return found


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Parsing as in the container: no WEIGHTCACHE_* or AWS_* variables from this test run,
    and no existence checks of paths, which name the Pod's filesystem, not this machine's."""
    import click

    for name in list(os.environ):
        if name.startswith(("WEIGHTCACHE_", "AWS_")):
            monkeypatch.delenv(name)
    for command in commands(console_script()):
        for param in command.params:
            if isinstance(param.type, click.Path):
                for check in ("exists", "readable", "writable", "executable", "resolve_path"):
                    monkeypatch.setattr(param.type, check, False)
    return monkeypatch


def test_manifest_command_lines_parse(rendered: Any, clean_environment: pytest.MonkeyPatch) -> None:
    import click

    main = console_script()
    for container in rendered.weightcache_containers():
        args = cli_args(container)
        with clean_environment.context() as env:
            for name, value in container_environment(container).items():
                env.setenv(name, value)
            try:
                ctx = parse(main, args)
            except click.UsageError as exc:
                pytest.fail(
                    f"{rendered.name} {container.where}: `weightcache {' '.join(args)}` "
                    f"is rejected by the CLI: {exc.format_message()}"
                )
        # Every command here reads or fills the cache: it must be the container's cache mount.
        cache_dir = ctx.params[option_param(ctx, "--cache-dir").name]
        mount = container.mount_holding(str(cache_dir))
        assert mount["mountPath"].rstrip("/") == str(cache_dir).rstrip("/"), (
            f"{container.where}: --cache-dir {cache_dir} is not the cache volume's mountPath"
        )


def test_a_bad_command_line_is_rejected(clean_environment: pytest.MonkeyPatch) -> None:
    """Negative control: the parse above really rejects what the CLI does not accept."""
    import click

    main = console_script()
    for bad in (
        ["fetch", "s3://models/qwen3-70b/2026-10-01", "--cache-dir", "/cache", "--no-such-option"],
        ["no-such-command"],
        ["daemon", "--cache-dir"],
    ):
        with pytest.raises(click.UsageError):
            parse(main, bad)


def test_every_mode_the_manifests_need_is_used(initcontainer: Any, daemonset: Any) -> None:
    used = {cli_args(c)[0] for r in (initcontainer, daemonset) for c in r.weightcache_containers()}
    assert used == {"fetch", "daemon"}


@pytest.mark.parametrize("name", ["fetch", "daemon", "gc", "ls_", "verify", "demo"])
def test_every_command_imports_by_name_from_the_cli_package(name: str) -> None:
    """`from weightcache.cli import <command>` gives the click command, loaded on use, even
    where the name is also a module the package uses (`gc`)."""
    import click

    command = getattr(importlib.import_module("weightcache.cli"), name)
    assert isinstance(command, click.Command), command
