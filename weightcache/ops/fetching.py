"""`weightcache fetch`'s policy: who brings a revision into the cache.

A hit is answered from the cache (the daemon told, when it runs); a miss is asked of the
node daemon first, fetched alone when none answers, and refused on a read-only cache, which
only the daemon can fill. A hit imports only what it needs: everything else loads on the
miss's path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightcache.errors import UsageError
from weightcache.progress import human

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager
    from pathlib import Path

    from weightcache.config import Capacity, OriginSettings
    from weightcache.fetch import FetchResult
    from weightcache.sourceurl import Source

    #: Calls its argument when the process is told to stop, while the context lasts.
    Interrupts = Callable[[Callable[[], None]], AbstractContextManager[object]]


@dataclass(frozen=True)
class FetchSettings:
    """How one fetch may make its revision ready."""

    cache_dir: Path
    origin: OriginSettings
    #: The Pod whose lease keeps the revision while it lives (None: no lease).
    pod_uid: str | None
    #: Whether the node daemon is asked first; False fetches alone.
    use_daemon: bool
    #: What a fetch alone leaves free on the cache disk: nothing evicts for it.
    min_free: Capacity
    #: Seconds between progress reports (None: the default for the terminal or the log).
    progress_interval: float | None
    #: Refuse a revision unless a sha256 verified every file, however it came.
    require_sha256: bool


def _uninterrupted(stop: Callable[[], None]) -> AbstractContextManager[object]:
    return contextlib.nullcontext()


def ready(
    src: Source,
    settings: FetchSettings,
    *,
    started: Callable[[], None] | None = None,
    interrupts: Interrupts = _uninterrupted,
) -> FetchResult:
    """The revision made ready (a hit, or a miss fetched): its FetchResult. With
    `require_sha256`, SourceError unless a sha256 verified every file, however it came.

    `started` is called once a fetch alone starts downloading; `interrupts` wires the
    process's stop signal to that download, which then saves its part states and stops.
    """
    from weightcache.cache.layout import Layout, check_revision
    from weightcache.fetch import check_hit

    if not src.pinned:  # an hf:// branch or tag: its commit is the cache's revision
        from weightcache.fetch import resolve

        src = resolve(src, settings.origin.timeout)
    check_revision(src.name, src.revision)
    layout = Layout.open(settings.cache_dir)
    result = check_hit(layout, src, settings.pod_uid)
    if result is not None and settings.use_daemon and layout.socket.exists():
        from weightcache.daemon.fetchsocket import notify_hit  # imports socket: only on this path

        notify_hit(layout.socket, src, settings.pod_uid)
    if result is None:
        result = _fetch_miss(layout, src, settings, started, interrupts)
    if settings.require_sha256:  # a hit, or the daemon's fetch, knew nothing of this policy
        from weightcache.fetch import refuse_unless_sha256

        refuse_unless_sha256(layout, src)
    return result


def _fetch_miss(
    layout: Any,
    src: Source,
    settings: FetchSettings,
    started: Callable[[], None] | None,
    interrupts: Interrupts,
) -> FetchResult:
    from weightcache.cache.alone import registered
    from weightcache.daemon.fetchsocket import ask_daemon
    from weightcache.fetch import Fetcher, FetchResult
    from weightcache.progress import Progress

    if settings.use_daemon:
        answer = ask_daemon(layout.socket, src, settings.pod_uid)
        if answer is not None:
            answer.pop("throughput", None)
            # Our mount of the cache, not the daemon's: they may differ (initcontainer/).
            answer["path"] = str(layout.revision_dir(src.name, src.revision))
            return FetchResult(**answer)
    if layout.read_only:
        raise _read_only_miss(layout, src, settings.use_daemon)
    progress = Progress(src.label, 0, interval=settings.progress_interval, started=started)
    # No peers: every GET is origin.
    reserve = _keep_free(layout, src, settings.min_free)
    fetcher = Fetcher(layout, settings.origin, observer=progress, reserve=reserve)
    # Fetching alone: the node daemon counts us through the cache dir (design §6).
    try:
        with (
            interrupts(fetcher.interrupt),
            registered(
                layout,
                src.name,
                src.revision,
                lambda: progress.inflight,
                lambda: progress.throttles,
            ),
        ):
            return fetcher.fetch(src, settings.pod_uid, settings.require_sha256)
    finally:
        progress.close()


def _keep_free(layout: Any, src: Source, min_free: Capacity) -> Callable[[int], None]:
    """The Fetcher's `reserve` for a fetch alone: nothing evicts for it, so a download
    that would leave less than --min-free free on the cache disk is NoSpaceError (exit 5)
    before its first byte."""
    from weightcache.errors import NoSpaceError

    def reserve(need: int) -> None:
        size, free = layout.disk_space()
        floor = min_free.resolve(size)
        if floor and free - need < floor:
            raise NoSpaceError(
                f"{src.label} needs {human(need)} but the cache disk at {layout.root} has "
                f"{human(free)} free and --min-free keeps {human(floor)} of it free; nothing "
                "evicts for a fetch alone: free space on the disk (weightcache gc), lower "
                "--min-free, or let the node daemon fetch it"
            )

    return reserve


def _read_only_miss(layout: Any, src: Source, use_daemon: bool) -> UsageError:
    """A miss on a read-only cache (the Pods' mount, initcontainer/): only the node daemon
    can bring the revision in."""
    why = "--no-daemon was given" if not use_daemon else (
        f"no node daemon answers on {layout.socket}")  # fmt: skip
    return UsageError(
        f"{src.label} is not in the cache at {layout.root}, which is mounted read-only, and "
        f"{why}: a read-only cache fetches only through the daemon; start the weightcache "
        "DaemonSet on this node, or mount the cache read-write (initcontainer/components/"
        "read-write)"
    )
