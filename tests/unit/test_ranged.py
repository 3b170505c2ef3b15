"""The downloader in-process, through the BlobSource seam: parts read in parallel and written
at their offsets, resume after a download stopped short, a range that breaks resumed at the
byte where it broke, a source's patience and throttling, a digest mismatch reported, the
stall clock. Sources are local files (`FileBlob`) and small wrappers around them."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from weightcache.config import OriginSettings
from weightcache.errors import (
    IntegrityError,
    Interrupted,
    NoSpaceError,
    SourceError,
    TransientError,
    WeightcacheError,
)
from weightcache.swarm.server import PARTIAL_WAIT
from weightcache.transfer import downloader as ranged
from weightcache.transfer import partial as partial_module
from weightcache.transfer.backends.file import FileBlob
from weightcache.transfer.downloader import BlobJob, RangedDownloader
from weightcache.transfer.pacing import Backoff
from weightcache.transfer.partial import PartialFile, state_path
from weightcache.transfer.parts import PartState, plan_parts
from weightcache.transfer.sources import READ_TIMEOUT, BlobSource, RangeReader, RetryRange

KiB = 1 << 10
PART = 256 * KiB  # the smallest part size the settings accept


def settings(**kw: object) -> OriginSettings:
    kw.setdefault("part_size", PART)
    kw.setdefault("max_concurrency", 4)
    kw.setdefault("timeout", 60.0)
    return OriginSettings(**kw)  # type: ignore[arg-type]


def downloader(**kw: object) -> RangedDownloader:
    """A downloader that retries at once (no backoff sleeps in unit tests)."""
    return RangedDownloader(settings(**kw), backoff=Backoff(base=0.0, cap=0.0))


@pytest.fixture
def blob(tmp_path: Path) -> tuple[Path, bytes]:
    """A 10-part blob (the last part short) in a local file, and its bytes."""
    data = random.Random(7).randbytes(9 * PART + 1234)
    path = tmp_path / "origin" / "model.bin"
    path.parent.mkdir()
    path.write_bytes(data)
    return path, data


@pytest.fixture
def one_part(tmp_path: Path) -> Path:
    """A blob of exactly one part, in a local file."""
    path = tmp_path / "one-part.bin"
    path.write_bytes(random.Random(8).randbytes(PART))
    return path


def job(source: BlobSource, size: int, tmp_path: Path) -> BlobJob:
    return BlobJob(source, size, tmp_path / "blob.part", "model.bin")


class Wrapped:
    """A BlobSource around a FileBlob: records each range opened (start, end, thread) and
    lets a test act on each read (`on_read(start, read_so_far)`) or on each open."""

    kind = "origin"
    throttles = True

    def __init__(
        self, path: Path, attempts: int | None = None,
        on_open: Callable[[int, int], None] | None = None,
        on_read: Callable[[int, int], None] | None = None, chunk: int | None = None,
    ) -> None:  # fmt: skip
        self.inner = FileBlob(path)
        self.attempts = attempts
        self.opened: list[tuple[int, int]] = []
        self.left_unread: list[tuple[int, int]] = []  # ranges left without an exception
        self.threads: set[int] = set()
        self.timeouts: set[float] = set()
        self._on_open, self._on_read, self._chunk = on_open, on_read, chunk
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return self.inner.where

    @contextlib.contextmanager
    def open_range(self, start: int, end: int, size: int, timeout: float) -> Iterator[RangeReader]:
        with self._lock:
            self.opened.append((start, end))
            self.timeouts.add(timeout)
            self.threads.add(threading.get_ident())
        if self._on_open is not None:
            self._on_open(start, end)
        with self.inner.open_range(start, end, size, timeout) as reader:
            wrapped = _Reader(reader, start, self._on_read, self._chunk)
            yield wrapped
            if wrapped._read < end - start:  # an HTTP source would keep a connection
                self.left_unread.append((start + wrapped._read, end))  # with a body unread


class _Reader:
    def __init__(
        self, inner: RangeReader, start: int, on_read: Callable[[int, int], None] | None,
        chunk: int | None,
    ) -> None:  # fmt: skip
        self._inner, self._start, self._on_read, self._chunk = inner, start, on_read, chunk
        self._read = 0

    def readinto(self, buf: memoryview) -> int:
        if self._on_read is not None:
            self._on_read(self._start, self._read)
        n = self._inner.readinto(buf[: self._chunk] if self._chunk else buf)
        self._read += n
        return n


def test_parts_are_read_in_parallel_and_written_at_their_offsets(
    blob: tuple[Path, bytes], tmp_path: Path
) -> None:
    path, data = blob
    ready = threading.Barrier(4, timeout=30)  # four parts in flight at once, or it breaks

    def meet(start: int, end: int) -> None:
        if start < 4 * PART:
            ready.wait()

    source = Wrapped(path, on_open=meet)
    j = job(source, len(data), tmp_path)
    done = RangedDownloader(settings()).download([j])
    assert done.digests == {"model.bin": hashlib.sha256(data).hexdigest()}
    assert done.received == {"origin": len(data)}
    assert j.partial.read_bytes() == data
    assert sorted(source.opened) == plan_parts(len(data), PART)
    assert len(source.threads) == 4


def test_the_part_at_the_hash_frontier_is_hashed_as_it_lands(tmp_path: Path) -> None:
    """What is hashed when the last byte lands is not left to hash after it: bytes that
    extend the hashed prefix are hashed from the buffer they came in, as they are written;
    others wait for their part's turn (`advance_hash`, which reads them back)."""
    data = random.Random(9).randbytes(4 * PART)
    view = memoryview(data)
    partial = PartialFile.open(tmp_path / "b.part", "b", len(data), 2 * PART)  # two parts

    def land(index: int, start: int, end: int) -> None:
        partial.write(view[start:end], start)
        partial.wrote(index, end)
        partial.hash_landed(view[start:end], start)

    try:
        land(1, 2 * PART, 3 * PART)  # the second part first: not at the frontier
        assert partial.hashed == 0
        land(0, 0, PART)
        assert partial.hashed == PART  # the first part, half written: hashed so far
        land(0, PART, 2 * PART)
        partial.mark_done(0)
        land(1, 3 * PART, 4 * PART)
        partial.mark_done(1)
        assert partial.finish(bytearray(PART)) == hashlib.sha256(data).hexdigest()
    finally:
        partial.close()


