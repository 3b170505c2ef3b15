"""The fetch's blob half in-process, with blob sources that are local files: blobs from the
origin, blobs brought by the node's swarm (a stand-in here: the swarm itself is tested with
real daemons in tests/integration/test_swarm.py), a swarm copy that does not verify even
after its re-check, an origin that serves wrong bytes twice (exit 4, nothing published),
and the swarm's blobs two at once: the next once every piece of the one before is claimed."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from weightcache.cache.layout import Layout
from weightcache.cache.manifest import Manifest, ManifestEntry
from weightcache.cache.store import Cache
from weightcache.config import OriginSettings
from weightcache.errors import IntegrityError, Interrupted, NoSpaceError, TransientError
from weightcache.fetch.blobs import BlobFetch, NodePeers, SwarmMembers
from weightcache.sourceurl import Source
from weightcache.transfer.backends.file import FileBlob
from weightcache.transfer.downloader import RangedDownloader
from weightcache.transfer.pacing import Backoff
from weightcache.transfer.sources import BlobSource

KiB = 1 << 10
SOURCE = Source.parse("s3://bucket/models/m/r1")


@dataclass
class Swarmed:
    digest: str
    mismatched: bool = False
    origin_bytes: int = 0


class FakePeers:
    """The node's peers: the swarm writes `serving[sha256]` (a file) into the partial, or
    the origin's bytes, and says where they came from."""

    def __init__(self, serving: dict[str, Path]) -> None:
        self.serving = serving
        self.claimed: list[str] = []
        self.released: list[str] = []
        self.swarmed: list[str] = []
        self.members: list[SwarmMembers | None] = []

    def claim(self, sha256: str, partial: Path, size: int) -> str:
        self.claimed.append(sha256)
        return f"claim-{sha256[:8]}"

    def release(self, sha256: str, claim: str) -> None:
        self.released.append(sha256)

    def swarm(
        self, sha256: str, size: int, partial: Path, label: str, origin: BlobSource,
        downloader: RangedDownloader, all_claimed: threading.Event | None = None,
        cancel: threading.Event | None = None, members: SwarmMembers | None = None,
    ) -> Swarmed:  # fmt: skip
        self.swarmed.append(sha256)
        self.members.append(members)
        if sha256 in self.serving:
            data = self.serving[sha256].read_bytes()
            got = hashlib.sha256(data).hexdigest()
            partial.write_bytes(data)
            return Swarmed(got, mismatched=got != sha256)
        assert isinstance(origin, FileBlob)
        partial.write_bytes(origin.path.read_bytes())
        return Swarmed(hashlib.sha256(partial.read_bytes()).hexdigest(), origin_bytes=size)

    def mark_bad(self, peer: str, why: str) -> None:
        raise AssertionError("the swarm marks liars, not the fetch")


class Origin:
    """The files of one revision in a local directory, and its manifest."""

    def __init__(self, root: Path, sizes: dict[str, int]) -> None:
        self.root = root
        root.mkdir(parents=True)
        rng = random.Random(3)
        entries = []
        for name, size in sizes.items():
            data = rng.randbytes(size)
            (root / name).write_bytes(data)
            entries.append(ManifestEntry(name, hashlib.sha256(data).hexdigest(), size))
        self.manifest = Manifest(tuple(entries), "0" * 64)
        self.serving: dict[str, Path] = {}  # path -> the file served instead

    def blob(self, source: Source, entry: ManifestEntry) -> BlobSource:
        return FileBlob(self.serving.get(entry.path, self.root / entry.path))

    def corrupt(self, name: str, at: int = 1000) -> Path:
        """A corrupt copy of `name`, beside the origin."""
        data = bytearray((self.root / name).read_bytes())
        data[at] ^= 0xFF
        path = self.root.parent / f"corrupt-{name}"
        path.write_bytes(data)
        return path


@pytest.fixture
def origin(tmp_path: Path) -> Origin:
    return Origin(tmp_path / "origin", {"a.bin": 600 * KiB, "b.bin": 300 * KiB})


def blob_fetch(
    layout: Layout, origin: Origin, peers: NodePeers[str] | None = None,
    reserve: Callable[[int], None] | None = None,
) -> tuple[BlobFetch, list[int]]:  # fmt: skip
    """A BlobFetch on local files, and the list its verify failures are counted in."""
    downloader = RangedDownloader(
        OriginSettings(part_size=256 * KiB, max_concurrency=4, timeout=60),
        backoff=Backoff(base=0.0, cap=0.0),
    )
    failures: list[int] = []
    fetch = BlobFetch(layout, Cache(layout), 60.0, lambda: downloader, origin.blob,
                      lambda: failures.append(1), reserve, peers)  # fmt: skip
    return fetch, failures


def assert_all_published(layout: Layout, origin: Origin) -> None:
    """Every blob of `origin`'s manifest is in the cache with the origin's bytes."""
    for e in origin.manifest.entries:
        assert layout.blob(e.sha256).read_bytes() == (origin.root / e.path).read_bytes()


