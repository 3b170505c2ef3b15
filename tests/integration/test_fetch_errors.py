"""Bad input: one clear error line, the documented exit code, nothing written outside the cache
directory (design §2.2 exit codes 2 and 3, §2.1 manifest, §3 invariant 5)."""

from __future__ import annotations

import contextlib
import http.server
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import BUCKET, CLI, MANIFEST, Published, dead_endpoint, put_objects
from tests.support import modelgen
from tests.support.checks import assert_fails, describe, markers, snapshot
from tests.support.faultproxy import FaultProxy
from tests.support.proxy_handler import SLOWDOWN_BODY
from tests.support.webservers import serving, silent_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Env for the CLI with HOME and TMPDIR under tmp_path; after the test, everything
    under tmp_path except the cache directory (and our own logs) is as it was."""
    home, tmpdir, outside = tmp_path / "home", tmp_path / "tmpdir", tmp_path / "outside"
    for d in (home, tmpdir, outside):
        d.mkdir()
    before = _outside_cache(tmp_path)
    yield {"HOME": str(home), "TMPDIR": str(tmpdir)}
    after = _outside_cache(tmp_path)
    assert after == before, f"written outside the cache dir: {set(after) ^ set(before)}"


def _outside_cache(tmp_path: Path) -> dict[str, tuple[int, int]]:
    return {
        k: v
        for k, v in snapshot(tmp_path).items()
        if not k.startswith(("cache", "logs", "src/")) and k not in ("src",)
    }


def _model_objects(model: modelgen.Model) -> dict[str, bytes]:
    return {f.relpath: (model.root / f.relpath).read_bytes() for f in model.files}


@pytest.fixture
def model(tmp_path: Path) -> modelgen.Model:
    """A small model on disk (not uploaded); tests upload it with the manifest they want."""
    return modelgen.make_model(tmp_path / "src" / "m" / "r", [100_000, 50_000], manifest=False)


@pytest.fixture
def prefix(uniq: str) -> str:
    return f"{uniq}/m/r"


# --- source errors: exit 3 ---------------------------------------------------------------


def test_missing_manifest(
    wc: CLI, s3: object, model: modelgen.Model, prefix: str, cache_dir: Path,
    guarded: dict[str, str],
) -> None:  # fmt: skip
    put_objects(s3, BUCKET, prefix, _model_objects(model))
    message = assert_fails(wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, env=guarded), 3)
    assert re.search(r"SHA256SUMS|manifest", message, re.I), message
    assert markers(cache_dir) == []


def test_empty_prefix(wc: CLI, prefix: str, cache_dir: Path, guarded: dict[str, str]) -> None:
    """Nothing there (a typo in the URL, most likely): check the URL, not "write a
    SHA256SUMS with `weightcache manifest --write`", which would find nothing either."""
    message = assert_fails(wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, env=guarded), 3)
    assert prefix in message and "check the source URL" in message, message
    assert "--write" not in message, message


@pytest.mark.parametrize("kind", ["short-hash", "non-hex", "one-space", "no-path", "garbage"])
def test_malformed_manifest_line(
    wc: CLI, s3: object, model: modelgen.Model, prefix: str, cache_dir: Path,
    guarded: dict[str, str], proxy: FaultProxy, kind: str,
) -> None:  # fmt: skip
    objects = {**_model_objects(model),
               MANIFEST: modelgen.manifest_with_malformed_line(model, kind)}  # fmt: skip
    put_objects(s3, BUCKET, prefix, objects)
    proc = wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, endpoint=proxy.url, env=guarded)
    message = assert_fails(proc, 3)
    assert re.search(r"SHA256SUMS|manifest", message, re.I), message
    assert re.search(r"line 1\b|:1\b", message), f"the bad line is not located: {message}"
    _assert_nothing_downloaded(proxy, model)
    assert markers(cache_dir) == []


@pytest.mark.parametrize("same_hash", [False, True])
def test_duplicate_paths(
    wc: CLI, s3: object, model: modelgen.Model, prefix: str, cache_dir: Path,
    guarded: dict[str, str], proxy: FaultProxy, same_hash: bool,
) -> None:  # fmt: skip
    objects = {**_model_objects(model),
               MANIFEST: modelgen.manifest_with_duplicate(model, same_hash)}  # fmt: skip
    put_objects(s3, BUCKET, prefix, objects)
    proc = wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, endpoint=proxy.url, env=guarded)
    message = assert_fails(proc, 3)
    assert model.files[0].relpath in message, message
    _assert_nothing_downloaded(proxy, model)
    assert markers(cache_dir) == []


