"""The daemon is no confused deputy (design §5, who may ask): it fetches for Pods only sources
under its `--allow-source` prefixes (default: the parent of each source of its models
file); other requests are refused and the Pod fetches alone, with its own credentials."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI, Published, dead_endpoint
from tests.integration.daemon_helpers import (
    Daemons,
    MiB,
    daemons,  # noqa: F401 - fixture
    entry,
    is_marked,
    wait_for,
    write_models,
)
from tests.support.checks import assert_fails, assert_ok_path, assert_revision_ok, describe
from tests.support.faultproxy import FaultProxy

NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
WRONG_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "nobody", "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
FELL_BACK = "fetching alone with this Pod's credentials"
MISSES = 'weightcache_fetches_total{result="miss"}'


def through_the_daemon(wc: CLI, pub: Published, cache_dir: Path) -> None:
    """A Pod without credentials and with no reachable store: only the daemon can fetch."""
    proc = wc.fetch(pub.source, cache_dir, endpoint=dead_endpoint(), env=NO_CREDENTIALS)
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert FELL_BACK not in proc.stderr, describe(proc)


def refused_line(proc: Any, pub: Published) -> str:
    lines = [line for line in proc.stderr.splitlines() if FELL_BACK in line]
    assert len(lines) == 1, describe(proc)
    assert f"does not fetch {pub.source} for Pods" in lines[0], lines
    return str(lines[0])


@pytest.mark.timeout(150)
def test_only_sources_under_allow_source_go_through_the_daemon(
    wc: CLI, store: Any, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    team = publish([2 * MiB], name="team", rev="r1", seed="team")
    team_b = publish([2 * MiB], name="teamB", rev="r1", seed="teamB")
    uniq = team.prefix.split("/")[0]
    models = write_models(tmp_path / "models.yaml", [])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url,
                           allow_source=[f"s3://models/{uniq}/team"])  # fmt: skip

    through_the_daemon(wc, team, cache_dir)
    assert_revision_ok(cache_dir, team.name, team.rev, team.model)
    daemon_bytes = proxy.stats().body_bytes
    assert daemon_bytes >= team.model.total_size

    # s3://models/<uniq>/team does not cover .../teamB: refused, and the Pod falls back
    # to its own credentials, which fail the fetch without them (exit 2) or when they
    # cannot read the bucket (exit 3) ...
    alone = store.endpoint_url  # not through the proxy: the daemon's route
    no_creds = wc.fetch(team_b.source, cache_dir, endpoint=alone, env=NO_CREDENTIALS)
    assert "no usable AWS credentials" in assert_fails(no_creds, 2)
    refused_line(no_creds, team_b)
    wrong = wc.fetch(team_b.source, cache_dir, endpoint=alone, env=WRONG_CREDENTIALS)
    assert "access denied" in assert_fails(wrong, 3)
    refused_line(wrong, team_b)
    # ... and succeed with them.
    ok = wc.fetch(team_b.source, cache_dir, endpoint=alone)
    assert_ok_path(ok, team_b.local_path(cache_dir))
    refused_line(ok, team_b)
    assert_revision_ok(cache_dir, team_b.name, team_b.rev, team_b.model)

    assert proxy.stats().body_bytes == daemon_bytes, "the daemon downloaded a refused source"
    assert daemon.metrics()[MISSES] == 1
    refusals = [line for line in daemon.log().splitlines() if "refused a Pod's fetch" in line]
    assert len(refusals) == 3 and team_b.source in refusals[0], daemon.log()
    assert daemon.alive(), daemon.log()


@pytest.mark.timeout(150)
def test_by_default_the_daemon_fetches_revisions_of_its_listed_models(
    wc: CLI, store: Any, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    listed = publish([1 * MiB], name="alpha", rev="r1", seed="alpha")
    next_rev = publish([2 * MiB], name="alpha", rev="r2", seed="alpha2")
    other = publish([2 * MiB], name="beta", rev="r1", seed="beta")
    models = write_models(tmp_path / "models.yaml", [entry(listed)])
    daemon = daemons.start(cache_dir, models, endpoint=proxy.url, allow_source=())
    wait_for("the listed model", lambda: is_marked(cache_dir, listed), timeout=60)

    # alpha/r2 is under s3://models/<uniq>/alpha, the parent of a listed source.
    through_the_daemon(wc, next_rev, cache_dir)
    assert_revision_ok(cache_dir, next_rev.name, next_rev.rev, next_rev.model)
    daemon_bytes = proxy.stats().body_bytes

    # beta is not: the Pod fetches it alone.
    ok = wc.fetch(other.source, cache_dir, endpoint=store.endpoint_url)
    assert_ok_path(ok, other.local_path(cache_dir))
    refused_line(ok, other)
    assert proxy.stats().body_bytes == daemon_bytes, "the daemon downloaded a refused source"

    # Listing beta in the models file allows it (the default follows the file).
    gamma = publish([1 * MiB], name="beta", rev="r2", seed="beta2")
    write_models(models, [entry(listed), entry(other)])
    wait_for("the new models file", lambda: "2 model(s)" in daemon.log(), timeout=30)
    through_the_daemon(wc, gamma, cache_dir)
    assert daemon.alive(), daemon.log()


@pytest.mark.timeout(150)
def test_file_sources_converge_and_are_fetched_for_pods_under_their_prefix(
    wc: CLI, store: Any, cache_dir: Path, tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """A models file may list a directory on a volume; by default the daemon then fetches
    other revisions of that model for Pods, and refuses a directory elsewhere."""
    from tests.support.modelgen import make_model

    volume = tmp_path / "volume"
    listed = make_model(volume / "llama" / "v1", [1 * MiB], seed="v1")
    sibling = make_model(volume / "llama" / "v2", [1 * MiB], seed="v2")
    elsewhere = make_model(tmp_path / "other" / "qwen" / "v1", [1 * MiB], seed="q")
    models = write_models(tmp_path / "models.yaml", [{"source": f"file://{listed.root}"}])
    daemon = daemons.start(cache_dir, models, endpoint=store.endpoint_url, allow_source=())
    wait_for("llama/v1 converged", (cache_dir / "llama" / "v1" / ".weightcache").is_file, 60)
    assert_revision_ok(cache_dir, "llama", "v1", listed)

    pod = wc.fetch(str(sibling.root), cache_dir)
    assert_ok_path(pod, cache_dir / "llama" / "v2")
    assert FELL_BACK not in pod.stderr, describe(pod)
    assert_revision_ok(cache_dir, "llama", "v2", sibling)
    assert daemon.metrics()[MISSES] == 2

    alone = wc.fetch(f"file://{elsewhere.root}", cache_dir)
    assert_ok_path(alone, cache_dir / "qwen" / "v1")
    lines = [line for line in alone.stderr.splitlines() if FELL_BACK in line]
    assert len(lines) == 1 and f"does not fetch file://{elsewhere.root} for" in lines[0], lines
    assert daemon.metrics()[MISSES] == 2
