"""A ready path means verified bytes of the requested source (design §1, §3 invariants 5-7).

Against the real store and the real CLI (and the real daemon over its socket): another
source under the same name/revision is proved identical or refused; a damaged blob is
never linked again; one sha256 with two sizes is an integrity error; a planted marker
cannot make `verify` touch anything outside the cache.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BUCKET, CLI, Published, dead_endpoint, put_objects, upload_dir
from tests.integration.daemon_helpers import (
    Daemons,
    daemons,  # noqa: F401 - fixture
    wait_for,
    write_models,
)
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_linked_to_blobs,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
    describe,
    markers,
)
from tests.support.faultproxy import FaultProxy
from tests.support.modelgen import sha256_bytes

MiB = 1024 * 1024

pytestmark = pytest.mark.timeout(180)


def _same_content_elsewhere(s3: Any, pub: Published, uniq: str) -> str:
    """Upload pub's files (manifest included, byte for byte) under another prefix."""
    prefix = f"{uniq}-copy/team-b/{pub.name}/{pub.rev}"
    upload_dir(s3, pub.model.root, BUCKET, prefix)
    return f"s3://{BUCKET}/{prefix}"


# -- item 1: the cache key and the source ------------------------------------------------


def test_another_source_with_other_content_is_refused_naming_both(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    team_a = publish([1 * MiB], name="llama", rev="v1", seed="team-a")
    team_b = publish([1 * MiB], name="other", rev="v1", seed="team-b")
    rev_dir = team_a.local_path(cache_dir)
    assert_ok_path(wc.fetch(team_a.source, cache_dir, "--no-daemon"), rev_dir)

    refused = wc.fetch(team_b.source, cache_dir, "--no-daemon", "--name", "llama")
    message = assert_fails(refused, 2)
    assert team_a.source in message and team_b.source in message, message
    assert "--name" in message and "--revision" in message, message
    assert_revision_ok(cache_dir, "llama", "v1", team_a.model)  # untouched

    # The owner's fetch is still a network-free hit.
    hit = wc.fetch(team_a.source, cache_dir, "--no-daemon", endpoint=dead_endpoint())
    assert_ok_path(hit, rev_dir)


def test_another_source_with_the_same_manifest_is_served_after_one_get(
    wc: CLI,
    publish: Callable[..., Published],
    s3: Any,
    uniq: str,
    proxy: FaultProxy,
    cache_dir: Path,
) -> None:
    team_a = publish([1 * MiB, 256 * 1024], name="llama", rev="v1", seed="shared")
    mirror = _same_content_elsewhere(s3, team_a, uniq)
    rev_dir = team_a.local_path(cache_dir)
    assert_ok_path(wc.fetch(team_a.source, cache_dir, "--no-daemon"), rev_dir)

    proxy.reset_stats()
    served = wc.fetch(mirror, cache_dir, "--no-daemon", "--json", endpoint=proxy.url)
    assert served.returncode == 0, describe(served)
    result = json.loads(served.stdout)
    assert os.path.realpath(result["path"]) == os.path.realpath(rev_dir), result
    assert result["bytes_from_origin"] == 0, result
    assert proxy.stats().requests <= 2, "more than the manifest was read from the mirror"
    assert_revision_ok(cache_dir, "llama", "v1", team_a.model)


def test_the_daemon_refuses_another_source_under_a_cached_name(
    wc: CLI,
    publish: Callable[..., Published],
    daemons: Daemons,  # noqa: F811
    store: Any,
    tmp_path: Path,
    cache_dir: Path,
) -> None:
    """Over the socket, a Pod without credentials (its own endpoint is dead, so only the
    daemon can reach the store) cannot plant its source under another's name."""
    team_a = publish([1 * MiB], name="llama", rev="v1", seed="team-a")
    team_b = publish([1 * MiB], name="other", rev="v1", seed="team-b")
    models = write_models(tmp_path / "models.yaml", [team_a])
    daemon = daemons.start(cache_dir, models, endpoint=store.endpoint_url)
    pod = dead_endpoint()
    first = wc.fetch(team_a.source, cache_dir, endpoint=pod)  # through the daemon
    assert_ok_path(first, team_a.local_path(cache_dir))

    refused = wc.fetch(team_b.source, cache_dir, "--name", "llama", endpoint=pod)
    message = assert_fails(refused, 2)
    assert team_a.source in message and team_b.source in message, message + daemon.log()
    assert_revision_ok(cache_dir, "llama", "v1", team_a.model)

    # And a new name for team B's model works through the daemon.
    ok = wc.fetch(team_b.source, cache_dir, "--name", "llama-b", endpoint=pod)
    assert_ok_path(ok, cache_dir / "llama-b" / "v1")
    assert_revision_ok(cache_dir, "llama-b", "v1", team_b.model)

    # Prefetch too: a models entry naming team B's model "llama" is refused, not "ready".
    write_models(models, [{"source": team_b.source, "name": "llama", "revision": "v1"}])
    wait_for(
        "the daemon to refuse the models entry",
        lambda: "prefetch of llama/v1 failed" in daemon.log() and team_a.source in daemon.log(),
    )
    assert_revision_ok(cache_dir, "llama", "v1", team_a.model)


def test_another_source_does_not_join_a_download_in_flight(
    wc: CLI,
    publish: Callable[..., Published],
    daemons: Daemons,  # noqa: F811
    store: Any,
    tmp_path: Path,
    cache_dir: Path,
) -> None:
    """The daemon's single-flight key includes the source: a request for team B's model
    under team A's name, arriving while team A's download runs, is not handed its result."""
    team_a = publish([4 * MiB], name="llama", rev="v1", seed="team-a")
    team_b = publish([64 * 1024], name="other", rev="v1", seed="team-b")
    models = write_models(tmp_path / "models.yaml", [])
    daemons.start(cache_dir, models, endpoint=store.endpoint_url, extra=["--bwlimit", "1M"])
    pod = dead_endpoint()
    slow = wc.fetch_popen(team_a.source, cache_dir, endpoint=pod)
    wait_for(
        "team A's download to start",
        lambda: any((cache_dir / ".weightcache" / "tmp").glob("*.part")),
        timeout=30,
        every=0.05,
    )
    assert slow.poll() is None, "team A's fetch ended before team B's request"

    refused = wc.fetch(team_b.source, cache_dir, "--name", "llama", endpoint=pod)
    message = assert_fails(refused, 2)
    assert team_a.source in message and team_b.source in message, message
    assert_ok_path(slow.finish(), team_a.local_path(cache_dir))
    assert_revision_ok(cache_dir, "llama", "v1", team_a.model)


# -- item 2: a damaged blob is never linked again -----------------------------------------


def test_a_truncated_file_is_downloaded_again_not_relinked(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path
) -> None:
    pub = publish([2 * MiB, 1 * MiB], name="trunc", rev="r1", seed="trunc")
    rev_dir = pub.local_path(cache_dir)
    assert_ok_path(wc.fetch(pub.source, cache_dir, "--no-daemon"), rev_dir)
    shard = "model-00001-of-00002.safetensors"
    blob = blobs_dir(cache_dir) / pub.model.hashes[shard]
    assert stat.S_IMODE(blob.stat().st_mode) == 0o444, "blobs are published read-only"

    path = rev_dir / shard
    os.chmod(path, 0o644)  # the same inode as the blob: this damages the blob too
    os.truncate(path, 1000)

    for _ in range(2):  # the repair holds, and the next fetch is a plain hit
        again = wc.fetch(pub.source, cache_dir, "--no-daemon", endpoint=proxy.url)
        assert_ok_path(again, rev_dir)
        assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
        assert_linked_to_blobs(cache_dir, pub.name, pub.rev, pub.model)
        assert_blobs_valid(cache_dir)
    assert proxy.stats().bytes_for(shard) >= pub.model.sizes[shard], "not downloaded again"


def test_a_damaged_blob_shared_with_a_removed_revision_is_not_linked(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    """The damaged blob is found through no marker at all: its revision was removed
    (rm -rf) and another revision lists the same content."""
    first = publish([1 * MiB], name="shared", rev="r1", shard_seeds=["same"])
    second = publish([1 * MiB], name="shared", rev="r2", shard_seeds=["same"])
    assert_ok_path(wc.fetch(first.source, cache_dir, "--no-daemon"), first.local_path(cache_dir))
    shard = "model-00001-of-00001.safetensors"
    blob = blobs_dir(cache_dir) / first.model.hashes[shard]
    os.truncate(blob, 4096)
    os.unlink(first.local_path(cache_dir) / ".weightcache")

    got = wc.fetch(second.source, cache_dir, "--no-daemon")
    assert_ok_path(got, second.local_path(cache_dir))
    assert_revision_ok(cache_dir, "shared", "r2", second.model)
    assert_blobs_valid(cache_dir)


# -- item 3: one sha256, two sizes ---------------------------------------------------------


def test_one_sha256_with_two_object_sizes_is_an_integrity_error(
    wc: CLI, s3: Any, uniq: str, cache_dir: Path
) -> None:
    a, b = b"x" * 1000, b"x" * 1200
    digest = sha256_bytes(a)
    prefix = f"{uniq}/twin/r1"
    manifest = f"{digest}  a.bin\n{digest}  sub/b.bin\n"
    put_objects(s3, BUCKET, prefix, {"a.bin": a, "sub/b.bin": b, "SHA256SUMS": manifest})

    proc = wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, "--no-daemon")
    message = assert_fails(proc, 4)
    assert "a.bin" in message and "sub/b.bin" in message, message
    assert markers(cache_dir) == [], "a marker was written for an inconsistent manifest"


# -- item 14: paths read back from a marker ----------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "symlinked-dir"])
def test_verify_refuses_a_marker_that_leads_outside_the_cache(
    wc: CLI, publish: Callable[..., Published], tmp_path: Path, cache_dir: Path, how: str
) -> None:
    pub = publish([64 * 1024], name="planted", rev="r1", seed="planted")
    rev_dir = pub.local_path(cache_dir)
    assert_ok_path(wc.fetch(pub.source, cache_dir, "--no-daemon"), rev_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("operator data\n")
    if how == "dotdot":
        relpath = os.path.relpath(victim, rev_dir)
        assert relpath.startswith("../../")
    else:
        (rev_dir / "sub").symlink_to(outside)
        relpath = "sub/precious.txt"
    marker = json.loads((rev_dir / ".weightcache").read_text())
    marker["files"][relpath] = {"sha256": "0" * 64, "size": 3}
    (rev_dir / ".weightcache").write_text(json.dumps(marker))

    proc = wc.run("verify", f"{pub.name}/{pub.rev}", "--cache-dir", cache_dir)
    message = assert_fails(proc, 4)
    assert relpath in message or "unsafe path" in message, message
    assert victim.read_text() == "operator data\n", "verify touched a file outside the cache"
    assert (rev_dir / ".weightcache").exists(), "verify changed the cache on a refused marker"