UNSAFE = ["../x", "../../../../outside/x", "a/../../x", "./../x", "/OUTSIDE/x", "//OUTSIDE/y"]


@pytest.mark.parametrize("unsafe", UNSAFE)
def test_unsafe_manifest_paths_are_rejected(
    wc: CLI, s3: object, model: modelgen.Model, prefix: str, cache_dir: Path, tmp_path: Path,
    guarded: dict[str, str], proxy: FaultProxy, unsafe: str,
) -> None:  # fmt: skip
    # Absolute paths point into tmp_path/outside, watched by `guarded`; an object exists
    # at the key a naive client would request, so only validation can stop the write.
    relpath = unsafe.replace("/OUTSIDE", str(tmp_path / "outside"))
    data = b"payload that must not land outside the cache\n"
    objects = {**_model_objects(model),
               MANIFEST: modelgen.manifest_with_extra_entry(model, relpath, data)}  # fmt: skip
    put_objects(s3, BUCKET, prefix, objects)
    if ".." not in relpath:  # the store refuses keys with `..` segments
        put_objects(s3, BUCKET, prefix, {relpath: data})
    proc = wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, endpoint=proxy.url, env=guarded)
    message = assert_fails(proc, 3)
    named = (relpath, relpath.removeprefix("./"))
    assert any(n in message for n in named), f"the unsafe path is not named: {message}"
    leaf = "/" + relpath.rsplit("/", 1)[-1]  # "/x" or "/y": no file of the model
    requested = proxy.stats().path_requests
    assert not [p for p in requested if p.endswith(leaf)], f"asked the store: {requested}"
    assert markers(cache_dir) == []
    assert list((tmp_path / "outside").iterdir()) == []


def test_manifest_lists_a_missing_object(
    wc: CLI, s3: object, model: modelgen.Model, prefix: str, cache_dir: Path,
    guarded: dict[str, str],
) -> None:  # fmt: skip
    manifest = modelgen.manifest_with_extra_entry(model, "model-extra.safetensors")
    objects = {**_model_objects(model), MANIFEST: manifest}
    put_objects(s3, BUCKET, prefix, objects)
    message = assert_fails(wc.fetch(f"s3://{BUCKET}/{prefix}", cache_dir, env=guarded), 3)
    assert "model-extra.safetensors" in message, message
    assert markers(cache_dir) == []


@pytest.mark.parametrize(
    "creds",
    [
        {"AWS_SECRET_ACCESS_KEY": "wrong-secret"},
        {"AWS_ACCESS_KEY_ID": "nobody", "AWS_SECRET_ACCESS_KEY": "nothing"},
    ],
    ids=["wrong-secret", "unknown-key"],
)
def test_wrong_credentials(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path, guarded: dict[str, str],
    creds: dict[str, str],
) -> None:  # fmt: skip
    pub = publish([10_000])
    proc = wc.fetch(pub.source, cache_dir, env={**guarded, **creds})
    message = assert_fails(proc, 3)
    assert "access denied" in message, message
    # the variable that holds the wrong value, named: the key the store does not know, or
    # the secret that does not match it
    wrong = "AWS_SECRET_ACCESS_KEY" if "AWS_ACCESS_KEY_ID" not in creds else "AWS_ACCESS_KEY_ID"
    assert wrong in message, message
    assert markers(cache_dir) == []


def test_missing_bucket(wc: CLI, cache_dir: Path, guarded: dict[str, str]) -> None:
    proc = wc.fetch("s3://no-such-bucket-wc/p/m/r", cache_dir, env=guarded)
    message = assert_fails(proc, 3)
    assert "no-such-bucket-wc" in message, message


ENDLESS_PAGE = b"""<ListBucketResult><IsTruncated>true</IsTruncated>
<Contents><Key>m/r/a</Key><Size>1</Size></Contents>
<NextContinuationToken>again</NextContinuationToken></ListBucketResult>"""