def test_a_new_partial_saves_its_state_with_its_first_bytes_and_a_stale_one_at_once(
    tmp_path: Path,
) -> None:
    """Opening a new partial writes no part state (nothing to record yet, and one file
    less before a cold fetch's first GET): the first write saves it. A state that claims
    bytes of a file that is no longer theirs is replaced when the file is reset."""
    data = random.Random(3).randbytes(2 * PART)
    path = tmp_path / "b.part"
    partial = PartialFile.open(path, "b", len(data), PART)
    try:
        assert not state_path(path).exists()
        partial.write(memoryview(data)[:PART], 0)
        partial.wrote(0, PART)
        assert PartState.load(state_path(path), len(data), PART).bytes_done() == PART
    finally:
        partial.close()
    os.truncate(path, PART)  # the file lost its preallocation: its state's claim is void
    reopened = PartialFile.open(path, "b", len(data), PART)
    try:  # at once: a kill before the first write must not leave the claim on disk
        assert PartState.load(state_path(path), len(data), PART).bytes_done() == 0
    finally:
        reopened.close()
    assert PartState.load(state_path(path), len(data), PART).bytes_done() == 0


def test_a_partial_longer_than_its_blob_is_cut_to_the_blob_size(tmp_path: Path) -> None:
    """The digest covers only the blob's bytes: any beyond them would go into the cache."""
    path = tmp_path / "b.part"
    path.write_bytes(b"x" * (3 * PART))
    partial = PartialFile.open(path, "b", 2 * PART, PART)
    try:
        assert os.fstat(partial.fd).st_size == 2 * PART
    finally:
        partial.close()


def test_a_partial_is_writable_by_its_owner_even_when_a_kill_left_it_read_only(
    tmp_path: Path,
) -> None:
    """Publishing chmods a verified partial 0444 before its rename; killed in between, a
    non-root fetch could not open it for writing again. Root ignores modes: as root, the
    opens run in a child process as another uid (as the image's 65532 would)."""
    root = os.geteuid() == 0
    # Directly under /tmp: the other uid cannot pass pytest's 0700 directories.
    tmp = Path(tempfile.mkdtemp()) if root else tmp_path
    path = tmp / "b.part"
    if root:
        os.chown(tmp, 65534, 65534)

    def open_it() -> None:
        pid = os.fork()
        if pid == 0:  # the child: no threads, nothing but the open
            try:
                if root:
                    os.setgid(65534)
                    os.setuid(65534)
                PartialFile.open(path, "b", PART, PART).close()
            except BaseException:
                os._exit(1)
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the open failed"

    try:
        open_it()
        assert path.stat().st_mode & 0o600 == 0o600
        path.chmod(0o444)
        open_it()
        assert path.stat().st_mode & 0o200
    finally:
        if root:
            shutil.rmtree(tmp)


