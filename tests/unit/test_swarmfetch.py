"""The swarm's data plane in-process (weightcache/swarm/download.py), on a node whose peers
hold nothing, so that every piece comes from the store (a local file) through the swarm's
loop: what ends a download that cannot make progress; and, from a view of a peer, when the
next blob may start. Peers serving pieces are tested with real daemons in
tests/integration/test_swarm.py."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightcache.cache.layout import Layout
from weightcache.cache.manifest import Manifest, ManifestEntry
from weightcache.cache.store import Cache
from weightcache.config import OriginSettings, PeerSettings
from weightcache.errors import Interrupted, NoSpaceError, TransientError
from weightcache.fetch.blobs import BlobFetch
from weightcache.sourceurl import Source
from weightcache.swarm import chooser
from weightcache.swarm.bitsets import iter_bits
from weightcache.swarm.choice import ORIGIN, PeerView, stripe
from weightcache.swarm.download import SwarmDownload, SwarmJob
from weightcache.swarm.entry import NodeSwarm
from weightcache.swarm.pace import CLAIM_GRACE, Rates
from weightcache.swarm.pieces import Bitmap, piece_size_for
from weightcache.transfer.backends.file import FileBlob
from weightcache.transfer.downloader import RangedDownloader
from weightcache.transfer.pacing import Backoff
from weightcache.transfer.partial import PartialFile
from weightcache.transfer.parts import PartState
from weightcache.transfer.sources import BlobSource, RangeReader

SOURCE = Source.parse("s3://bucket/models/m/r1")


def blobs(tmp_path: Path, *sizes: int, same: bool = False) -> Manifest:
    """A revision of files a.bin, b.bin, ... of `sizes` bytes, in `tmp_path` (with `same`,
    files of one size have the same bytes)."""
    entries = []
    for name, size in zip("abcdefgh", sizes, strict=False):
        data = random.Random(size if same else name).randbytes(size)
        (tmp_path / f"{name}.bin").write_bytes(data)
        entries.append(ManifestEntry(f"{name}.bin", hashlib.sha256(data).hexdigest(), size))
    return Manifest(tuple(entries), "0" * 64)


class Trickle(FileBlob):
    """A local file served 8 KiB per read, each read taking `every` seconds."""

    def __init__(self, path: Path, every: float) -> None:
        super().__init__(path)
        self.every = every

    @contextlib.contextmanager
    def open_range(self, start: int, end: int, size: int, timeout: float) -> Iterator[RangeReader]:
        with super().open_range(start, end, size, timeout) as reader:
            yield _Slow(reader, self.every)


class _Slow:
    def __init__(self, reader: RangeReader, every: float) -> None:
        self.reader, self.every = reader, every

    def readinto(self, buf: memoryview) -> int:
        time.sleep(self.every)
        return self.reader.readinto(buf[: 8 << 10])


def bring_alone(
    layout: Layout, tmp_path: Path, manifest: Manifest,
    trickle: bool = False, interrupt_after: float | None = None,
) -> BaseException | int:  # fmt: skip
    """`BlobFetch.bring` with the node's swarm and no peer, in a thread given 20 s; what it
    raised, or the bytes it took from the store. A download still running then is
    interrupted and the test fails. `trickle`: the store sends 32 KiB/s per request;
    `interrupt_after`: SIGTERM then."""
    downloader = RangedDownloader(
        OriginSettings(part_size=256 << 10, max_concurrency=4, timeout=600),
        backoff=Backoff(base=0.0, cap=0.0),
    )
    peers = NodeSwarm(PeerSettings(("127.0.0.1", 9401), "t" * 16))

    def blob(source: Source, entry: ManifestEntry) -> BlobSource:
        path = tmp_path / entry.path
        return Trickle(path, 0.25) if trickle else FileBlob(path)

    fetch = BlobFetch(layout, Cache(layout), 60.0, lambda: downloader, blob, lambda: None,
                      peers=peers)  # fmt: skip
    raised: list[BaseException | int] = []

    def bring() -> None:
        try:
            raised.append(fetch.bring(SOURCE, manifest))
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=bring)
    thread.start()
    if interrupt_after is not None:
        thread.join(interrupt_after)
        downloader.interrupt()
        thread.join(2)
    thread.join(20)
    hung = thread.is_alive()
    downloader.interrupt()
    thread.join()
    peers.close()
    assert not hung, "the download did not end"
    left = [t.name for t in threading.enumerate() if t.name.startswith(("swarm", "blob"))]
    assert not left, f"threads left running: {left}"
    assert all(peers.downloading(e.sha256) is None for e in manifest.entries), "a claim is held"
    return raised[0]


def test_a_cache_disk_failing_every_write_ends_the_download(
    layout: Layout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write error (EIO) is the cache disk's, not the source's: the download ends with a
    TransientError instead of fetching the same pieces again for ever (reads kept its
    stall clock moving, and each piece received forgave the store's last failure)."""
    manifest = blobs(tmp_path, 2 << 20)

    def failing(self: PartialFile, data: memoryview, offset: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(PartialFile, "write", failing)
    raised = bring_alone(layout, tmp_path, manifest)
    assert isinstance(raised, TransientError), raised  # exit 6, as the ranged downloader
    assert "Input/output error" in str(raised)
    (entry,) = manifest.entries
    assert not Cache(layout).has_blob(entry.sha256, entry.size)


def test_no_room_for_the_part_state_ends_the_download_with_no_space(
    layout: Layout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pieces go into preallocated space; the part state saved after each one needs a
    new page, and the disk filled up since: exit 5 with the no-space message, not a
    TransientError (exit 6) telling to run the fetch again when the disk is full."""

    def full(self: PartState, path: Path, written: list[int] | None = None) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(PartState, "save", full)
    raised = bring_alone(layout, tmp_path, blobs(tmp_path, 2 << 20))
    assert isinstance(raised, NoSpaceError), raised
    assert "no space left on the cache disk for the part state of a.bin" in str(raised)


def test_sigterm_stops_the_re_check_of_pieces_at_the_store(layout: Layout, tmp_path: Path) -> None:
    """A resumed partial whose bytes do not verify: every piece is fetched again from the
    (slow) store to compare. SIGTERM then ends the download within a read (the re-check
    was not told: shutdown waited for the whole blob from the store); the partial is kept."""
    manifest = blobs(tmp_path, 4 << 20)
    (entry,) = manifest.entries
    piece = piece_size_for(entry.size)
    partial = PartialFile.open(layout.partial(entry.sha256), "a.bin", entry.size, piece)
    for index, (start, end) in enumerate(partial.state.parts):
        partial.write(memoryview(bytes(end - start)), start)  # zeros: not the blob
        partial.wrote(index, end)
        partial.mark_done(index)
    partial.save()
    partial.close()
    started = time.monotonic()
    raised = bring_alone(layout, tmp_path, manifest, trickle=True, interrupt_after=1.0)
    took = time.monotonic() - started
    assert isinstance(raised, Interrupted), raised
    assert took < 7.0, f"{took:.1f}s: a piece is 8 s at the store"
    assert layout.partial(entry.sha256).exists()


def test_sigterm_stops_the_rehash_of_a_large_resumed_partial(
    layout: Layout, tmp_path: Path
) -> None:
    """A resumed 1 GiB partial is rehashed before the swarm asks for its last piece:
    SIGTERM during that rehash ends the download within a read, not after the whole
    prefix, and the partial is kept."""
    size = 1 << 30
    with open(tmp_path / "a.bin", "wb") as f:
        f.truncate(size)  # sparse zeros: the store's copy
    started = time.monotonic()
    with open(tmp_path / "a.bin", "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    whole = time.monotonic() - started  # what the rehash costs on this machine now
    manifest = Manifest((ManifestEntry("a.bin", sha256, size),), "0" * 64)
    partial = PartialFile.open(layout.partial(sha256), "a.bin", size, piece_size_for(size))
    last = len(partial.state.parts) - 1
    partial.state.done = [True] * last + [False]
    partial.save()
    partial.close()
    started = time.monotonic()
    raised = bring_alone(layout, tmp_path, manifest, interrupt_after=0.05)
    took = time.monotonic() - started - 0.05
    assert isinstance(raised, Interrupted), raised
    assert took < whole / 2, f"{took:.2f}s after SIGTERM; the whole rehash takes {whole:.2f}s"
    assert layout.partial(sha256).exists()
    layout.partial(sha256).unlink()  # 1 GiB: not left for pytest's last three runs


def test_sigterm_stops_both_downloads_of_the_pipeline(layout: Layout, tmp_path: Path) -> None:
    """A one-piece blob (in its end game at its first request) and a larger one, from a
    slow store: SIGTERM while both download ends the fetch within a read, with both
    partials kept, every claim released and no thread left running (`bring_alone`)."""
    manifest = blobs(tmp_path, 64 << 10, 4 << 20)
    raised = bring_alone(layout, tmp_path, manifest, trickle=True, interrupt_after=1.0)
    assert isinstance(raised, Interrupted), raised
    for e in manifest.entries:
        assert layout.partial(e.sha256).exists() and not Cache(layout).has_blob(e.sha256, e.size)


def test_an_empty_file_identical_files_and_a_complete_partial_go_through_the_swarm(
    layout: Layout, tmp_path: Path
) -> None:
    """Blobs of no piece (an empty file, twice), two files with the same bytes (one blob,
    downloaded once), and a blob whose partial is complete already (killed before its
    publication): all published, the store asked only for the one blob missing."""
    manifest = blobs(tmp_path, 0, 1 << 20, 1 << 20, 0, 300 << 10, same=True)
    done = manifest.entries[4]
    partial = PartialFile.open(layout.partial(done.sha256), "e.bin", done.size,
                               piece_size_for(done.size))  # fmt: skip
    for index, (start, end) in enumerate(partial.state.parts):
        partial.write(memoryview((tmp_path / "e.bin").read_bytes()[start:end]), start)
        partial.wrote(index, end)
        partial.mark_done(index)
    partial.save()
    partial.close()
    assert bring_alone(layout, tmp_path, manifest) == 1 << 20
    for e in manifest.entries:
        assert layout.blob(e.sha256).read_bytes() == (tmp_path / e.path).read_bytes()


def test_a_peer_s_piece_is_judged_slow_against_this_node_s_share_of_its_link(
    tmp_path: Path,
) -> None:
    """The rate below which a peer's piece is given up (pace.slow_floor): 64 KiB/s
    where the node's link has far more to share; on a slow or crowded link a quarter of
    its rate per request in flight (honest peers were cut at 95-98% of their pieces at
    12.5 mbit, 16 nodes); for a streamed piece at most a quarter of the store's rate per
    request; and never below 8 KiB/s, so that a trickle is still given up when every
    source trickles."""
    downloader = RangedDownloader(OriginSettings(part_size=256 << 10, max_concurrency=4))
    peers = NodeSwarm(PeerSettings(("127.0.0.1", 9401), "t" * 16))
    job = SwarmJob("0" * 64, 64 << 20, tmp_path / "partial", "a.bin", FileBlob(tmp_path / "a.bin"))
    swarm = SwarmDownload(job, peers, downloader)
    try:

        def floor(received: int, requests: int, streamed: bool = False) -> float:
            swarm.rates = Rates()
            swarm.rates._start -= 10  # measured over the last second
            swarm.rates.note(received)
            swarm.requests.inflight = {i: {"peer"} for i in range(requests)}
            return swarm._slow_floor(streamed)

        assert floor(8 << 20, 4) == 64 << 10  # a fast link: the fixed rate
        assert floor(1_600_000, 16) == pytest.approx(1_600_000 / 16 / 4)  # 25 kB/s
        assert floor(0, 4) == 8 << 10  # nothing arrives from anyone: still a floor
        assert floor(1_600_000, 16, streamed=True) == pytest.approx(25_000)  # store unknown
        swarm.store.measured("origin", 40_000, alone=True)  # a request to the store: 40 kB/s
        assert floor(1_600_000, 16, streamed=True) == pytest.approx(10_000)
        assert floor(1_600_000, 16) == pytest.approx(25_000)  # a held piece: the link's share
    finally:
        peers.close()


@pytest.mark.parametrize(
    ("peer_fetches", "claimed"), [(0, False), (1, True)], ids=["unclaimed", "claimed"]
)
def test_the_next_blob_may_start_once_a_peer_claims_what_this_node_has_not_asked_for(
    tmp_path: Path, peer_fetches: int, claimed: bool
) -> None:
    """`all_claimed` (fetch/blobs.py starts the next blob on it) is set once every piece
    is held or asked for by this node or a peer in view, though most are not in flight
    here: the store's last pieces are then on their way to their claimants, and the next
    blob's claims keep it busy. With pieces nobody has asked for, it is not set."""
    downloader = RangedDownloader(OriginSettings(part_size=256 << 10, max_concurrency=4))
    peers = NodeSwarm(PeerSettings(("127.0.0.1", 9401), "t" * 16))
    size = 64 << 20
    event = threading.Event()
    job = SwarmJob("0" * 64, size, tmp_path / "partial", "a.bin", FileBlob(tmp_path / "a.bin"),
                   all_claimed=event)  # fmt: skip
    swarm = SwarmDownload(job, peers, downloader)
    swarm.file = PartialFile.open(tmp_path / "partial", "a.bin", size, swarm.piece_size)
    try:
        count = swarm.count
        fetching = Bitmap(count, ((1 << count) - 1) * peer_fetches)
        view = PeerView("http://peer", Bitmap(count), fetching, 0, fetching)
        swarm.views.current = lambda: ([view], 0, 2)  # type: ignore[method-assign]
        requests = swarm._choose()
        assert len(requests) < count  # most pieces are not asked for here
        assert event.is_set() is claimed
    finally:
        swarm.file.close()
        peers.close()


def test_a_peer_s_claims_that_do_not_become_pieces_expire_and_the_store_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer advertising every piece in flight and none held (stuck, or hostile): its
    claims are left to it for CLAIM_GRACE, then expire, and this node asks the store for
    its own stripe."""
    downloader = RangedDownloader(OriginSettings(part_size=256 << 10, max_concurrency=4))
    peers = NodeSwarm(PeerSettings(("127.0.0.1", 9401), "t" * 16))
    size = 64 << 20
    job = SwarmJob("0" * 64, size, tmp_path / "partial", "a.bin", FileBlob(tmp_path / "a.bin"))
    swarm = SwarmDownload(job, peers, downloader)
    swarm.file = PartialFile.open(tmp_path / "partial", "a.bin", size, swarm.piece_size)
    now = [time.monotonic()]
    monkeypatch.setattr(chooser.time, "monotonic", lambda: now[0])
    try:
        count = swarm.count
        view = PeerView("http://peer", Bitmap(count), Bitmap.full(count))
        swarm.views.current = lambda: ([view], 0, 2)  # type: ignore[method-assign]
        assert swarm._choose() == []
        now[0] += CLAIM_GRACE - 0.1
        assert swarm._choose() == []
        now[0] += 0.1
        asked = swarm._choose()
        assert asked and all(r.source == ORIGIN for r in asked)
        assert {r.piece for r in asked} <= set(iter_bits(stripe(0, 2, count)))
    finally:
        swarm.file.close()
        peers.close()