class _Answering(http.server.BaseHTTPRequestHandler):
    """A store on loopback whose `do_GET` answers with `answer`, quietly."""

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def hostile_store() -> Iterator[Callable[[bytes], str]]:
    """`answer(body)`: the URL of a server on loopback that answers every request 200 with
    `body`: a broken store, or something else at the endpoint."""
    with contextlib.ExitStack() as servers:

        def answer(body: bytes) -> str:
            class Handler(_Answering):
                def do_GET(self) -> None:
                    self.answer(200, body)

            return servers.enter_context(serving(Handler))

        yield answer


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"<html><body>It works!</body></html", "is not ListObjectsV2 XML"),
        (b"<html><body>It works!</body></html>", "is not ListObjectsV2 XML"),
        (b"<R><Contents><Key>m/r/a</Key><Size>big</Size></Contents></R>", "not ListObjectsV2"),
        (ENDLESS_PAGE, "its listing is broken"),
        (
            b"<ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>m/r2/a</Key>"
            b"<Size>1</Size></Contents></ListBucketResult>",
            "outside the prefix",
        ),
        (
            b"<ListBucketResult><IsTruncated>false</IsTruncated>" + b"<Contents><Key>m/r/a</Key>"
            b"<Size>1</Size></Contents>" * 2 + b"</ListBucketResult>",
            "'m/r/a' twice",
        ),
    ],
    ids=["not-xml", "html", "size-not-a-number", "endless", "outside", "twice"],
)
def test_a_listing_that_is_not_one_is_a_source_error(
    wc: CLI, cache_dir: Path, guarded: dict[str, str], hostile_store: Callable[[bytes], str],
    body: bytes, said: str,
) -> None:  # fmt: skip
    """Whatever answers at the endpoint, its listing is checked where it enters: exit 3
    naming the endpoint, not an unexpected error or a listing that never ends."""
    endpoint = hostile_store(body)
    message = assert_fails(
        wc.fetch("s3://models/m/r", cache_dir, endpoint=endpoint, env=guarded), 3
    )
    assert said in message and endpoint in message, message
    assert markers(cache_dir) == []


def test_a_listing_of_empty_pages_each_with_a_new_token_ends(
    wc: CLI, cache_dir: Path, guarded: dict[str, str]
) -> None:
    """A store that hands out a new continuation token with every empty page paged 663
    times in 30 s and never ended."""
    pages = itertools.count()

    class Handler(_Answering):
        def do_GET(self) -> None:
            self.answer(200, b"<ListBucketResult><IsTruncated>true</IsTruncated>"
                        b"<NextContinuationToken>%d</NextContinuationToken>"
                        b"</ListBucketResult>" % next(pages))  # fmt: skip

    with serving(Handler) as endpoint:
        message = assert_fails(
            wc.fetch("s3://models/m/r", cache_dir, endpoint=endpoint, env=guarded), 3
        )
    assert "pages without a key" in message, message
    assert next(pages) <= 20