def test_a_disk_too_full_to_preallocate_fails_the_open_and_closes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    opened: list[int] = []
    closed: list[int] = []
    os_open, os_close = os.open, os.close
    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(os, "open", lambda *a: opened.append(os_open(*a)) or opened[-1])
    monkeypatch.setattr(os, "close", lambda fd: (closed.append(fd), os_close(fd))[1])
    with pytest.raises(NoSpaceError):
        PartialFile.open(tmp_path / "b.part", "b", PART, PART)
    assert len(opened) == 1
    assert closed == opened


def test_close_closes_the_file(tmp_path: Path) -> None:
    partial = PartialFile.open(tmp_path / "b.part", "b", PART, PART)
    partial.close()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(partial.fd)


def test_a_short_write_is_continued_at_the_offset_it_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pwrite may write fewer bytes than asked (a signal, some filesystems)."""
    data = random.Random(5).randbytes(PART)
    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, b, off: pwrite(fd, b[:1000], off))
    partial = PartialFile.open(tmp_path / "b.part", "b", 2 * PART, PART)
    try:
        partial.write(memoryview(data), PART)
    finally:
        partial.close()
    assert (tmp_path / "b.part").read_bytes()[PART:] == data


@pytest.mark.parametrize(("errno_", "raised"), [(errno.ENOSPC, NoSpaceError), (errno.EIO, OSError)])
def test_a_failed_write_raises_no_space_error_only_for_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int, raised: type[Exception]
) -> None:
    def failing(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno_, os.strerror(errno_))

    partial = PartialFile.open(tmp_path / "b.part", "b", PART, PART)
    monkeypatch.setattr(os, "pwrite", failing)
    try:
        with pytest.raises(raised) as e:
            partial.write(memoryview(b"x" * 10), 0)
        assert isinstance(e.value, NoSpaceError) == (errno_ == errno.ENOSPC)
    finally:
        partial.close()


def test_a_finished_part_is_saved_when_the_save_interval_has_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(partial_module, "SAVE_INTERVAL", 0.0)
    path = tmp_path / "b.part"
    partial = PartialFile.open(path, "b", 2 * PART, PART)
    try:
        partial.mark_done(1)
        assert PartState.load(state_path(path), 2 * PART, PART).done == [False, True]
    finally:
        partial.close()


def test_the_source_checksum_covers_bytes_hashed_as_they_land_and_read_back(
    tmp_path: Path,
) -> None:
    data = random.Random(4).randbytes(2 * PART)
    view = memoryview(data)
    partial = PartialFile.open(tmp_path / "b.part", "b", len(data), PART, check="md5")
    try:
        partial.write(view[PART:], PART)  # not at the frontier: read back later
        partial.wrote(1, 2 * PART)
        partial.mark_done(1)
        partial.write(view[:PART], 0)
        partial.wrote(0, PART)
        partial.hash_landed(view[:PART], 0)
        partial.mark_done(0)
        assert partial.finish(bytearray(PART)) == hashlib.sha256(data).hexdigest()
        assert partial.check_digest == hashlib.md5(data).hexdigest()
    finally:
        partial.close()


def _written_from(partial: PartialFile, data: bytes, hashed: int) -> None:
    """`data` written and every part done, the first `hashed` bytes hashed as they landed."""
    partial.write(memoryview(data), 0)
    partial.hash_landed(memoryview(data)[:hashed], 0)
    for index, (_, end) in enumerate(partial.state.parts):
        partial.wrote(index, end)
        partial.mark_done(index)


def test_written_bytes_are_hashed_back_in_place_not_copied_through_a_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-back maps the file (no preadv copy), from an offset off a page boundary
    and across several windows, and the source checksum sees the same bytes."""
    data = random.Random(12).randbytes(3 * partial_module.HASH_WINDOW + 5 * PART + 7)
    partial = PartialFile.open(tmp_path / "b.part", "b", len(data), PART, check="md5")
    try:
        _written_from(partial, data, 1001)

        def no_copy(*args: object) -> int:
            raise AssertionError("read back through preadv")

        monkeypatch.setattr(os, "preadv", no_copy)
        assert partial.finish(bytearray(PART)) == hashlib.sha256(data).hexdigest()
        assert partial.check_digest == hashlib.md5(data).hexdigest()
    finally:
        partial.close()


