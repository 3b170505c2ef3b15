"""http(s):// sources: a revision as a directory of a web server (design §4, Revision sources).

A web server has no listing: the revision's SHA256SUMS names its files, and each file's size
comes from a HEAD (from a GET of its first byte where the server refuses HEAD: 405, 501),
sent in parallel before any byte is downloaded, so the fetch can plan
parts, reserve space and report a missing file (exit 3) before it downloads anything (the
Content-Range of the first ranged GET would come only once the download had started).
Blobs are read with ranged GETs on the shared keep-alive connections (httpclient.HttpRanges);
a 206 must carry exactly the Content-Range asked for.

A server that ignores Range answers a ranged GET with 200 and the whole file. One probe
(`Range: bytes=0-0` on the revision's largest file) finds out, and the answer is kept for
the revision in the connection pool (`HttpRanges.whole_only`), which outlives the
RevisionSource objects of one fetch: that revision's files are then read whole, one GET
each (`HttpBlob.whole_only`), and a read resumed at an offset drops the bytes before it.

Credentials: a bearer token from WEIGHTCACHE_HTTP_TOKEN, sent with every request of an
http(s) source. Redirects are not followed (the token would follow them): a 3xx is an
error naming the URL to use instead. https trusts the system's CA bundle, or the one
SSL_CERT_FILE names.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import http.client
import logging
import os
import re
import ssl
import threading
import urllib.parse
from collections.abc import Callable

from weightcache.config import is_digits
from weightcache.errors import IntegrityError, SourceError, TransientError, UsageError
from weightcache.transfer.httpclient import HttpRanges
from weightcache.transfer.pacing import Retries, Verdict, retrying
from weightcache.transfer.sources import READ_TIMEOUT, RangeReader, RetryRange

log = logging.getLogger(__name__)

#: The environment variable holding a bearer token for http(s) sources (design §4).
TOKEN_ENV = "WEIGHTCACHE_HTTP_TOKEN"
MANIFEST = "SHA256SUMS"
#: Attempts of one HEAD or manifest GET before a transient failure is final (exit 6).
REQUEST_ATTEMPTS = 6
#: HEADs in flight while sizing a revision's files.
HEADS_IN_FLIGHT = 16
_LINE = re.compile(r"[0-9a-fA-F]{64} [ *](.+)")
#: A server's answers to a HEAD it does not serve: the size then comes from a ranged GET.
_NO_HEAD = (405, 501)


def auth_headers() -> dict[str, str]:
    """The headers every request of an http(s) source carries: the bearer token, if set.
    Raises UsageError for a token no header can carry (a line break or space inside: two
    lines of a Secret; a character outside ASCII)."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token and not re.fullmatch(r"[\x21-\x7e]+", token):
        raise UsageError(
            f"{TOKEN_ENV} holds a space, a line break or a character outside ASCII inside "
            "the token; set it to the token alone, on one line"
        )
    return {"Authorization": f"Bearer {token}"} if token else {}


def refusal(resp: http.client.HTTPResponse, method: str, where: str) -> Exception:
    """The error for a response that is not the content asked for: RetryRange for what a
    retry may fix (throttle=True for 429 and 503), SourceError for the rest."""
    status = resp.status
    if status in (429, 503):
        return RetryRange(f"HTTP {status}", throttle=True)
    if status >= 500 or status == 408:
        return RetryRange(f"HTTP {status}")
    if status in (401, 403):
        given = "the token in" if os.environ.get(TOKEN_ENV) else "no token: set"
        return SourceError(
            f"{method} {where}: HTTP {status}, the server refused access; {given} {TOKEN_ENV} "
            "(a bearer token the server accepts)"
        )
    if status in (404, 410):
        return SourceError(f"{method} {where}: HTTP {status}, no such file on the server")
    if 300 <= status < 400:
        return SourceError(
            f"{method} {where}: HTTP {status} to {resp.getheader('Location')}; redirects are "
            "not followed: use the final URL as the source"
        )
    return SourceError(f"{method} {where}: unexpected HTTP {status}")


def check_encoding(resp: http.client.HTTPResponse, where: str) -> None:
    """SourceError (exit 3) for a success whose body is encoded (gzip, br): http.client
    asks for identity and does not decode, so its bytes and length are not the file's,
    and no retry changes that. (A store's object stored with a Content-Encoding is its
    bytes as stored: only a web server's encoding is on the fly.)"""
    encoding = (resp.getheader("Content-Encoding") or "identity").strip().lower()
    if resp.status < 300 and encoding != "identity":
        resp.close()
        raise SourceError(
            f"{where}: the server answered with Content-Encoding: {encoding[:40]} although "
            "asked for identity, so its bytes are not the file's; turn compression off for "
            "these files at the server (or the proxy before it)"
        )