def test_a_web_page_at_the_endpoint_is_a_source_error_through_boto3_too(
    wc: CLI, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory,
    guarded: dict[str, str], hostile_store: Callable[[bytes], str],
) -> None:  # fmt: skip
    """Credentials from a file go through boto3, which reads a web page as an empty
    listing: that is not "no SHA256SUMS" but an endpoint that is no S3 store."""
    credentials = tmp_path_factory.mktemp("aws") / "credentials"
    credentials.write_text("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
    env = {**guarded, "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None,
           "AWS_SHARED_CREDENTIALS_FILE": str(credentials)}  # fmt: skip
    endpoint = hostile_store(b"<html><body>It works!</body></html>")
    proc = wc.fetch("s3://models/m/r", cache_dir, endpoint=endpoint, env=env)
    message = assert_fails(proc, 3)
    assert "not ListObjectsV2" in message and endpoint in message, message


@pytest.mark.parametrize(
    ("variable", "setting"),
    [
        ("AWS_PROFILE", "no-such-profile"),
        ("AWS_SHARED_CREDENTIALS_FILE", "garbage"),
        ("AWS_CA_BUNDLE", "/nonexistent/ca.pem"),
    ],
)
def test_a_broken_aws_setting_is_exit_2_naming_it(
    wc: CLI, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory,
    guarded: dict[str, str], variable: str, setting: str,
) -> None:  # fmt: skip
    """Configuration, not the network: exit 2 at once naming the variable, not retries
    until --timeout and exit 6 "check that the object store is reachable"."""
    env: dict[str, str | None] = {**guarded, variable: setting}
    endpoint = dead_endpoint()
    if variable != "AWS_CA_BUNDLE":  # through boto3: credentials not from the environment
        env.update(AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None)
    else:
        endpoint = endpoint.replace("http://", "https://")
    if setting == "garbage":
        garbage = tmp_path_factory.mktemp("aws") / "garbage"
        garbage.write_text("[default\nnot = an ini file")
        env[variable] = str(garbage)
    proc = wc.fetch("s3://models/m/r", cache_dir, "--timeout", "20s", endpoint=endpoint,
                    env=env, timeout=60)  # fmt: skip
    message = assert_fails(proc, 2)
    assert variable in message, message


def test_an_unreachable_store_is_exit_6_naming_the_endpoint_and_its_variable(
    wc: CLI, cache_dir: Path, guarded: dict[str, str]
) -> None:
    """The endpoint a newcomer got wrong (a port, a variable left over from elsewhere): the
    error says which one was tried, and that AWS_ENDPOINT_URL chose it."""
    endpoint = dead_endpoint()
    proc = wc.run("fetch", "s3://models/p/m/r", "--cache-dir", cache_dir, "--timeout", "3s",
                  env={**guarded, "AWS_ENDPOINT_URL": endpoint}, timeout=60)  # fmt: skip
    message = assert_fails(proc, 6)
    assert endpoint in message and "AWS_ENDPOINT_URL" in message, message
    # one warning for each call that retries, not one per attempt; the error counts them
    assert re.search(r"\d+ attempts in \d+s", message), message
    warnings = [line for line in proc.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) <= 2 and "attempt 2/" not in proc.stderr, describe(proc)
    verbose = wc.run("-vv", "fetch", "s3://models/p/m/r", "--cache-dir", cache_dir, "--timeout",
                     "3s", env={**guarded, "AWS_ENDPOINT_URL": endpoint}, timeout=60)  # fmt: skip
    assert "attempt 2/" in verbose.stderr, describe(verbose)


# --- the cache directory -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["name", "revision", "internal"])
def test_symlink_out_of_the_cache_is_refused(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path, tmp_path: Path,
    guarded: dict[str, str], where: str,
) -> None:  # fmt: skip
    """DIR/<name>, DIR/<name>/<rev> or DIR/.weightcache planted as a symlink to a directory
    outside DIR: refuse (exit 2) and write nothing there."""
    pub = publish([200_000])
    outside = tmp_path / "outside"
    if where == "name":
        link = cache_dir / pub.name
    elif where == "revision":
        link = cache_dir / pub.name / pub.rev
    else:
        link = cache_dir / ".weightcache"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside, target_is_directory=True)
    proc = wc.fetch(pub.source, cache_dir, env=guarded)
    message = assert_fails(proc, 2)
    assert str(link) in message or link.name in message, message
    assert list(outside.iterdir()) == []


def test_cache_dir_is_a_file(wc: CLI, tmp_path: Path, guarded: dict[str, str]) -> None:
    not_a_dir = tmp_path / "cachefile"
    not_a_dir.write_text("")
    message = assert_fails(wc.fetch("s3://models/p/m/r", not_a_dir, env=guarded), 2)
    assert "cachefile" in message, message


# --- usage errors: exit 2, before any network --------------------------------------------


def _opt(args: list[str], env: dict[str, str], mention: str) -> object:
    label = " ".join(args) or " ".join(f"{k}={v}" for k, v in env.items())
    return pytest.param(args, env, mention, id=label)


@pytest.mark.parametrize(
    ("args", "env", "mention"),
    [
        _opt(["--part-size", "banana"], {}, "part-size"),
        _opt(["--part-size", "0"], {}, "part-size"),
        _opt(["--part-size", "-1M"], {}, "part-size"),
        _opt(["--max-concurrency", "0"], {}, "concurrency"),
        _opt(["--max-concurrency", "-3"], {}, "concurrency"),
        _opt(["--max-concurrency", "many"], {}, "concurrency"),
        _opt(["--bwlimit", "-1"], {}, "bwlimit"),
        _opt(["--bwlimit", "fast"], {}, "bwlimit"),
        _opt(["--timeout", "soon"], {}, "timeout"),
        _opt(["--timeout", "-5s"], {}, "timeout"),
        _opt([], {"WEIGHTCACHE_PART_SIZE": "banana"}, "part"),
        _opt([], {"WEIGHTCACHE_MAX_CONCURRENCY": "0"}, "concurrency"),
        _opt([], {"WEIGHTCACHE_BWLIMIT": "-1"}, "bwlimit"),
        _opt(["--frobnicate"], {}, "frobnicate"),
    ],
)
def test_invalid_options(
    wc: CLI, cache_dir: Path, guarded: dict[str, str], args: list[str],
    env: dict[str, str], mention: str,
) -> None:  # fmt: skip
    proc = wc.fetch("s3://models/p/m/r", cache_dir, *args, endpoint=dead_endpoint(),
                    env={**guarded, **env}, timeout=30)  # fmt: skip
    message = assert_fails(proc, 2)
    assert mention in message.lower().replace("_", "-"), message


