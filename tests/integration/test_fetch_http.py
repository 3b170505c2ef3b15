"""A revision as a directory of a web server (http(s)://, design §4, Revision sources):
listed by its SHA256SUMS, sized by HEADs, read with ranged GETs (nginx), or whole, one GET
per file, from a server that ignores Range (Python's http.server); the same verification,
resume and dedup as from S3."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI, Published
from tests.integration.daemon_helpers import (
    Daemons,
    daemons,  # noqa: F401 - fixture
    write_models,
)
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_ok_path,
    assert_revision_ok,
    blobs_dir,
    describe,
    kill9_mid_download,
    markers,
)
from tests.support.modelgen import MANIFEST, Model, make_model
from tests.support.webservers import TOKEN, Nginx, NoRangeServer, silent_server

MiB = 1024 * 1024
IGNORES_RANGE = "ignores Range"


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory both web servers serve; each test writes under its own subdirectory."""
    return tmp_path_factory.mktemp("served")


@pytest.fixture(scope="session")
def nginx(served: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        pytest.skip("nginx is not installed (.ci/run installs nginx-light)")
    server = Nginx(served, tmp_path_factory.mktemp("nginx")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def norange(served: Path) -> Iterator[NoRangeServer]:
    server = NoRangeServer(served).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gets_only(served: Path) -> Iterator[NoRangeServer]:
    server = NoRangeServer(served, head=False).start()
    yield server
    server.stop()


@pytest.fixture(params=["nginx", "norange"])
def base(request: pytest.FixtureRequest) -> str:
    """The URL of each server in turn: one that honours Range, one that ignores it."""
    url: str = request.getfixturevalue(request.param).url
    return url


def _model(served: Path, where: str, sizes: list[int], **kwargs: object) -> Model:
    """A model at <served>/<where>/llama/v1."""
    return make_model(served / where / "llama" / "v1", sizes, **kwargs)  # type: ignore[arg-type]


def _fetch_json(wc: CLI, source: str, cache_dir: Path, *extra: str) -> dict[str, object]:
    proc = wc.fetch(source, cache_dir, "--no-daemon", "--json", *extra)
    assert proc.returncode == 0, describe(proc)
    result: dict[str, object] = json.loads(proc.stdout)
    result["stderr"] = proc.stderr
    return result


def test_miss_then_hit(
    wc: CLI, served: Path, base: str, uniq: str, cache_dir: Path, norange: NoRangeServer
) -> None:
    model = _model(served, uniq, [3 * MiB, 1 * MiB], extra_files={"sub/a b%.bin": b"x" * 999})
    url = f"{base}/{uniq}/llama/v1"
    first = _fetch_json(wc, url, cache_dir, "--part-size", "256K")
    assert first["hit"] is False and first["bytes_from_origin"] == model.total_size, first
    assert_revision_ok(cache_dir, "llama", "v1", model)
    marker = json.loads((cache_dir / "llama" / "v1" / ".weightcache").read_text())
    assert marker["source"] == url
    # Only the server that ignores Range is read whole (found by one probe).
    assert (IGNORES_RANGE in str(first["stderr"])) is (base == norange.url), first
    again = _fetch_json(wc, url, cache_dir)
    assert again["hit"] is True and again["bytes_from_origin"] == 0, again


@pytest.mark.timeout(180)
def test_kill9_then_resume(
    wc: CLI, served: Path, base: str, uniq: str, cache_dir: Path, norange: NoRangeServer
) -> None:
    model = _model(served, uniq, [24 * MiB], small_files=False)
    url = f"{base}/{uniq}/llama/v1"
    args = ("--no-daemon", "--part-size", "1M", "--max-concurrency", "4")
    running = wc.fetch_popen(url, cache_dir, *args, "--bwlimit", "3M")
    kill9_mid_download(running, cache_dir)
    tmp = cache_dir / ".weightcache" / "tmp"
    (state,) = tmp.glob("*.part.json")
    parts = len(json.loads(state.read_text())["written"])
    # A server that ignores Range sends each file whole: one part, one reader.
    assert parts == (1 if base == norange.url else 24), parts
    resumed = _fetch_json(wc, url, cache_dir, *args)
    assert "resuming" in str(resumed["stderr"]), resumed
    assert_revision_ok(cache_dir, "llama", "v1", model)
    # 2.5 s at 3 MiB/s is ~7 MiB; a kill loses at most the 4 parts in flight. (A server
    # that ignores Range sends the written prefix again; it is dropped, not rewritten.)
    assert int(str(resumed["bytes_from_origin"])) <= model.total_size - 2 * MiB, resumed


def test_a_corrupted_file_is_exit_4_and_nothing_is_published(
    wc: CLI, served: Path, base: str, uniq: str, cache_dir: Path
) -> None:
    model = _model(served, uniq, [2 * MiB, 1 * MiB])
    bad = model.shard_names()[0]
    with open(model.root / bad, "r+b") as f:  # same size, one byte differs
        f.seek(MiB)
        byte = f.read(1)
        f.seek(MiB)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = wc.fetch(f"{base}/{uniq}/llama/v1", cache_dir, "--no-daemon", "--part-size", "256K")
    message = assert_fails(proc, 4)
    assert "sha256 mismatch" in message and bad in message, message
    assert markers(cache_dir) == []
    assert not (cache_dir / "llama" / "v1").exists()
    assert not (blobs_dir(cache_dir) / model.hashes[bad]).exists()
    assert_blobs_valid(cache_dir)


def test_a_missing_file_is_exit_3(
    wc: CLI, served: Path, base: str, uniq: str, cache_dir: Path
) -> None:
    model = _model(served, uniq, [1 * MiB])
    (model.root / "config.json").unlink()
    message = assert_fails(wc.fetch(f"{base}/{uniq}/llama/v1", cache_dir, "--no-daemon"), 3)
    assert "config.json" in message and "404" in message, message
    assert markers(cache_dir) == []


def test_the_same_file_from_s3_and_from_http_is_stored_once(
    wc: CLI, publish: Callable[..., Published], served: Path, base: str, uniq: str,
    cache_dir: Path,
) -> None:  # fmt: skip
    pub = publish([2 * MiB, 1 * MiB], name="m", rev="r1")  # also on disk at pub.model.root
    (served / uniq / "m").mkdir(parents=True)
    (served / uniq / "m" / "r1").symlink_to(pub.model.root)
    assert _fetch_json(wc, pub.source, cache_dir)["bytes_from_origin"] == pub.model.total_size
    web = _fetch_json(wc, f"{base}/{uniq}/m/r1", cache_dir, "--revision", "from-web")
    assert web["bytes_from_origin"] == 0, web
    assert_revision_ok(cache_dir, "m", "r1", pub.model)
    assert_revision_ok(cache_dir, "m", "from-web", pub.model)
    assert assert_blobs_valid(cache_dir) == len(set(pub.model.hashes.values()))


def test_manifest_hashes_the_files_in_place_and_cannot_write(
    wc: CLI, served: Path, base: str, uniq: str
) -> None:
    model = _model(served, uniq, [3 * MiB, 0, 100_000])
    url = f"{base}/{uniq}/llama/v1"
    proc = wc.run("manifest", url, "--part-size", "1M")
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout == model.manifest_text
    refused = wc.run("manifest", url, "--write")
    assert refused.returncode == 2, describe(refused)
    assert "s3:// only" in refused.stderr


def test_no_manifest_is_exit_3_saying_how_to_make_one(
    wc: CLI, served: Path, nginx: Nginx, uniq: str, cache_dir: Path
) -> None:
    _model(served, uniq, [1 * MiB], manifest=False)
    url = f"{nginx.url}/{uniq}/llama/v1"
    message = assert_fails(wc.fetch(url, cache_dir, "--no-daemon"), 3)
    assert f"no {MANIFEST} at {url}/{MANIFEST}" in message, message
    assert "sha256sum > SHA256SUMS" in message, message
    assert_fails(wc.run("manifest", url), 3)


@pytest.mark.parametrize("server", ["nginx", "gets_only"])
def test_a_server_that_refuses_head_is_sized_by_a_ranged_get(
    wc: CLI, served: Path, uniq: str, cache_dir: Path, server: str,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """nginx's /nohead/ answers HEAD 405 and honours Range (206, and 416 for the empty
    file); the GET-only server answers HEAD 501 and ignores Range (200)."""
    model = _model(served, f"nohead/{uniq}", [3 * MiB + 5, 1 * MiB],
                   extra_files={"empty.txt": b""})  # fmt: skip
    url = f"{request.getfixturevalue(server).url}/nohead/{uniq}/llama/v1"
    miss = _fetch_json(wc, url, cache_dir, "--part-size", "1M")
    assert miss["hit"] is False
    assert_revision_ok(cache_dir, "llama", "v1", model)
    assert_blobs_valid(cache_dir)
    assert _fetch_json(wc, url, cache_dir)["hit"] is True


def test_a_server_that_gzips_its_answers_is_exit_3_naming_the_encoding(
    wc: CLI, served: Path, uniq: str, cache_dir: Path
) -> None:
    """Its bytes are not the file's: no retry fixes it ('the file changed, run it again'
    never helps), the server's configuration does."""
    _model(served, f"gzip/{uniq}", [300_000])
    server = NoRangeServer(served, gzips=True).start()
    try:
        proc = wc.fetch(f"{server.url}/gzip/{uniq}/llama/v1", cache_dir, "--no-daemon")
    finally:
        server.stop()
    message = assert_fails(proc, 3)
    assert "Content-Encoding: gzip" in message and "compression" in message, message
    assert markers(cache_dir) == []


def test_a_bearer_token_from_the_environment(
    wc: CLI, served: Path, nginx: Nginx, uniq: str, cache_dir: Path
) -> None:
    model = _model(served, f"private/{uniq}", [1 * MiB])
    url = f"{nginx.url}/private/{uniq}/llama/v1"
    message = assert_fails(wc.fetch(url, cache_dir, "--no-daemon"), 3)
    assert "401" in message and "set WEIGHTCACHE_HTTP_TOKEN" in message, message
    wrong = wc.fetch(url, cache_dir, "--no-daemon", env={"WEIGHTCACHE_HTTP_TOKEN": "nope"})
    assert "the token in WEIGHTCACHE_HTTP_TOKEN" in assert_fails(wrong, 3)
    proc = wc.fetch(url, cache_dir, "--no-daemon", env={"WEIGHTCACHE_HTTP_TOKEN": TOKEN})
    assert_ok_path(proc, cache_dir / "llama" / "v1")
    assert_revision_ok(cache_dir, "llama", "v1", model)


def test_429_is_throttling_retried_with_aimd(
    wc: CLI, served: Path, nginx: Nginx, uniq: str, cache_dir: Path
) -> None:
    """nginx's request rate limit (20/s, burst 2) answers 429: slowed down, not failed."""
    model = _model(served, f"throttled/{uniq}", [4 * MiB], small_files=False)
    url = f"{nginx.url}/throttled/{uniq}/llama/v1"
    proc = wc.fetch(url, cache_dir, "--no-daemon", "--part-size", "256K",
                    "--max-concurrency", "8", timeout=90)  # fmt: skip
    assert_ok_path(proc, cache_dir / "llama" / "v1")
    assert "HTTP 429" in proc.stderr, describe(proc)
    assert_revision_ok(cache_dir, "llama", "v1", model)


def test_https_trusts_the_system_bundle_or_ssl_cert_file(
    wc: CLI, served: Path, nginx: Nginx, uniq: str, cache_dir: Path
) -> None:
    model = _model(served, uniq, [1 * MiB])
    url = f"{nginx.tls_url}/{uniq}/llama/v1"
    message = assert_fails(wc.fetch(url, cache_dir, "--no-daemon"), 3)
    assert "certificate" in message and "SSL_CERT_FILE" in message, message
    proc = wc.fetch(url, cache_dir, "--no-daemon", env={"SSL_CERT_FILE": str(nginx.cert)})
    assert_ok_path(proc, cache_dir / "llama" / "v1")
    assert_revision_ok(cache_dir, "llama", "v1", model)


@pytest.mark.timeout(150)
def test_the_daemon_fetches_http_sources_under_its_allow_source_prefixes(
    wc: CLI, store: Any, served: Path, nginx: Nginx, uniq: str, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    allowed = _model(served, f"{uniq}/team", [1 * MiB], seed="a")
    other = _model(served, f"{uniq}/other", [1 * MiB], seed="b")
    models = write_models(tmp_path / "models.yaml", [])
    daemons.start(cache_dir, models, endpoint=store.endpoint_url,
                  allow_source=(f"{nginx.url}/{uniq}/team",))  # fmt: skip
    pod = wc.fetch(f"{nginx.url}/{uniq}/team/llama/v1", cache_dir)
    assert_ok_path(pod, cache_dir / "llama" / "v1")
    assert "fetching alone" not in pod.stderr, describe(pod)
    assert_revision_ok(cache_dir, "llama", "v1", allowed)
    alone = wc.fetch(f"{nginx.url}/{uniq}/other/llama/v1", cache_dir, "--revision", "v2")
    assert_ok_path(alone, cache_dir / "llama" / "v2")
    assert f"does not fetch {nginx.url}/{uniq}/other/llama/v1 for" in alone.stderr, describe(alone)
    assert_revision_ok(cache_dir, "llama", "v2", other)


def test_a_silent_server_fails_within_timeout_and_sigterm_ends_the_wait(
    wc: CLI, cache_dir: Path
) -> None:
    """A web server that accepts and never answers: `--timeout 2s` is exit 6 within about
    that (it was 6 minutes: 6 tries of 30 s, twice), and SIGTERM ends the wait at once with
    exit 143 (it was ignored until the tries were spent)."""
    with silent_server() as server:
        url = f"{server.url}/m/v1"
        began = time.monotonic()
        proc = wc.fetch(url, cache_dir, "--no-daemon", "--timeout", "2s", timeout=60)
        assert "--timeout" in assert_fails(proc, 6)
        assert time.monotonic() - began < 15, describe(proc)
        running = wc.fetch_popen(url, cache_dir, "--no-daemon")
        server.wait_accepted(2)  # its GET of SHA256SUMS sent, and waiting
        done, seconds = running.sigterm(timeout=30)
        assert seconds < 5, describe(done)
        assert "interrupted" in assert_fails(done, 143)
        assert "Remote end closed" not in done.stderr, describe(done)
