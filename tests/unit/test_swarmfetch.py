"""The swarm's data plane in-process (weightcache/node/swarmfetch.py), on a node whose peers
hold nothing, so that every piece comes from the store (a local file) through the swarm's
loop: what ends a download that cannot make progress. Peers serving pieces are tested with
real daemons in tests/integration/test_swarm.py."""

from __future__ import annotations

import errno
import hashlib
import random
import threading
from pathlib import Path

import pytest

from weightcache.cache.layout import Layout
from weightcache.cache.manifest import Manifest, ManifestEntry
from weightcache.cache.store import Cache
from weightcache.config import OriginSettings, PeerSettings, Source
from weightcache.errors import TransientError
from weightcache.fetch.blobs import BlobFetch
from weightcache.node.peers import Peers
from weightcache.transfer.pacing import Backoff
from weightcache.transfer.partial import PartialFile
from weightcache.transfer.ranged import RangedDownloader
from weightcache.transfer.sources import FileBlob

SOURCE = Source.parse("s3://bucket/models/m/r1")


def one_blob(tmp_path: Path, size: int) -> Manifest:
    data = random.Random(5).randbytes(size)
    (tmp_path / "a.bin").write_bytes(data)
    return Manifest((ManifestEntry("a.bin", hashlib.sha256(data).hexdigest(), size),), "0" * 64)


def bring_alone(layout: Layout, tmp_path: Path, manifest: Manifest) -> BaseException | None:
    """`BlobFetch.bring` with the node's swarm and no peer, in a thread given 20 s; what it
    raised. A download still running then is interrupted and the test fails."""
    downloader = RangedDownloader(
        OriginSettings(part_size=256 << 10, max_concurrency=4, timeout=600),
        backoff=Backoff(base=0.0, cap=0.0),
    )
    peers = Peers(PeerSettings(("127.0.0.1", 9401), "t" * 16))
    fetch = BlobFetch(layout, Cache(layout), 60.0, lambda: downloader,
                      lambda s, e: FileBlob(tmp_path / e.path), lambda: None,
                      peers=peers)  # fmt: skip
    raised: list[BaseException | None] = []

    def bring() -> None:
        try:
            fetch.bring(SOURCE, manifest)
            raised.append(None)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=bring)
    thread.start()
    thread.join(20)
    hung = thread.is_alive()
    downloader.interrupt()
    thread.join()
    peers.close()
    assert not hung, "the download did not end"
    return raised[0]


def test_a_cache_disk_failing_every_write_ends_the_download(
    layout: Layout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write error (EIO) is the cache disk's, not the source's: the download ends with a
    TransientError instead of fetching the same pieces again for ever (reads kept its
    stall clock moving, and each piece received forgave the store's last failure)."""
    manifest = one_blob(tmp_path, 2 << 20)

    def failing(self: PartialFile, data: memoryview, offset: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(PartialFile, "write", failing)
    raised = bring_alone(layout, tmp_path, manifest)
    assert isinstance(raised, TransientError), raised  # exit 6, as the ranged downloader
    assert "Input/output error" in str(raised)
    (entry,) = manifest.entries
    assert not Cache(layout).has_blob(entry.sha256, entry.size)