def check_http_status(
    resp: http.client.HTTPResponse, start: int, end: int, size: int, where: str
) -> int:
    """A `StatusCheck` for web servers: a 206 must have exactly the Content-Range asked
    for; a 200 (Range ignored) must be the whole `size`-byte file, of which the first
    `start` bytes are to be skipped. IntegrityError if the file's size changed,
    SourceError if its body is encoded."""
    check_encoding(resp, f"GET {where}")
    if resp.status == 206:
        got = resp.getheader("Content-Range", "")
        if got == f"bytes {start}-{end - 1}/{size}":
            return 0
        total = got.rpartition("/")[2]
        if is_digits(total) and int(total) != size:
            raise _changed(where, int(total), size)
        raise SourceError(
            f"GET {where}: asked for bytes {start}-{end - 1}, the server answered "
            f"Content-Range {got!r}; check the server (or a proxy before it)"
        )
    if resp.status == 200:
        length = resp.getheader("Content-Length", "")
        if is_digits(length) and int(length) != size:
            raise _changed(where, int(length), size)
        return start
    if resp.status == 416:
        raise _changed(where, None, size)
    resp.read(4096)
    raise refusal(resp, "GET", where)


def _changed(where: str, now: int | None, size: int) -> IntegrityError:
    is_now = f"is {now} bytes now" if now is not None else "is shorter now"
    return IntegrityError(
        f"{where} {is_now} but was {size} when listed; the file changed during the fetch, "
        "run it again"
    )


def manifest_paths(data: bytes) -> list[str]:
    """The paths a SHA256SUMS names, in order (malformed lines are skipped here: the fetch
    validates the manifest itself and reports them)."""
    paths = []
    for line in data.decode("utf-8", "replace").split("\n"):
        m = _LINE.fullmatch(line.removesuffix("\r"))
        if m is not None:
            path = m.group(1).removeprefix("./")
            if path.isprintable() and not any(s in ("", ".", "..") for s in path.split("/")):
                paths.append(path)
    return paths


class HttpBlob:
    """A file of a web server (a BlobSource), read with ranged GETs. 429 and 503 lower the
    concurrency (AIMD). `whole_only` once its revision's server is known to ignore Range."""

    kind = "origin"
    attempts: int | None = None
    throttles = True

    def __init__(self, http: HttpRanges, url: str, revision: str) -> None:
        self._http, self.url, self._revision = http, url, revision

    @property
    def where(self) -> str:
        return self.url

    @property
    def whole_only(self) -> bool:
        """Read in one part by one reader: the server ignores Range (a probe or a read saw it)."""
        return self._revision in self._http.whole_only

    def open_range(
        self, start: int, end: int, size: int, timeout: float
    ) -> contextlib.AbstractContextManager[RangeReader]:
        return self._http.get(
            self.url, auth_headers(), start, end, size, timeout, self.where,
            check=self.check, ca_env=None,
        )  # fmt: skip

    def check(
        self, resp: http.client.HTTPResponse, start: int, end: int, size: int, where: str
    ) -> int:
        """`check_http_status`, remembering for the revision a server that ignores Range."""
        skip = check_http_status(resp, start, end, size, where)
        if resp.status == 200 and self._revision not in self._http.whole_only:
            log.info("%s ignores Range: its files are read whole, one GET each", self._revision)
            self._http.whole_only.add(self._revision)
        return skip


