"""Every error weightcache reports, mapped to the exit codes of design §2.2.

Each message is one sentence that names the object (bucket, key, file, revision), says
what happened and what to do. Library exceptions are chained with `from`; nothing from
botocore or the HTTP stack escapes the transfer layer.
"""

from __future__ import annotations

import errno


class WeightcacheError(Exception):
    """Root of all weightcache errors; `exit_code` is the process exit status."""

    exit_code = 1


class UsageError(WeightcacheError):
    """Bad option, bad models file, bad cache directory: fix the invocation (exit 2)."""

    exit_code = 2


class OtherFilesystem(UsageError):
    """A directory of the cache is on another filesystem than the cache (a volume mounted
    inside it): nothing can be linked or renamed across (exit 2)."""


class SourceError(WeightcacheError):
    """Object not found, access denied, missing or invalid manifest (exit 3)."""

    exit_code = 3


class AccessDenied(SourceError):
    """The store refused the credentials (exit 3, as any source error): a caller that can
    do without the refused request tells it from the others."""


class IntegrityError(WeightcacheError):
    """Hash or size mismatch after the retry (exit 4)."""

    exit_code = 4


class NoSpaceError(WeightcacheError):
    """The disk or the capacity bound cannot hold the revision (exit 5)."""

    exit_code = 5


class TransientError(WeightcacheError):
    """Network, throttling or timeouts persisted past the retry budget (exit 6)."""

    exit_code = 6


class Interrupted(WeightcacheError):
    """SIGTERM/SIGINT: work stopped, partial files left resumable (exit 143 like a shell).
    Without a message: a download's, which every downloader raises alike."""

    exit_code = 143

    def __init__(
        self, message: str = "download interrupted; partial files are kept for resume"
    ) -> None:
        super().__init__(message)


def no_space(e: OSError, what: str = "") -> NoSpaceError | None:
    """The NoSpaceError (exit 5) for a full disk or quota (`what`: the file being written,
    named in the message), or None for any other OSError: wherever the cache disk fills
    up, the exit code and the message are the same."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    for_what = f" for {what}" if what else f" ({e})"
    return NoSpaceError(
        f"no space left on the cache disk{for_what}; free space on it (`weightcache gc "
        "--capacity ...` evicts revisions no Pod uses)"
    )
