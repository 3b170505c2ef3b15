"""The swarm's entry point: the one method the fetch layer calls to download a blob
from the peers and the store (design §8, Swarm)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache.swarm.client import Peers
from weightcache.swarm.download import SwarmDownload, SwarmJob
from weightcache.transfer.sources import BlobSource

if TYPE_CHECKING:
    from weightcache.fetch.blobs import SwarmMembers
    from weightcache.swarm.download import Outcome
    from weightcache.transfer.downloader import RangedDownloader


class NodeSwarm(Peers):
    """This node's peers, and the swarm that downloads a blob from them and the store:
    what the fetch layer asks of the node (`weightcache.fetch.blobs.NodePeers`). The
    daemon builds this; the swarm's parts see only `Peers`."""

    def swarm(
        self, sha256: str, size: int, partial: Path, label: str, origin: BlobSource,
        downloader: RangedDownloader, all_claimed: threading.Event | None = None,
        cancel: threading.Event | None = None, members: SwarmMembers | None = None,
    ) -> Outcome:  # fmt: skip
        """Download one blob piece by piece from the peers and the store into `partial`
        (weightcache/swarm/download.py); the fetch layer sees only this method.
        `all_claimed` is set once every piece is held or asked for, here or by a peer;
        `cancel` stops the download; `members`: the peers seen swarming the revision's
        other blobs (`SwarmMembers`)."""
        job = SwarmJob(sha256, size, partial, label, origin, all_claimed=all_claimed,
                       cancel=cancel, members=members)  # fmt: skip
        return SwarmDownload(job, self, downloader).run()