def test_a_partial_that_cannot_be_mapped_is_hashed_back_through_the_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random.Random(13).randbytes(2 * partial_module.HASH_WINDOW + 3)
    partial = PartialFile.open(tmp_path / "b.part", "b", len(data), PART)
    try:
        _written_from(partial, data, 5)

        def refuse(*args: object, **kwargs: object) -> object:
            raise OSError(errno.ENODEV, "no mmap here")

        monkeypatch.setattr(partial_module.mmap, "mmap", refuse)
        assert partial.finish(bytearray(PART)) == hashlib.sha256(data).hexdigest()
    finally:
        partial.close()


def test_the_digest_is_set_only_once_every_byte_is_hashed_and_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swarm download waits for `digest`: set early, it would name a prefix."""
    data = random.Random(6).randbytes(2 * PART)
    view = memoryview(data)
    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), fsync(fd))[1])
    partial = PartialFile.open(tmp_path / "b.part", "b", len(data), PART)
    try:
        partial.advance_hash(bytearray(PART))
        assert partial.digest is None  # nothing written
        partial.write(view[PART:], PART)
        partial.wrote(1, 2 * PART)
        partial.mark_done(1)
        partial.advance_hash(bytearray(PART))
        assert partial.digest is None  # part 0 missing
        assert synced == []
        partial.write(view[:PART], 0)
        partial.wrote(0, PART)
        partial.mark_done(0)
        partial.advance_hash(bytearray(PART))
        assert partial.digest == hashlib.sha256(data).hexdigest()
        assert synced == [partial.fd]
    finally:
        partial.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("planted", ["symlink", "fifo", "directory"])
def test_what_is_planted_at_a_partial_name_is_replaced_never_written_through(
    tmp_path: Path, planted: str
) -> None:
    """Whoever can write the cache can put a symlink to any file where a partial will be:
    the download's bytes must not land in that file (nor its mode change), nor wait on a
    FIFO, nor fail on a directory."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o600)
    path = tmp_path / "b.part"
    if planted == "symlink":
        path.symlink_to(victim)
    elif planted == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    state_path(path).write_text(json.dumps({"version": 2, "size": 2 * PART,
                                            "part_size": PART, "written": [PART, 0]}))  # fmt: skip
    partial = PartialFile.open(path, "b", 2 * PART, PART)
    try:
        assert partial.state.bytes_done() == 0  # what the state claimed was not this file's
        partial.write(memoryview(b"y" * PART), 0)
    finally:
        partial.close()
    assert not path.is_symlink() and path.is_file() and path.stat().st_size == 2 * PART
    assert victim.read_bytes() == b"precious" and victim.stat().st_mode & 0o777 == 0o600


def test_a_download_stopped_short_resumes_after_the_parts_it_finished(
    blob: tuple[Path, bytes], tmp_path: Path
) -> None:
    path, data = blob

    def refuse_part_5(start: int, end: int) -> None:
        if start == 5 * PART:
            raise SourceError("the object vanished")

    d = downloader(max_concurrency=1)  # one worker: parts in order, 0-4 done when 5 fails
    with pytest.raises(SourceError):
        d.download([job(Wrapped(path, on_open=refuse_part_5), len(data), tmp_path)])
    saved = PartState.load(state_path(tmp_path / "blob.part"), len(data), PART)
    assert saved.done == [True] * 5 + [False] * 5  # saved when it stopped short

    again = Wrapped(path)
    done = d.download([job(again, len(data), tmp_path)])
    assert done.digests["model.bin"] == hashlib.sha256(data).hexdigest()
    assert done.received == {"origin": len(data) - 5 * PART}
    assert sorted(again.opened) == plan_parts(len(data), PART)[5:]


def test_a_download_stopped_mid_part_resumes_at_the_byte_it_had_written(
    blob: tuple[Path, bytes], tmp_path: Path
) -> None:
    path, data = blob
    stop_at = 5 * PART + 100_000

    def break_part_5(start: int, read: int) -> None:
        if start == 5 * PART and read >= 100_000:
            raise RetryRange("ConnectionResetError: reset by peer")  # 100_000 bytes written

    def refuse_the_retry(start: int, end: int) -> None:
        if start == stop_at:
            raise SourceError("the object vanished")

    d = downloader(max_concurrency=1)  # parts in order: 0-4 done, 5 written in part
    source = Wrapped(path, on_open=refuse_the_retry, on_read=break_part_5, chunk=10_000)
    with pytest.raises(SourceError):
        d.download([job(source, len(data), tmp_path)])
    saved = PartState.load(state_path(tmp_path / "blob.part"), len(data), PART)
    assert saved.done == [True] * 5 + [False] * 5
    assert saved.contiguous_end() == stop_at

    again = Wrapped(path)
    done = d.download([job(again, len(data), tmp_path)])
    assert done.digests["model.bin"] == hashlib.sha256(data).hexdigest()
    assert done.received == {"origin": len(data) - stop_at}  # nothing written is fetched again
    assert sorted(again.opened) == [(stop_at, 6 * PART), *plan_parts(len(data), PART)[6:]]


