"""The Hugging Face Hub as an origin: hf://org/repo@revision (design §4, Revision sources).

The metadata comes from the Hub's API, asked with huggingface_hub's session and headers (the
model info with ?blobs=true: the commit a branch or tag points at, every file's size, an LFS
file's sha256, a small file's git blob id; the tree listing, as `hf download` reads it, from
a mirror whose model info has no sizes; backends/hub/listing.py reads both), so HF_ENDPOINT,
HF_TOKEN (or
the token `hf auth login` saved) and HF_HUB_OFFLINE mean here what they mean to
huggingface_hub. A commit asked for must be the commit answered. The bytes do not go
through it: each file is located once (`HEAD {endpoint}/{repo}/resolve/{commit}/{path}`,
following the Hub's relative redirects; an LFS file's redirect to its storage is where its
bytes are read, without the token, as huggingface_hub does), then read by parallel ranged
GETs over the keep-alive connections of `HttpRanges`, like any other origin. The Hub's 429
and 5xx are retried and throttle the download (AIMD) like the S3 store's SlowDown.

huggingface_hub is imported on a miss only (it takes most of a second).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import re
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

from weightcache.config import check_endpoint_url
from weightcache.errors import SourceError, UsageError
from weightcache.sourceurl import HUB_COMMIT
from weightcache.transfer.backends.hub.listing import HubFile, HubListing, parse_info, parse_tree
from weightcache.transfer.httpclient import HttpRanges
from weightcache.transfer.pacing import Backoff, Retries, Verdict, retrying
from weightcache.transfer.sources import READ_TIMEOUT, RangeReader, RetryRange

#: Tries of one metadata call (the revision's listing) through 429, 5xx and network errors.
API_ATTEMPTS = 6
#: Pages of a tree listing read at most (the Hub's hold 1,000 files each).
MAX_TREE_PAGES = 1000
#: Same-host redirects followed to locate a file (a renamed repository answers with one).
MAX_REDIRECTS = 5
#: Pinned listings kept in the process: a commit's files never change, and a fetch opens
#: its revision once per blob.
_PINNED_KEEP = 32
_pinned: dict[tuple[str, str, str], HubListing] = {}
_pinned_lock = threading.Lock()
#: What to do when the Hub kept failing.
_LATER = "try again later (or give it longer with --timeout)"
log = logging.getLogger(__name__)


class HubRevision:
    """A model repository of the Hub at a branch, tag or commit (a RevisionSource). The
    listing (and with it the commit) is read once, on first use; every file is then read
    at that commit, so a branch that moves during the fetch does not mix two commits."""

    def __init__(self, http: HttpRanges, repo_id: str, revision: str, timeout: float) -> None:
        """Each call to the Hub is retried within `timeout` seconds (`--timeout`)."""
        self._http, self.repo_id, self.revision = http, repo_id, revision
        self._retries = Retries(timeout, API_ATTEMPTS, Backoff(base=0.5, cap=8.0))
        self._lock = threading.Lock()
        self._listing: HubListing | None = None

    @property
    def url(self) -> str:
        return f"hf://{self.repo_id}@{self.revision}"

    @property
    def manifest_hint(self) -> str:
        return (
            "the Hub vouches for the sha256 of LFS files only: commit a SHA256SUMS to the "
            f"repository (`weightcache manifest {self.url} > SHA256SUMS`, then `hf upload "
            f"{self.repo_id} SHA256SUMS`), or track every file with LFS"
        )

    @property
    def commit(self) -> str:
        """The commit the revision names (one metadata call on first use)."""
        return self.listing().commit

    def list_sizes(self) -> dict[str, int]:
        return {path: f.size for path, f in self.listing().files.items()}

    def vouches(self) -> dict[str, tuple[str, str]]:
        """{path: ("sha256", LFS oid)} for LFS files, ("git-sha1", blob id) for the rest."""
        found: dict[str, tuple[str, str]] = {}
        for path, f in self.listing().files.items():
            if f.sha256:
                found[path] = ("sha256", f.sha256)
            elif f.blob_id:
                found[path] = ("git-sha1", f.blob_id)
        return found

    def read_bytes(self, relpath: str) -> bytes:
        f = self.listing().files.get(relpath)
        if f is None:
            raise SourceError(f"no {relpath} in {self.url} (commit {self.commit})")
        return read_whole(self.blob(relpath), f.size, self._retries, self._http.stopped)

    def blob(self, relpath: str) -> HubBlob:
        hub = _hub()
        commit = self.commit
        quoted = urllib.parse.quote(relpath)
        url = f"{hub.constants.ENDPOINT}/{self.repo_id}/resolve/{commit}/{quoted}"
        where = f"hf://{self.repo_id}@{commit}/{relpath}"
        return HubBlob(self._http, url, dict(hub.utils.build_hf_headers()), where)

    def listing(self) -> HubListing:
        """The revision's commit and files. Raises SourceError (no such repository or
        revision, gated or private without a token), TransientError (the Hub kept failing)."""
        with self._lock:
            if self._listing is None:
                self._listing = self._pinned_or_read()
            return self._listing

    def _pinned_or_read(self) -> HubListing:
        key = (_hub().constants.ENDPOINT, self.repo_id, self.revision)
        with _pinned_lock:
            found = _pinned.get(key)
        if found is not None:
            return found
        listing = self._read_listing()
        with _pinned_lock:  # under its commit: what a branch resolved to is read once
            while len(_pinned) >= _PINNED_KEEP:
                _pinned.pop(next(iter(_pinned)))
            _pinned[(key[0], self.repo_id, listing.commit)] = listing
        return listing

    def _read_listing(self) -> HubListing:
        endpoint = check_endpoint_url(_hub().constants.ENDPOINT, "HF_ENDPOINT")
        check_token(_hub())
        api = f"{endpoint}/api/models/{self.repo_id}"
        revision = urllib.parse.quote(self.revision, safe="")
        body, _ = self._api_get(f"{api}/revision/{revision}", {"blobs": "true"})
        commit, files = parse_info(body, f"the model info of {self.url} from {endpoint}")
        if re.fullmatch(HUB_COMMIT, self.revision) and commit != self.revision:
            raise SourceError(
                f"{self.url}: the server at {endpoint} (HF_ENDPOINT) answered with commit "
                f"{commit}, not {self.revision}: a mirror that ignores the revision asked "
                "for, or one not to trust; point HF_ENDPOINT at the Hub or a faithful mirror"
            )
        if files is None:  # a mirror that ignores ?blobs=true: its tree has the sizes
            log.info("%s: no sizes in the model info, reading the tree listing", self.url)
            files = self._read_tree(f"{api}/tree/{commit}", endpoint)
        return HubListing(commit, files)

    def _read_tree(self, url: str, endpoint: str) -> dict[str, HubFile]:
        """The files of the recursive tree listing at `url`, page after page (Link: next,
        on the same host: the token goes with each page)."""
        what = f"the tree listing of hf://{self.repo_id} from {endpoint}"
        files: dict[str, HubFile] = {}
        params = {"recursive": "true", "expand": "false"}
        for _ in range(MAX_TREE_PAGES):
            try:
                body, following = self._api_get(url, params)
            except SourceError as e:
                raise SourceError(
                    f"the model info from {endpoint} (HF_ENDPOINT) lists no file sizes (a "
                    f"mirror that ignores ?blobs=true) and its tree listing failed: {e}"
                ) from e
            page = parse_tree(body, what)
            if page.keys() & files.keys():
                raise SourceError(f"{what} lists a file twice; point HF_ENDPOINT at a Hub")
            files.update(page)
            if following is None:
                return files
            nxt = urllib.parse.urljoin(url, following)
            if urllib.parse.urlsplit(nxt).netloc != urllib.parse.urlsplit(url).netloc:
                raise SourceError(f"{what} sends its next page to another host ({nxt})")
            url, params = nxt, {}
        raise SourceError(f"{what} has more than {MAX_TREE_PAGES} pages; is it a loop?")

    def _api_get(self, url: str, params: dict[str, str]) -> tuple[bytes, str | None]:
        """The body of the Hub's 200 to a GET of its API, and the URL of the next page
        (Link) if any, with huggingface_hub's session and headers (HF_TOKEN). Retried
        through 429, 5xx and network errors. Raises SourceError (refused, HF_HUB_OFFLINE),
        TransientError (the Hub kept failing)."""
        hub = _hub()

        def get() -> tuple[bytes, str | None]:
            r = hub.utils.get_session().get(
                url, headers=hub.utils.build_hf_headers(), params=params,
                timeout=min(self._retries.budget, READ_TIMEOUT),
            )  # fmt: skip
            hub.utils.hf_raise_for_status(r)
            following: str | None = r.links.get("next", {}).get("url")
            return r.content, following

        def classify(e: Exception) -> Verdict:
            if isinstance(e, hub.errors.HfHubHTTPError):
                status = getattr(e.response, "status_code", 0)
                return f"HTTP {status}" if status == 429 or status >= 500 else self._refusal(e, hub)
            if isinstance(e, hub.errors.OfflineModeIsEnabled):
                return SourceError(
                    f"{self.url}: HF_HUB_OFFLINE is set, so the Hub cannot be asked; "
                    "unset it, or fetch a revision already in the cache by its commit"
                )
            return f"{type(e).__name__}: {e}"  # httpx's network errors

        return retrying(f"GET {url} for {self.url}", get, classify, self._retries,
                        _LATER, self._http.stopped)  # fmt: skip

    def _refusal(self, e: Any, hub: Any) -> SourceError:
        """The SourceError for the Hub's 4xx on the listing."""
        endpoint = hub.constants.ENDPOINT
        token = "the token in HF_TOKEN" if hub.get_token() else "no token (HF_TOKEN is unset)"
        if isinstance(e, hub.errors.GatedRepoError):
            return SourceError(
                f"{self.url} is a gated repository and {token} has no access to it: accept "
                f"its conditions on {endpoint}/{self.repo_id} and set HF_TOKEN to a token of "
                "that account"
            )
        if isinstance(e, hub.errors.RevisionNotFoundError):
            return SourceError(
                f"no revision {self.revision!r} in {self.repo_id} at {endpoint}: check the "
                "branch, tag or commit after the @"
            )
        if isinstance(e, hub.errors.RepositoryNotFoundError):
            return SourceError(
                f"no repository {self.repo_id} at {endpoint} that {token} can read: check "
                "the name, and set HF_TOKEN to a token with access if it is private"
            )
        status = getattr(e.response, "status_code", 0)
        if status in (401, 403):
            return SourceError(
                f"{self.url}: access denied (HTTP {status}) with {token}: set HF_TOKEN to a "
                "token that can read the repository"
            )
        return SourceError(f"{self.url}: the Hub at {endpoint} answered HTTP {status}")


