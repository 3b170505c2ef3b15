"""The command line's options and the settings built from them: one builder per settings
object, and each default stated once, by the settings (what --help shows is what they get)."""

from __future__ import annotations

import os
from dataclasses import fields

import pytest

from weightcache import cli
from weightcache.config import (
    Capacity,
    OriginSettings,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)
from weightcache.daemon.daemon import DaemonSettings
from weightcache.errors import UsageError
from weightcache.options import daemon_settings, origin_settings

BASE = ["--cache-dir", "/tmp/c", "--models", "/tmp/m.yaml", "--capacity", "1G"]


@pytest.fixture(autouse=True)
def _no_option_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("WEIGHTCACHE_") or name == "AWS_ENDPOINT_URL":
            monkeypatch.delenv(name)


def params(command: str, *args: str) -> dict[str, object]:
    with getattr(cli, command).make_context(command, [*BASE, *args]) as ctx:
        return dict(ctx.params)


def test_the_option_defaults_are_the_settings_defaults() -> None:
    kw = params("daemon")
    assert origin_settings(kw) == OriginSettings()
    settings = daemon_settings(kw)
    assert kw == {"cache_dir": kw["cache_dir"]}  # every option went into some settings
    defaults = DaemonSettings(models_file=settings.models_file)
    for f in fields(DaemonSettings):
        if f.name not in ("capacity", "metrics_addr"):  # daemon options without a default
            assert getattr(settings, f.name) == getattr(defaults, f.name), f.name
    assert settings.metrics_addr == ("0.0.0.0", 9402)


@pytest.mark.parametrize("command", ["daemon", "prefetch"])
def test_the_node_commands_take_require_sha256(command: str) -> None:
    assert daemon_settings(params(command, "--require-sha256")).require_sha256 is True


def test_prefetch_leaves_what_it_does_not_take_at_its_default() -> None:
    kw = params("prefetch")
    origin_settings(kw)
    settings = daemon_settings(kw)
    assert settings.metrics_addr is None and settings.peer is None
    assert settings.interval == DaemonSettings(models_file=settings.models_file).interval


@pytest.mark.parametrize(
    ("addr", "expected"),
    [("[::1]:9402", ("::1", 9402)), ("[::]:0", ("::", 0)), (":9402", ("0.0.0.0", 9402)),
     ("127.0.0.1:9402", ("127.0.0.1", 9402))],
)  # fmt: skip
def test_metrics_addr_takes_ipv6(addr: str, expected: tuple[str, int]) -> None:
    assert daemon_settings(params("daemon", "--metrics-addr", addr)).metrics_addr == expected


def test_bad_watermarks_are_a_usage_error() -> None:
    with pytest.raises(UsageError, match="invalid watermarks"):
        daemon_settings(params("daemon", "--high-watermark", "0.5", "--low-watermark", "0.9"))


@pytest.mark.parametrize("n", [0, 1, 300, 1536, 16 << 20, 1 << 30, 5 << 40, (1 << 30) + 1])
def test_format_size_reads_back(n: int) -> None:
    assert parse_size(format_size(n)) == n


@pytest.mark.parametrize("seconds", [0.25, 0.5, 1.5, 2.0, 90.0, 300.0, 86400.0])
def test_format_duration_reads_back(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


def test_formats_are_short() -> None:
    assert (format_size(16 << 20), format_size(1 << 30)) == ("16MiB", "1GiB")
    assert (format_duration(300.0), format_duration(2.0)) == ("5m", "2s")
    assert (str(Capacity(percent=20.0)), str(Capacity(bytes=500 << 30))) == ("20%", "500GiB")
    assert Capacity.parse(str(Capacity(percent=12.5))) == Capacity(percent=12.5)


def test_every_option_of_every_command_but_the_demo_reads_its_environment_variable() -> None:
    """The documented rule (design §2): `--dry-run` is also WEIGHTCACHE_DRY_RUN; an option
    declared without it (gc --dry-run was) silently ignores the variable. Not -v and -q."""
    import click

    ctx = click.Context(cli.main)
    missing = [
        (name, p.opts[0])
        for name in cli.main.list_commands(ctx)
        if name != "demo"
        for p in getattr(cli.main.get_command(ctx, name), "params", [])
        if isinstance(p, click.Option) and p.name not in ("help", "verbose", "quiet")
        and f"WEIGHTCACHE_{p.opts[0].lstrip('-').upper().replace('-', '_')}"
        not in ([p.envvar] if isinstance(p.envvar, str) else p.envvar or [])
    ]  # fmt: skip
    assert missing == []


def test_an_error_from_a_server_prints_as_one_bounded_line() -> None:
    """A store's <Message> with line breaks printed a second line reading like ours."""
    from weightcache.cli.reporting import MAX_MESSAGE, one_line

    forged = "denied\nweightcache: error: nothing; all good\r\n\x1b[2Kready /x"
    assert one_line(forged) == "denied weightcache: error: nothing; all good [2Kready /x"
    assert len(one_line("x" * 10_000)) == MAX_MESSAGE