def test_missing_cache_dir(wc: CLI, guarded: dict[str, str]) -> None:
    message = assert_fails(wc.run("fetch", "s3://models/p/m/r", env=guarded), 2)
    assert "cache-dir" in message.lower().replace("_", "-"), message


@pytest.mark.parametrize(
    "source",
    ["models/p/m/r", "s3://", "s3://models", "s3://models/", "s3://models/onlyname",
     "s3:///p/m/r", "ftp://models/p/m/r", "https://u:pw@models/p/m/r", "s3://models/p/m/..",
     "s3://models/p/../r",
     "s3://models/p/m/.weightcache"],
)  # fmt: skip
def test_invalid_source(wc: CLI, cache_dir: Path, guarded: dict[str, str], source: str) -> None:
    proc = wc.fetch(source, cache_dir, endpoint=dead_endpoint(), env=guarded, timeout=30)
    message = assert_fails(proc, 2)
    segments = [s for s in source.split("/") if s not in ("", "s3:", "models", "p")]
    assert source in message or any(repr(s) in message for s in segments), (
        f"the error does not say which SOURCE is wrong: {message}"
    )


@pytest.mark.parametrize(
    "opts",
    [["--name", ".."], ["--name", "a/b"], ["--revision", "../evil"], ["--name", ".weightcache"],
     ["--name", "/abs"]],
    ids=["dotdot", "slash", "rev-dotdot", "marker-name", "absolute"],
)  # fmt: skip
def test_invalid_name_or_revision(
    wc: CLI, cache_dir: Path, guarded: dict[str, str], opts: list[str]
) -> None:
    proc = wc.fetch("s3://models/p/m/r", cache_dir, *opts, endpoint=dead_endpoint(),
                    env=guarded, timeout=30)  # fmt: skip
    assert_fails(proc, 2)


def _assert_nothing_downloaded(proxy: FaultProxy, model: modelgen.Model) -> None:
    """A rejected manifest is rejected before any of its files is fetched."""
    s = proxy.stats()
    fetched = {f.relpath: s.bytes_for("/" + f.relpath) for f in model.files}
    assert not any(fetched.values()), f"downloaded despite a bad manifest: {fetched}"


def test_sigterm_ends_a_listing_waiting_on_a_silent_store(wc: CLI, cache_dir: Path) -> None:
    """A store that accepts and never answers: SIGTERM (the kubelet deleting the Pod) ends
    the fetch at once with exit 143; the listing's request used to hold it until its retries
    were spent (5 of 60 s: exit 6 after 300 s)."""
    with silent_server() as server:
        running = wc.fetch_popen("s3://models/m/r", cache_dir, "--no-daemon", endpoint=server.url)
        server.wait_accepted(1)  # the LIST sent, and waiting
        done, seconds = running.sigterm()
        assert seconds < 5, describe(done)
    assert "interrupted" in assert_fails(done, 143)
    assert markers(cache_dir) == []


def test_a_failed_listing_stops_the_sha256sums_request_in_the_background(
    wc: CLI, cache_dir: Path, guarded: dict[str, str]
) -> None:
    """SHA256SUMS is requested beside the listing; once the listing's error ends the fetch,
    that request is abandoned, not retried: a wrong endpoint printed its error line and
    then kept the process alive for its retries. The store holds each SHA256SUMS GET
    until the error line is out, then answers it 503 SlowDown: no GET may follow."""
    released, late = threading.Event(), []

    class Handler(_Answering):
        def do_GET(self) -> None:
            if not self.path.split("?")[0].endswith("/SHA256SUMS"):
                self.answer(200, b"<html>not a listing</html>")  # a SourceError at once
                return
            if released.is_set():
                late.append(self.path)
            released.wait(60)
            self.answer(503, SLOWDOWN_BODY)

    with serving(Handler) as endpoint:
        running = wc.fetch_popen("s3://models/m/r", cache_dir, "--no-daemon", "--timeout",
                                 "60s", endpoint=endpoint, env=guarded)  # fmt: skip
        try:
            while "weightcache: error:" not in running.stderr_path.read_text(errors="replace"):
                assert running.poll() is None, describe(running.finish())
                time.sleep(0.05)
        finally:
            released.set()
        done = running.finish()
    assert "not ListObjectsV2" in assert_fails(done, 3)
    assert not late, f"SHA256SUMS requested {len(late)} more time(s) after the listing failed"