class HttpRevision:
    """A revision as a directory of a web server (a RevisionSource), listed by its
    SHA256SUMS and sized by HEADs; the manifest is read once per object (and a failure to
    read it is that object's answer: the fetch reads it from two threads at once). Each
    request is retried within `timeout` seconds (`--timeout`)."""

    def __init__(self, http: HttpRanges, url: str, timeout: float) -> None:
        self._http, self._url = http, url.rstrip("/")
        self._manifest: bytes | Exception | None = None
        self._lock = threading.Lock()
        self._retries = Retries(timeout, REQUEST_ATTEMPTS)
        self._timeout = min(timeout, READ_TIMEOUT)

    @property
    def url(self) -> str:
        return self._url

    @property
    def manifest_hint(self) -> str:
        return (
            "a web server cannot be listed, so an http(s) source needs its SHA256SUMS: run "
            "`sha256sum` over the files in the served directory (`find . -type f ! -name "
            "SHA256SUMS -printf '%P\\0' | xargs -0 sha256sum > SHA256SUMS`)"
        )

    def vouches(self) -> dict[str, tuple[str, str]]:
        """A web server vouches for no file's content: only SHA256SUMS verifies them."""
        return {}

    def file_url(self, relpath: str) -> str:
        return f"{self._url}/{urllib.parse.quote(relpath)}"

    def list_sizes(self) -> dict[str, int]:
        """{path: size} of SHA256SUMS and of every file it names (HEADs in parallel), after
        one probe of whether the server honours Range. SourceError if SHA256SUMS or a
        file it names is missing."""
        data = self._read_manifest()
        paths = manifest_paths(data)
        sizes: dict[str, int] = {}
        with cf.ThreadPoolExecutor(min(HEADS_IN_FLIGHT, max(1, len(paths)))) as pool:
            # A few windows' worth at a time: a missing file ends the listing there, not
            # after a HEAD of every one of a million lines.
            window = 4 * HEADS_IN_FLIGHT
            for i in range(0, len(paths), window):
                chunk = paths[i : i + window]
                sizes.update(zip(chunk, pool.map(self._head, chunk), strict=True))
        self._probe_ranges(sizes)
        return {MANIFEST: len(data), **sizes}

    def read_bytes(self, relpath: str) -> bytes:
        if relpath == MANIFEST:
            return self._read_manifest()
        return self._request("GET", relpath)[1]

    def blob(self, relpath: str) -> HttpBlob:
        return HttpBlob(self._http, self.file_url(relpath), self._url)

    def _read_manifest(self) -> bytes:
        with self._lock:
            if self._manifest is None:
                missing = f"no {MANIFEST} at {self._url}/{MANIFEST}; {self.manifest_hint}"
                try:
                    self._manifest = self._request("GET", MANIFEST, missing)[1]
                except (SourceError, TransientError) as e:
                    self._manifest = e
            if isinstance(self._manifest, Exception):
                raise self._manifest
            return self._manifest

    def _head(self, relpath: str) -> int:
        """The file's size from a HEAD, or from a GET of its first byte when the server
        refuses HEAD (405, 501)."""
        resp, _ = self._request("HEAD", relpath, allow=_NO_HEAD)
        if resp.status in _NO_HEAD:
            return self._size_by_get(relpath)
        length = resp.getheader("Content-Length", "")
        if not is_digits(length):
            raise SourceError(
                f"HEAD {self.file_url(relpath)} gave no Content-Length; serve the files as "
                "static files"
            )
        return int(length)

    def _size_by_get(self, relpath: str) -> int:
        """The size from `GET` with `Range: bytes=0-0`: the total of its Content-Range
        (of a 206, or of the 416 of an empty file), or the Content-Length of a 200 (a
        server that ignores Range; its body is not read)."""
        location = self.file_url(relpath)
        headers = {**auth_headers(), "Range": "bytes=0-0"}

        def once() -> tuple[http.client.HTTPResponse, bytes]:
            got = self._http.request("GET", location, headers, self._timeout, None, body=False)
            check_encoding(got[0], f"GET {location}")
            if got[0].status not in (200, 206, 416):
                raise refusal(got[0], "GET", location)
            return got

        resp, _ = self._retrying(once, location)
        if resp.status == 200:
            size = resp.getheader("Content-Length", "")
        else:
            size = resp.getheader("Content-Range", "").rpartition("/")[2]
        if not is_digits(size):
            raise SourceError(
                f"GET {location} (the server refuses HEAD) gave no size: no "
                f"{'Content-Length' if resp.status == 200 else 'Content-Range total'}; serve "
                "the files as static files"
            )
        return int(size)

    def _probe_ranges(self, sizes: dict[str, int]) -> None:
        """Ask the largest file for its first byte: a 200 means the server ignores Range."""
        if not sizes or max(sizes.values()) < 2 or self._url in self._http.whole_only:
            return
        largest = max(sizes, key=lambda p: sizes[p])
        blob = self.blob(largest)
        headers = {**auth_headers(), "Range": "bytes=0-0"}
        resp, _ = self._retrying(
            lambda: self._http.request("GET", blob.url, headers, self._timeout, None, body=False),
            blob.url,
        )
        if resp.status == 200:
            blob.check(resp, 0, 1, sizes[largest], blob.url)

    def _request(
        self, method: str, relpath: str, missing: str | None = None, allow: tuple[int, ...] = ()
    ) -> tuple[http.client.HTTPResponse, bytes]:
        """A HEAD or a small GET of `relpath`, retried while the failure is transient;
        SourceError for an answer other than 200 or `allow` (`missing` its message for a
        404)."""
        location = self.file_url(relpath)

        def once() -> tuple[http.client.HTTPResponse, bytes]:
            resp, body = self._http.request(method, location, auth_headers(), self._timeout, None)
            check_encoding(resp, f"{method} {location}")
            if resp.status in (404, 410) and missing:
                raise SourceError(missing)
            if resp.status != 200 and resp.status not in allow:
                raise refusal(resp, method, location)
            return resp, body

        return self._retrying(once, location)

    def _retrying(
        self, call: Callable[[], tuple[http.client.HTTPResponse, bytes]], location: str
    ) -> tuple[http.client.HTTPResponse, bytes]:
        """`call()`, again after a backoff while it raises RetryRange (within the
        revision's Retries, then TransientError); a certificate the system does not trust
        is SourceError; Interrupted after the connections' `interrupt()`."""

        def classify(e: Exception) -> Verdict:
            if isinstance(e, ssl.SSLCertVerificationError):
                return SourceError(
                    f"{location}: {e.verify_message}; if the server's CA is private, point "
                    "SSL_CERT_FILE at a bundle that holds it"
                )
            return str(e) if isinstance(e, RetryRange) else e

        advice = "run the fetch again when the server recovers (or give it longer with --timeout)"
        return retrying(location, call, classify, self._retries, advice, self._http.stopped)