def test_blobs_come_from_the_origin_once(layout: Layout, origin: Origin) -> None:
    fetch, failures = blob_fetch(layout, origin)
    assert fetch.bring(SOURCE, origin.manifest) == 900 * KiB
    assert_all_published(layout, origin)
    assert fetch.bring(SOURCE, origin.manifest) == 0  # all in the cache now
    assert failures == []


class SmallDisk(Layout):
    """A cache whose disk has 1 MiB free."""

    def disk_space(self) -> tuple[int, int]:
        return 1 << 30, 1 << 20


def test_a_download_larger_than_the_free_disk_is_refused_before_a_byte(
    tmp_path: Path, origin: Origin
) -> None:
    """The capacity bound is asked for room first (`reserve`), then the disk is checked.
    Were it not checked, the fetch would fail on `more.bin`, which the origin lacks."""
    layout = SmallDisk.open(tmp_path / "cache")
    reserved: list[int] = []
    fetch, _ = blob_fetch(layout, origin, reserve=reserved.append)
    more = ManifestEntry("more.bin", "ab" * 32, 1 << 20)
    with pytest.raises(NoSpaceError, match=r"has 1\.0MiB free but the download needs 1\.9MiB"):
        fetch.bring(SOURCE, Manifest((*origin.manifest.entries, more), "0" * 64))
    assert reserved == [900 * KiB + (1 << 20)]
    assert not list(layout.tmp.glob("*.part"))


def test_with_peers_every_blob_is_claimed_and_brought_by_the_swarm(
    layout: Layout, origin: Origin
) -> None:
    a = origin.manifest.entries[0]
    peers = FakePeers({a.sha256: origin.root / "a.bin"})  # a.bin from peers, b.bin the store
    fetch, failures = blob_fetch(layout, origin, peers)
    assert fetch.bring(SOURCE, origin.manifest) == 300 * KiB  # only b.bin from the origin
    everything = sorted(e.sha256 for e in origin.manifest.entries)
    assert sorted(peers.swarmed) == sorted(peers.claimed) == sorted(peers.released) == everything
    assert_all_published(layout, origin)
    assert failures == []
    # one membership for the revision, shared by its blobs' downloads (design §8)
    assert len({id(m) for m in peers.members}) == 1
    assert isinstance(peers.members[0], SwarmMembers)


def test_a_swarm_copy_that_does_not_verify_is_dropped_and_the_origin_serves_the_blob(
    layout: Layout, origin: Origin
) -> None:
    """Wrong even after the swarm's re-check (so the origin's own bytes): two failed
    verifications, one strike; the blob then comes from the origin alone, once."""
    a = origin.manifest.entries[0]
    peers = FakePeers({a.sha256: origin.corrupt("a.bin")})
    fetch, failures = blob_fetch(layout, origin, peers)
    assert fetch.bring(SOURCE, origin.manifest) == 900 * KiB
    assert failures == [1, 1]
    assert layout.blob(a.sha256).read_bytes() == (origin.root / "a.bin").read_bytes()


def test_a_swarm_copy_and_an_origin_copy_both_wrong_are_an_integrity_error(
    layout: Layout, origin: Origin
) -> None:
    a = origin.manifest.entries[0]
    origin.serving["a.bin"] = origin.corrupt("a.bin")
    peers = FakePeers({a.sha256: origin.serving["a.bin"]})
    fetch, failures = blob_fetch(layout, origin, peers)
    with pytest.raises(IntegrityError, match=r"sha256 mismatch for a\.bin .*checked twice"):
        fetch.bring(SOURCE, origin.manifest)
    assert failures == [1, 1, 1]
    assert not Cache(layout).has_blob(a.sha256, a.size)


def test_an_origin_serving_wrong_bytes_twice_is_an_integrity_error(
    layout: Layout, origin: Origin
) -> None:
    b = origin.manifest.entries[1]
    origin.serving["b.bin"] = origin.corrupt("b.bin")
    fetch, failures = blob_fetch(layout, origin)
    with pytest.raises(IntegrityError, match=r"sha256 mismatch for b\.bin .*checked twice"):
        fetch.bring(SOURCE, origin.manifest)
    assert failures == [1, 1]
    assert not Cache(layout).has_blob(b.sha256, b.size)


