"""The daemon's lease role (design §5, Roles): end the leases of Pods that are gone, so
that the revisions they held become evictable again.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from weightcache.cache.index import Index
from weightcache.config import KUBELET_PODS_DIR, format_duration, parse_pod_uid
from weightcache.daemon.labels import in_cluster
from weightcache.errors import UsageError

log = logging.getLogger(__name__)


class LeaseReaper:
    """Ends leases whose Pod is gone.

    Contract of `reap()`: a lease ends when its Pod's directory under `kubelet_pods_dir`
    is gone; without that directory (not on a node), when it is older than `max_age`
    seconds; at once when its holder is not a Pod UID (written by an old version or by
    hand: it names no Pod that could ever go away). A directory it may not look into keeps
    every lease (a revision in use is never evicted) and logs how to fix the node.
    """

    def __init__(self, index: Index, kubelet_pods_dir: Path, max_age: float) -> None:
        self.index = index
        self.pods_dir = kubelet_pods_dir
        self.max_age = max_age
        if not kubelet_pods_dir.is_dir():
            # A typo or a forgotten mount is said once; the default off a cluster (a
            # laptop, a CI job) is no mistake, and is said only at -vv.
            level = logging.WARNING
            if kubelet_pods_dir == KUBELET_PODS_DIR and not in_cluster():
                level = logging.DEBUG
            log.log(
                level,
                "%s is no directory: a lease ends %s after it was taken, not when its Pod "
                "goes; mount the kubelet's pods directory there (--kubelet-pods-dir) on a node",
                kubelet_pods_dir,
                format_duration(max_age),
            )

    def reap(self) -> None:
        """End the leases of Pods that are gone (see the class contract)."""
        holders = self.index.lease_holders()
        malformed = {uid for uid in holders if not _is_pod_uid(uid)}
        gone = self._gone(holders - malformed)
        if malformed:
            shown = ", ".join(repr(u[:40]) for u in sorted(malformed))
            log.warning("ending %d lease(s) not held by a Pod UID: %s", len(malformed), shown)
        if gone:
            log.info("ending %d lease(s) of Pods that are gone", len(gone))
        if gone | malformed:
            self.index.end_leases(gone | malformed)

    def _gone(self, holders: set[str]) -> set[str]:
        """The holders among `holders` whose Pod is gone."""
        if not self.pods_dir.is_dir():
            cutoff = time.time() - self.max_age
            return {uid for uid, since in self.index.lease_ages() if since < cutoff}
        try:
            return {u for u in holders if not _pod_dir_exists(self.pods_dir / u)}
        except PermissionError as e:
            # The kubelet makes the directory 0750 root: keep every lease (never evict
            # a revision in use) and say how to fix the node.
            log.error(
                "cannot look into %s (%s): leases are kept until it is readable; "
                "grant search with `setfacl -m u:%d:x %s`",
                self.pods_dir,
                e.strerror,
                os.getuid(),
                self.pods_dir,
            )
            return set()


def _is_pod_uid(holder: str) -> bool:
    try:
        return parse_pod_uid(holder) == holder
    except UsageError:
        return False


def _pod_dir_exists(path: Path) -> bool:
    """os.path.exists() swallows EACCES as "absent", which would end live leases."""
    try:
        path.stat()
    except FileNotFoundError:
        return False
    return True
