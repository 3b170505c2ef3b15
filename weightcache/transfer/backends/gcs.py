"""gs:// sources: a revision as a Google Cloud Storage prefix, through gcsfs (design §4,
Revision sources).

gcsfs (fsspec) owns what is GCS-specific: the credential chain, its aiohttp session, the
objects' URLs, the listing with each object's size, generation, crc32c and md5Hash, and
the small reads and writes (SHA256SUMS). Data ranges are ranged GETs on that same session,
streamed: one GET per part, read a buffer at a time, never a part held in memory, and
retried by the downloader's one policy (gcsfs's own retries would hide a 429 from the AIMD
gate and sleep up to 32 s in a loop nobody can interrupt).

gcsfs is asynchronous; the downloader's workers are threads. One event loop runs in a
daemon thread of its own for the whole process (`GcsClient.shared`), and each worker
submits its coroutines to it and waits; a `readinto` is one coroutine, bounded by the read
timeout, that waits once for bytes and then takes what is already buffered.

Credentials: gcsfs's standard chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud's application
default credentials, workload identity through the metadata server). With
STORAGE_EMULATOR_HOST set (an emulator), requests go there, unauthenticated.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import threading
from collections.abc import Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from weightcache.config import is_digits
from weightcache.errors import IntegrityError, SourceError, TransientError, UsageError
from weightcache.transfer.sources import RangeReader, RetryRange

if TYPE_CHECKING:
    import aiohttp

T = TypeVar("T")

#: Seconds a listing, a small read or a write may take in all, gcsfs's retries included.
CONTROL_TIMEOUT = 300.0

_CREDENTIALS_HINT = (
    "check the credentials: GOOGLE_APPLICATION_CREDENTIALS (a service account key file), "
    "`gcloud auth application-default login`, or the Pod's workload identity, and that "
    "they may read the bucket (roles/storage.objectViewer)"
)


def listed_checksums(info: dict[str, Any]) -> dict[str, str]:
    """{algorithm: lowercase hex} of what a GCS object resource vouches for: its crc32c
    (base64 of the big-endian 32-bit value, on every object) and its md5Hash (absent on
    composite objects), from the listing."""
    sums = {}
    for field, algorithm in (("crc32c", "crc32c"), ("md5Hash", "md5")):
        value = info.get(field)
        if isinstance(value, str) and value:
            sums[algorithm] = base64.b64decode(value).hex()
    return sums


def _error(e: BaseException, where: str) -> Exception:
    """The WeightcacheError for what gcsfs raised about `where` (after its own retries)."""
    code = getattr(e, "code", None)
    if isinstance(e, FileNotFoundError):
        return SourceError(f"{where}: not found; check the bucket and prefix")
    if code in (401, 403) or (isinstance(e, OSError) and "Forbidden" in str(e)):
        return SourceError(f"{where}: access denied ({code or 403}); {_CREDENTIALS_HINT}")
    if code in (408, 429) or (isinstance(code, int) and code >= 500):
        return TransientError(f"{where}: HTTP {code} persisted through retries; try again")
    if type(e).__module__.startswith("google.auth"):
        return SourceError(f"{where}: no usable credentials ({e}); {_CREDENTIALS_HINT}")
    if isinstance(e, asyncio.TimeoutError):  # (its text is empty)
        return TransientError(
            f"{where}: no answer from GCS within --timeout; try again when it is reachable "
            "(or give it longer with --timeout)"
        )
    if isinstance(e, OSError):
        return TransientError(f"{where}: {type(e).__name__}: {e}; try again")
    return SourceError(f"{where}: {type(e).__name__}: {e}")


class GcsClient:
    """One gcsfs filesystem on its own event loop thread. Thread-safe: every call is a
    coroutine submitted to that loop."""

    _shared: GcsClient | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        # gcsfs announces its experimental features at INFO on import: not about the fetch.
        logging.getLogger("gcsfs").setLevel(logging.WARNING)
        try:
            import gcsfs.core  # the plain JSON-API filesystem: no gRPC bucket-type probes
        except ImportError as e:
            raise UsageError(
                f"gs:// sources need gcsfs ({e}): pip install 'weightcache[gcs]'"
            ) from e

        self.loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self.loop.run_forever, name="gcs-io", daemon=True)
        thread.start()
        token = "anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None

        async def build() -> Any:
            return gcsfs.core.GCSFileSystem(
                token=token, asynchronous=True, loop=self.loop, skip_instance_cache=True,
                use_listings_cache=False,
            )  # fmt: skip

        self.fs = self.run(build(), CONTROL_TIMEOUT)

    @classmethod
    def shared(cls) -> GcsClient:
        """The process's client (one session, one connection pool), built on first use."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def close(self) -> None:
        """Close the session on its loop, then stop the loop (a client built for a while,
        as in tests: the process's shared one lives as long as the process)."""
        session = getattr(self.fs, "_session", None)
        if session is not None:
            self.run(session.close(), CONTROL_TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop; wait at most `timeout` seconds (asyncio.TimeoutError)."""
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop).result()

    def call(self, coro: Coroutine[Any, Any, T], where: str, timeout: float) -> T:
        """A control-plane call (gcsfs retries inside) given `timeout` seconds in all; its
        errors as WeightcacheErrors."""
        try:
            return self.run(coro, timeout)
        except Exception as e:
            raise _error(e, where) from e

    async def get(self, path: str, generation: str | None, start: int, end: int,
                  timeout: float) -> aiohttp.ClientResponse:  # fmt: skip
        """The response to a GET of bytes [start, end) of `path` ("bucket/key")."""
        import aiohttp

        await self.fs._set_session()
        headers = self.fs._get_headers({"Range": f"bytes={start}-{end - 1}"})
        limits = aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout)
        resp: aiohttp.ClientResponse = await self.fs.session.get(
            self.fs.url(path, generation=generation), headers=headers, timeout=limits
        )
        return resp


class GcsRevision:
    """A revision as a gs://bucket/prefix (a RevisionSource). The listing is read once and
    kept: the blobs read the generations it saw, and `vouches` gives its checksums."""

    def __init__(
        self, bucket: str, prefix: str, timeout: float, client: GcsClient | None = None
    ) -> None:
        """Each call to GCS (gcsfs retries inside) ends within `timeout` (`--timeout`)."""
        self.bucket, self.prefix, self._timeout = bucket, prefix, timeout
        self._client = client
        self._listing: dict[str, dict[str, Any]] | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> GcsClient:
        if self._client is None:
            self._client = GcsClient.shared()
        return self._client

    @property
    def url(self) -> str:
        return f"gs://{self.bucket}/{self.prefix}"

    @property
    def manifest_hint(self) -> str:
        return (
            f"write it with `weightcache manifest {self.url}/ --write` so that downloads "
            "can be verified"
        )

    def listing(self) -> dict[str, dict[str, Any]]:
        """{relative path: object resource} of every object under the prefix."""
        with self._lock:
            if self._listing is None:
                root = f"{self.bucket}/{self.prefix}/"
                found = self.client.call(
                    self.client.fs._find(root, detail=True), self.url, self._timeout
                )
                self._listing = {
                    name.removeprefix(root): info
                    for name, info in found.items()
                    if info.get("type") == "file" and name.startswith(root)
                }
            return self._listing

    def list_sizes(self) -> dict[str, int]:
        return {rel: int(info["size"]) for rel, info in self.listing().items()}

    def vouches(self) -> dict[str, tuple[str, str]]:
        """{relative path: (algorithm, hex)} of what GCS vouches for each object: crc32c,
        which every object has, else md5 (design §4, verification)."""
        vouched: dict[str, tuple[str, str]] = {}
        for rel, info in self.listing().items():
            sums = listed_checksums(info)
            for algorithm in ("crc32c", "md5"):
                if algorithm in sums:
                    vouched[rel] = (algorithm, sums[algorithm])
                    break
        return vouched

    def read_bytes(self, relpath: str) -> bytes:
        path = f"{self.bucket}/{self.prefix}/{relpath}"
        data: bytes = self.client.call(
            self.client.fs._cat_file(path), f"gs://{path}", self._timeout
        )
        return data

    def put_bytes(self, relpath: str, data: bytes) -> None:
        """Put one small object (a single upload: readers see the old one or the new)."""
        path = f"{self.bucket}/{self.prefix}/{relpath}"
        self.client.call(self.client.fs._pipe_file(path, data), f"gs://{path}", self._timeout)

    def blob(self, relpath: str) -> GcsBlob:
        info = (self._listing or {}).get(relpath, {})
        return GcsBlob(self.client, f"{self.bucket}/{self.prefix}/{relpath}",
                       info.get("generation"))  # fmt: skip


class GcsBlob:
    """An object of a GCS bucket (a BlobSource), read by ranged GETs of the generation
    listed, if known: an object replaced since the listing is a 404, not other bytes.
    GCS's 429 and 503 lower the concurrency (AIMD)."""

    kind = "origin"
    attempts: int | None = None
    throttles = True

    def __init__(self, client: GcsClient, path: str, generation: str | None) -> None:
        self._client, self.path, self.generation = client, path, generation

    @property
    def where(self) -> str:
        return f"gs://{self.path}"

    @contextlib.contextmanager
    def open_range(self, start: int, end: int, size: int, timeout: float) -> Iterator[RangeReader]:
        get = self._client.get(self.path, self.generation, start, end, timeout)
        try:
            resp = self._client.run(get, timeout)
        except Exception as e:  # connection refused or reset, DNS, timeout
            raise RetryRange(f"{type(e).__name__}: {e}") from e
        try:
            self._check(resp, start, end, size)
            yield _GcsRange(self._client, resp, timeout)
        finally:  # a connection goes back to the pool only after a complete body
            done = resp.content.at_eof()
            self._client.loop.call_soon_threadsafe(resp.release if done else resp.close)

    def _check(self, resp: aiohttp.ClientResponse, start: int, end: int, size: int) -> None:
        """Accept a 206 of the right object, or a 200 for a whole-object read; raise
        RetryRange (throttle for 429/503), IntegrityError, SourceError."""
        status = resp.status
        if status == 206:
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
            if is_digits(total) and int(total) != size:
                raise IntegrityError(
                    f"{self.where} is {total} bytes now but was {size} when listed; the "
                    "object changed during the fetch, run it again"
                )
            return
        if status == 200 and start == 0 and end == size:
            return
        if status in (429, 503):
            raise RetryRange(f"HTTP {status} (GCS asks to slow down)", throttle=True)
        if status >= 500 or status == 408:
            raise RetryRange(f"HTTP {status}")
        if status in (401, 403):
            raise SourceError(f"GET {self.where}: access denied ({status}); {_CREDENTIALS_HINT}")
        if status in (404, 416):
            raise SourceError(f"GET {self.where}: HTTP {status}; the object changed or vanished")
        raise SourceError(f"GET {self.where}: unexpected HTTP {status}")


class _GcsRange:
    def __init__(self, client: GcsClient, resp: aiohttp.ClientResponse, timeout: float) -> None:
        self._client, self._resp, self._timeout = client, resp, timeout

    def readinto(self, buf: memoryview) -> int:
        try:
            return self._client.run(self._fill(buf), self._timeout)
        except Exception as e:  # reset, cut body, timeout
            raise RetryRange(f"{type(e).__name__}: {e}") from e

    async def _fill(self, buf: memoryview) -> int:
        """Wait once for bytes, then copy what is already buffered, up to len(buf)."""
        content = self._resp.content
        data = await content.read(len(buf))
        n = len(data)
        buf[:n] = data
        while n < len(buf):
            more = content.read_nowait(len(buf) - n)
            if not more:
                break
            buf[n : n + len(more)] = more
            n += len(more)
        return n