def _hash_seconds(path: Path) -> float:
    started = time.monotonic()
    with open(path, "rb") as f:
        hashlib.file_digest(f, "sha256")
    return time.monotonic() - started


def test_sigterm_stops_the_rehash_of_a_large_resumed_partial(tmp_path: Path) -> None:
    """A resumed partial rehashes its written prefix before any GET: 1 GiB here. SIGTERM
    then ends the download within a read, not after the whole rehash, and the partial and
    its state stay for the next run."""
    size = 1 << 30
    origin = tmp_path / "origin.bin"
    with open(origin, "wb") as f:
        f.truncate(size)  # sparse: only its last part is read
    partial = PartialFile.open(tmp_path / "blob.part", "model.bin", size, PART)
    last = len(partial.state.parts) - 1
    partial.state.done = [True] * last + [False]
    partial.save()
    partial.close()
    whole = _hash_seconds(tmp_path / "blob.part")  # what the rehash costs on this machine now

    d = downloader()
    raised: list[BaseException] = []

    def download() -> None:
        try:
            d.download([job(FileBlob(origin), size, tmp_path)])
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=download)
    thread.start()
    time.sleep(min(0.05, whole / 10))
    interrupted = time.monotonic()
    d.interrupt()
    thread.join(60)
    took = time.monotonic() - interrupted
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], Interrupted), raised
    assert took < whole / 2, f"{took:.2f}s after SIGTERM; the whole rehash takes {whole:.2f}s"
    kept = PartState.load(state_path(tmp_path / "blob.part"), size, PART)
    assert kept.done == [True] * last + [False]
    (tmp_path / "blob.part").unlink()  # 1 GiB: not left for pytest's last three runs


@pytest.fixture
def stragglers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, bytes]:
    """Stragglers judged after 0.2 s, not 1 s; a blob of four 2 MiB parts."""
    monkeypatch.setattr(ranged, "STRAGGLER_AFTER", 0.2)
    data = random.Random(11).randbytes(4 * BIG_PART)
    path = tmp_path / "origin.bin"
    path.write_bytes(data)
    return path, data


BIG_PART = 2 << 20


def _slow_first_part(start: int, read: int) -> None:
    if start == 0:  # the first part's own reader: ~1 MB/s, the others as fast as the disk
        time.sleep(0.03)


def test_a_straggler_at_the_hash_frontier_has_its_tail_read_by_another_worker(
    stragglers: tuple[Path, bytes], tmp_path: Path
) -> None:
    """A starved connection holding the first part would hold every later byte of the
    file unhashed (and the download) until it ends: a worker with nothing left to start
    reads the rest of that part on its own connection, and the starved reader stops there."""
    path, data = stragglers
    source = Wrapped(path, on_read=_slow_first_part, chunk=32 * KiB)
    j = job(source, len(data), tmp_path)
    done = downloader(part_size=BIG_PART, max_concurrency=2).download([j])
    assert done.digests == {"model.bin": hashlib.sha256(data).hexdigest()}
    assert j.partial.read_bytes() == data
    tails = [(a, b) for a, b in source.opened if 0 < a < BIG_PART]
    assert len(tails) == 1 and tails[0][1] == BIG_PART  # the rest of the first part
    assert source.left_unread == []  # the cut reader's response is dropped, not kept
    assert len(data) <= done.received["origin"] <= len(data) + ranged.BUFFER


def test_a_download_stopped_while_a_tail_is_read_claims_only_bytes_it_wrote(
    stragglers: tuple[Path, bytes], tmp_path: Path
) -> None:
    """The part state counts the bytes written from a part's start; a tail's bytes lie
    past a gap until the part is done, so a stop then resumes at the part's own reader."""
    path, data = stragglers
    d = downloader(part_size=BIG_PART, max_concurrency=2)

    def stop_in_the_tail(start: int, read: int) -> None:
        _slow_first_part(start, read)
        if 0 < start < BIG_PART and read >= 256 * KiB:
            d.interrupt()

    with pytest.raises(Interrupted):
        d.download([job(Wrapped(path, on_read=stop_in_the_tail, chunk=32 * KiB), len(data),
                        tmp_path)])  # fmt: skip
    saved = PartState.load(state_path(tmp_path / "blob.part"), len(data), BIG_PART)
    assert not saved.done[0] and 0 < saved.filled(0) < BIG_PART
    on_disk = (tmp_path / "blob.part").read_bytes()
    for i, (start, _) in enumerate(saved.parts):
        assert on_disk[start : start + saved.filled(i)] == data[start : start + saved.filled(i)]

    done = downloader(part_size=BIG_PART).download([job(Wrapped(path), len(data), tmp_path)])
    assert done.digests["model.bin"] == hashlib.sha256(data).hexdigest()