class HubBlob:
    """One file of a Hub repository at one commit (a BlobSource): located once, then read
    by ranged GETs. A signed storage URL that stops working (it expires) is located again
    and the range retried."""

    kind = "origin"
    attempts: int | None = None
    throttles = True

    def __init__(self, http: HttpRanges, url: str, headers: dict[str, str], where: str) -> None:
        self._http, self._url, self._headers, self.where = http, url, headers, where
        self._lock = threading.Lock()
        self._located: tuple[str, dict[str, str]] | None = None

    @contextlib.contextmanager
    def open_range(self, start: int, end: int, size: int, timeout: float) -> Iterator[RangeReader]:
        location, headers = self._location(timeout)
        with contextlib.ExitStack() as stack:
            try:
                reader = stack.enter_context(
                    self._http.get(location, headers, start, end, size, timeout, self.where)
                )
            except SourceError as e:
                if location == self._url:
                    raise
                with self._lock:
                    self._located = None
                raise RetryRange(f"{e}; locating it again") from e
            yield reader

    def _location(self, timeout: float) -> tuple[str, dict[str, str]]:
        with self._lock:
            if self._located is None:
                self._located = locate(self._url, self._headers, timeout, self.where)
            return self._located


def check_token(hub: Any) -> None:
    """UsageError (exit 2) naming where the token comes from when no header can carry it:
    a request would fail in the HTTP library, which reads as a network error."""
    token = hub.get_token()
    if not token or re.fullmatch(r"[\x21-\x7e]+", token):
        return
    where = next((f"the environment variable {name}" for name in ("HF_TOKEN",
                  "HUGGING_FACE_HUB_TOKEN") if os.environ.get(name)),
                 f"the token file {hub.constants.HF_TOKEN_PATH}")  # fmt: skip
    raise UsageError(
        f"the Hub token in {where} holds a space or a character outside ASCII; set it "
        "to the token alone (hf_..., ASCII letters and digits)"
    )