class PipelinedPeers(FakePeers):
    """A swarm whose every blob reports all its pieces claimed at once, then waits (up to
    `hold` seconds) for the blob after the next to start, or for `cancel`; the order of
    starts and ends goes into `events`. Blob `fail` raises TransientError after that wait."""

    def __init__(self, order: list[str], hold: float, fail: str | None = None) -> None:
        super().__init__({})
        self.order, self.hold, self.fail = order, hold, fail
        self.started = {sha: threading.Event() for sha in order}
        self.cancelled: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def swarm(
        self, sha256: str, size: int, partial: Path, label: str, origin: BlobSource,
        downloader: RangedDownloader, all_claimed: threading.Event | None = None,
        cancel: threading.Event | None = None, members: SwarmMembers | None = None,
    ) -> Swarmed:  # fmt: skip
        with self.lock:
            self.events.append(("start", label))
        self.started[sha256].set()
        if all_claimed is not None:
            all_claimed.set()
        k = self.order.index(sha256)
        until = time.monotonic() + self.hold
        while time.monotonic() < until:
            if k + 2 < len(self.order) and self.started[self.order[k + 2]].is_set():
                break
            if cancel is not None and cancel.is_set():
                self.cancelled.append(label)
                raise Interrupted("download interrupted")
            if (
                sha256 == self.fail
                and k + 1 < len(self.order)
                and self.started[self.order[k + 1]].is_set()
            ):
                break
            time.sleep(0.01)
        with self.lock:
            self.events.append(("end", label))
        if sha256 == self.fail:
            raise TransientError(f"giving up on {label}")
        return super().swarm(sha256, size, partial, label, origin, downloader)


def three_blobs(tmp_path: Path) -> Origin:
    return Origin(tmp_path / "origin3", {"a.bin": 100 * KiB, "b.bin": 50 * KiB, "c.bin": 70 * KiB})


def test_the_swarm_brings_two_blobs_at_once_the_next_once_the_one_before_is_all_claimed(
    layout: Layout, tmp_path: Path
) -> None:
    """b starts while a is still running, all claimed; c only once a has ended (two at most),
    though b is all claimed already; every blob published, each claim released."""
    origin = three_blobs(tmp_path)
    order = [e.sha256 for e in origin.manifest.entries]
    peers = PipelinedPeers(order, hold=0.5)
    fetch, failures = blob_fetch(layout, origin, peers)
    assert fetch.bring(SOURCE, origin.manifest) == 220 * KiB
    assert peers.events[:2] == [("start", "a.bin"), ("start", "b.bin")], peers.events
    assert peers.events.index(("end", "a.bin")) < peers.events.index(("start", "c.bin"))
    assert sorted(peers.claimed) == sorted(peers.released) == sorted(order)
    assert_all_published(layout, origin)
    assert failures == []


def test_a_swarm_download_failing_stops_the_other_one_in_progress(
    layout: Layout, tmp_path: Path
) -> None:
    """a fails while b (started once a was all claimed) runs: b is cancelled, both claims are
    released, a's error is the fetch's, nothing of b is published (its partial is kept)."""
    origin = three_blobs(tmp_path)
    order = [e.sha256 for e in origin.manifest.entries]
    peers = PipelinedPeers(order, hold=5.0, fail=order[0])
    fetch, _ = blob_fetch(layout, origin, peers)
    with pytest.raises(TransientError, match=r"giving up on a\.bin"):
        fetch.bring(SOURCE, origin.manifest)
    assert peers.cancelled == ["b.bin"]
    assert sorted(peers.claimed) == sorted(peers.released) == sorted(order[:2])
    assert not any(Cache(layout).has_blob(e.sha256, e.size) for e in origin.manifest.entries)


class FailingPeers(FakePeers):
    """A swarm in which blob `fail` raises TransientError at once (before all its pieces
    are claimed) and every other blob is all claimed at once and takes `hold` seconds
    (stopped by `cancel`)."""

    def __init__(self, fail: str, hold: float) -> None:
        super().__init__({})
        self.fail, self.hold = fail, hold
        self.started: list[str] = []

    def swarm(
        self, sha256: str, size: int, partial: Path, label: str, origin: BlobSource,
        downloader: RangedDownloader, all_claimed: threading.Event | None = None,
        cancel: threading.Event | None = None, members: SwarmMembers | None = None,
    ) -> Swarmed:  # fmt: skip
        self.started.append(sha256)
        if sha256 == self.fail:
            raise TransientError(f"giving up on {label}")
        if all_claimed is not None:  # the next may start at once
            all_claimed.set()
        if cancel is not None and cancel.wait(self.hold):
            raise Interrupted("download interrupted")
        return super().swarm(sha256, size, partial, label, origin, downloader)


@pytest.mark.parametrize("failing", [0, 1])
def test_no_blob_is_started_after_a_swarm_download_failed(
    layout: Layout, tmp_path: Path, failing: int
) -> None:
    """The first blob (or the second, while the first still runs) fails at once: its error
    is the fetch's, and the next blob is not started (claimed, its partial allocated, its
    first pieces asked of the store) only to be cancelled; a blob before the failed one
    is still published."""
    origin = three_blobs(tmp_path)
    entries = origin.manifest.entries
    peers = FailingPeers(entries[failing].sha256, hold=0.3)
    fetch, _ = blob_fetch(layout, origin, peers)
    with pytest.raises(TransientError, match=f"giving up on {entries[failing].path}"):
        fetch.bring(SOURCE, origin.manifest)
    assert peers.started == [e.sha256 for e in entries[: failing + 1]]
    assert sorted(peers.claimed) == sorted(peers.released) == sorted(peers.started)
    assert not layout.partial(entries[failing + 1].sha256).exists()
    published = [Cache(layout).has_blob(e.sha256, e.size) for e in entries]
    assert published == [i < failing for i in range(3)]