def test_a_full_disk_while_a_tail_is_written_stops_the_download_losing_nothing_written(
    stragglers: tuple[Path, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC on a tail's write is exit 5 (NoSpaceError), as on any write; the part state
    claims only bytes written from each part's start, and the next download completes."""
    path, data = stragglers
    write = PartialFile.write
    source = Wrapped(path, on_read=_slow_first_part, chunk=32 * KiB)

    def full_in_the_tail(self: PartialFile, view: memoryview, offset: int) -> None:
        tails = [a for a, _ in source.opened if 0 < a < BIG_PART]
        if tails and tails[0] + ranged.BUFFER <= offset < BIG_PART:  # its first write lands
            raise NoSpaceError(f"no space left for {self.label}")
        write(self, view, offset)

    monkeypatch.setattr(PartialFile, "write", full_in_the_tail)
    with pytest.raises(NoSpaceError):
        downloader(part_size=BIG_PART, max_concurrency=2).download(
            [job(source, len(data), tmp_path)]
        )
    assert [a for a, _ in source.opened if 0 < a < BIG_PART], "no tail was taken"
    saved = PartState.load(state_path(tmp_path / "blob.part"), len(data), BIG_PART)
    assert not saved.done[0]
    on_disk = (tmp_path / "blob.part").read_bytes()
    for i, (start, _) in enumerate(saved.parts):
        assert on_disk[start : start + saved.filled(i)] == data[start : start + saved.filled(i)]

    monkeypatch.setattr(PartialFile, "write", write)
    done = downloader(part_size=BIG_PART).download([job(Wrapped(path), len(data), tmp_path)])
    assert done.digests["model.bin"] == hashlib.sha256(data).hexdigest()


def test_a_tail_that_breaks_is_read_again_from_where_it_broke(
    stragglers: tuple[Path, bytes], tmp_path: Path
) -> None:
    path, data = stragglers
    broke: list[int] = []

    def break_the_tail_once(start: int, read: int) -> None:
        _slow_first_part(start, read)
        if 0 < start < BIG_PART and read >= 64 * KiB and not broke:
            broke.append(start + read)
            raise RetryRange("ConnectionResetError: reset by peer")

    source = Wrapped(path, on_read=break_the_tail_once, chunk=32 * KiB)
    j = job(source, len(data), tmp_path)
    done = downloader(part_size=BIG_PART, max_concurrency=2).download([j])
    assert done.digests == {"model.bin": hashlib.sha256(data).hexdigest()}
    assert (broke[0], BIG_PART) in source.opened  # resumed at the byte where it broke


def test_a_range_that_breaks_is_resumed_at_the_byte_where_it_broke(
    blob: tuple[Path, bytes], tmp_path: Path
) -> None:
    path, data = blob
    broken: list[int] = []

    def break_once(start: int, read: int) -> None:
        if start == 2 * PART and read >= 100_000 and not broken:
            broken.append(read)
            raise RetryRange("ConnectionResetError: reset by peer")

    source = Wrapped(path, on_read=break_once, chunk=10_000)
    done = downloader().download([job(source, len(data), tmp_path)])
    assert done.digests["model.bin"] == hashlib.sha256(data).hexdigest()
    assert broken == [100_000]
    assert (2 * PART, 3 * PART) in source.opened
    assert (2 * PART + 100_000, 3 * PART) in source.opened  # not from the part's start
    assert done.received == {"origin": len(data)}  # no byte fetched twice


def test_a_source_is_given_up_after_its_own_attempts(one_part: Path, tmp_path: Path) -> None:
    path = one_part

    def always_fail(start: int, end: int) -> None:
        raise RetryRange("HTTP 500")

    source = Wrapped(path, attempts=2, on_open=always_fail)
    with pytest.raises(TransientError, match=r"after 2 attempts and"):
        downloader(max_concurrency=1, max_attempts=8).download([job(source, PART, tmp_path)])
    assert len(source.opened) == 2  # the source's 2, not --max-attempts' 8


@pytest.mark.parametrize("throttles", [True, False])
def test_throttling_lowers_the_concurrency_only_for_a_source_that_means_slow_down(
    one_part: Path, tmp_path: Path, throttles: bool
) -> None:
    path = one_part
    refused: list[int] = []

    def slow_down_once(start: int, end: int) -> None:
        if not refused:
            refused.append(start)
            raise RetryRange("HTTP 503 SlowDown", throttle=True)

    source = Wrapped(path, on_open=slow_down_once)
    source.throttles = throttles
    d = downloader(max_concurrency=8)
    d.download([job(source, PART, tmp_path)])
    assert refused and d.gate.limit == (4 if throttles else 8)


def test_a_digest_mismatch_is_reported_not_raised(blob: tuple[Path, bytes], tmp_path: Path) -> None:
    path, data = blob
    wrong = bytearray(data)
    wrong[3 * PART + 17] ^= 0xFF
    path.write_bytes(wrong)
    done = downloader().download([job(FileBlob(path), len(data), tmp_path)])
    assert done.digests["model.bin"] == hashlib.sha256(wrong).hexdigest()
    assert done.digests["model.bin"] != hashlib.sha256(data).hexdigest()
    assert (tmp_path / "blob.part").read_bytes() == wrong  # kept for the caller to judge


def test_a_trickle_ends_the_download_after_the_timeout(one_part: Path, tmp_path: Path) -> None:
    """One byte every 20 ms (50 B/s) never fills a buffer and never moves the stall clock
    (1 KiB): checked after every read, it ends the download at --timeout (exit 6), not never."""
    path = one_part
    source = Wrapped(path, on_read=lambda start, read: time.sleep(0.02), chunk=1)
    start = time.monotonic()
    with pytest.raises(TransientError, match=r"trickle") as stopped:
        downloader(timeout=1.0, max_concurrency=1).download([job(source, PART, tmp_path)])
    assert "after 1 attempt and" in str(stopped.value)  # not "after 0 attempts"
    # 1 s of --timeout; the margin is for a loaded machine, a hang would be minutes.
    assert time.monotonic() - start < 30


def test_a_file_source_refuses_a_file_of_another_size(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    with (
        pytest.raises(IntegrityError, match=r"100 bytes now but was 101"),
        FileBlob(path).open_range(0, 101, 101, 1.0),
    ):
        pass
    os.unlink(path)
    with (
        pytest.raises(SourceError, match=r"no such file"),
        FileBlob(path).open_range(0, 100, 100, 1.0),
    ):
        pass


@pytest.mark.parametrize(("timeout", "read"), [(300.0, READ_TIMEOUT), (5.0, 5.0)])
def test_reads_block_at_most_the_read_timeout_which_a_serving_peer_undercuts(
    one_part: Path, tmp_path: Path, timeout: float, read: float
) -> None:
    source = Wrapped(one_part)
    downloader(timeout=timeout).download([job(source, PART, tmp_path)])
    assert source.timeouts == {read}
    assert PARTIAL_WAIT < READ_TIMEOUT  # a peer cuts a stalled partial before we time out


def test_a_hash_interrupted_by_stop_raises_and_a_later_one_finishes(tmp_path: Path) -> None:
    """`stop()` ends the hashing with Interrupted, and leaves the file to be hashed by the
    next `advance_hash` (another worker, or the resumed download), not claimed forever."""
    data = random.Random(10).randbytes(2 * PART)
    partial = PartialFile.open(tmp_path / "b.part", "b", len(data), PART)
    try:
        partial.write(memoryview(data), 0)
        for index in (0, 1):
            partial.wrote(index, (index + 1) * PART)
            partial.mark_done(index)
        with pytest.raises(Interrupted):
            partial.advance_hash(bytearray(PART), stop=lambda: True)
        assert partial.digest is None
        partial.advance_hash(bytearray(PART))
        assert partial.digest == hashlib.sha256(data).hexdigest()
    finally:
        partial.close()


@pytest.mark.timeout(10)
def test_rehash_digests_the_whole_file_as_it_is_now_and_stops_when_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the swarm checks after parts were rewritten in place: every byte, read back in
    buffer-sized reads after an fsync; Interrupted at stop(); a file cut short is a bug."""
    data = random.Random(11).randbytes(2 * PART + 100)
    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), fsync(fd))[1])
    partial = PartialFile.open(tmp_path / "b.part", "b", len(data), PART)
    try:
        partial.write(memoryview(data), 0)
        assert partial.rehash(bytearray(1000)) == hashlib.sha256(data).hexdigest()
        assert synced == [partial.fd]
        with pytest.raises(Interrupted):
            partial.rehash(bytearray(1000), stop=lambda: True)
        os.ftruncate(partial.fd, PART)
        with pytest.raises(WeightcacheError, match=r"internal error: .* is short"):
            partial.rehash(bytearray(1000))
    finally:
        partial.close()


@pytest.mark.timeout(10)
def test_a_partial_cut_short_under_its_hash_frontier_is_an_internal_error(tmp_path: Path) -> None:
    # Not a read that returns nothing forever: the hashing stops, and says why.
    partial = PartialFile.open(tmp_path / "b.part", "b", 2 * PART, PART)
    try:
        partial.write(memoryview(b"x" * 2 * PART), 0)
        for index in (0, 1):
            partial.wrote(index, (index + 1) * PART)
            partial.mark_done(index)
        os.ftruncate(partial.fd, PART)
        with pytest.raises(WeightcacheError, match=r"internal error: .* is short"):
            partial.advance_hash(bytearray(PART))
    finally:
        partial.close()


def test_finish_before_every_byte_is_written_is_an_internal_error(tmp_path: Path) -> None:
    partial = PartialFile.open(tmp_path / "b.part", "b", 2 * PART, PART)
    try:
        partial.write(memoryview(b"x" * PART), 0)
        partial.wrote(0, PART)
        with pytest.raises(WeightcacheError, match=f"internal error: b hashed {PART} bytes"):
            partial.finish(bytearray(PART))
    finally:
        partial.close()


@pytest.mark.parametrize(("errno_", "raised"), [(errno.ENOSPC, NoSpaceError), (errno.EIO, OSError)])
def test_a_part_state_that_cannot_be_saved_raises_no_space_error_only_for_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int, raised: type[Exception]
) -> None:
    def failing(self: PartState, path: Path, snapshot: list[int] | None = None) -> None:
        raise OSError(errno_, os.strerror(errno_))

    partial = PartialFile.open(tmp_path / "b.part", "b", PART, PART)
    monkeypatch.setattr(PartState, "save", failing)
    try:
        with pytest.raises(raised) as e:
            partial.save()
        assert isinstance(e.value, NoSpaceError) == (errno_ == errno.ENOSPC)
    finally:
        partial.close()


def test_an_unexpected_error_opening_a_partial_is_raised_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def too_many(*args: object) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(os, "open", too_many)
    with pytest.raises(OSError) as e:
        PartialFile.open(tmp_path / "b.part", "b", PART, PART)
    assert e.value.errno == errno.EMFILE


@pytest.mark.timeout(10)
@pytest.mark.parametrize("planted", [None, "fifo"])
def test_a_partial_is_created_0644_and_a_replaced_one_leaves_no_descriptor_open(
    tmp_path: Path, planted: str | None
) -> None:
    path = tmp_path / "b.part"
    if planted == "fifo":
        os.mkfifo(path)
    before = len(os.listdir("/proc/self/fd"))
    umask = os.umask(0o022)
    try:
        PartialFile.open(path, "b", PART, PART).close()
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.timeout(10)
def test_making_a_partial_writable_changes_only_a_regular_file_never_through_a_symlink(
    tmp_path: Path,
) -> None:
    """Called as root too here (the test above runs it only as another uid, in a child)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim.chmod(0o444)
    (tmp_path / "link").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "b.part").write_bytes(b"x")
    (tmp_path / "b.part").chmod(0o444)
    before = len(os.listdir("/proc/self/fd"))
    for name in ("b.part", "fifo", "absent", "link"):  # the link: not followed, left to
        partial_module._make_writable(tmp_path / name)  # the open that removes it
    assert (tmp_path / "b.part").stat().st_mode & 0o777 == 0o644
    assert victim.stat().st_mode & 0o777 == 0o444
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("size", [0, 1, PART])
@pytest.mark.parametrize("fallocate", ["supported", errno.EOPNOTSUPP, errno.EINVAL, errno.EIO])
def test_a_new_partial_has_its_blob_size_even_where_fallocate_is_unsupported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, fallocate: str | int
) -> None:
    """Some filesystems cannot preallocate: the file is then sized by ftruncate. Any other
    failure (EIO) is raised as it is."""
    if fallocate != "supported":

        def unsupported(fd: int, offset: int, length: int) -> None:
            raise OSError(fallocate, os.strerror(fallocate))  # type: ignore[arg-type]

        monkeypatch.setattr(os, "posix_fallocate", unsupported)
    if fallocate == errno.EIO and size:
        with pytest.raises(OSError) as e:
            PartialFile.open(tmp_path / "b.part", "b", size, PART)
        assert e.value.errno == errno.EIO
        return
    partial = PartialFile.open(tmp_path / "b.part", "b", size, PART)
    try:
        assert os.fstat(partial.fd).st_size == size
    finally:
        partial.close()