def locate(
    url: str, headers: dict[str, str], timeout: float, where: str
) -> tuple[str, dict[str, str]]:
    """Where the bytes of the Hub file at `url` are read, and the headers to send there:
    the Hub serves a small file itself and redirects an LFS one to its storage, a signed
    URL on another host that gets no token. Raises RetryRange (network, 429, 5xx),
    SourceError (not found, denied: naming HF_TOKEN)."""
    for _ in range(MAX_REDIRECTS):
        status, reply = _head(url, headers, timeout)
        target = reply.get("location")
        if status in (301, 302, 303, 307, 308) and target:
            nxt = urllib.parse.urljoin(url, target)
            if urllib.parse.urlsplit(nxt).netloc != urllib.parse.urlsplit(url).netloc:
                return nxt, {k: v for k, v in headers.items() if k.lower() != "authorization"}
            url = nxt
            continue
        if status in (200, 206):
            return url, headers
        raise _head_failure(status, reply, where)
    raise SourceError(f"{where}: more than {MAX_REDIRECTS} redirects from the Hub")


def _head(url: str, headers: dict[str, str], timeout: float) -> tuple[int, dict[str, str]]:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.netloc, timeout=timeout)
    target = f"{parts.path}?{parts.query}" if parts.query else parts.path
    try:
        conn.request("HEAD", target, headers={**headers, "Accept-Encoding": "identity"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}
    except (OSError, http.client.HTTPException) as e:
        raise RetryRange(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()


def _head_failure(status: int, reply: dict[str, str], where: str) -> Exception:
    code = reply.get("x-error-code", "")
    if status == 429 or status == 503:
        return RetryRange(f"HTTP {status} from the Hub", throttle=True)
    if status >= 500 or status == 408:
        return RetryRange(f"HTTP {status} from the Hub")
    if code == "GatedRepo":
        return SourceError(
            f"{where}: gated repository (HTTP {status}): accept its conditions on the Hub and "
            "set HF_TOKEN to a token of that account"
        )
    if status in (401, 403):
        return SourceError(
            f"{where}: access denied (HTTP {status}): set HF_TOKEN to a token that can read "
            "the repository"
        )
    if status == 404:
        return SourceError(f"{where}: not found on the Hub ({code or 'HTTP 404'})")
    return SourceError(f"{where}: unexpected HTTP {status} from the Hub")


def read_whole(
    blob: HubBlob, size: int, retries: Retries, stop: threading.Event | None = None
) -> bytes:
    """A small file's bytes, retried through what a range read retries, within
    `retries`. Raises SourceError, TransientError, Interrupted once `stop` is set."""
    timeout = min(retries.budget, READ_TIMEOUT)
    return retrying(blob.where, lambda: _read_once(blob, size, timeout),
                    lambda e: str(e) if isinstance(e, RetryRange) else e, retries, _LATER,
                    stop)  # fmt: skip


def _read_once(blob: HubBlob, size: int, timeout: float) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    if not size:
        return b""
    with blob.open_range(0, size, size, timeout) as reader:
        while got < size:
            n = reader.readinto(view[got:])
            if not n:
                raise RetryRange(f"{blob.where}: truncated at byte {got} of {size}")
            got += n
    return bytes(buf)


def _hub() -> Any:
    """huggingface_hub, imported on first use (a miss)."""
    import huggingface_hub
    import huggingface_hub.constants
    import huggingface_hub.errors
    import huggingface_hub.utils

    for name in ("httpx", "httpx2", "httpcore"):  # its transport logs each request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    return huggingface_hub
