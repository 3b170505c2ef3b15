"""Azure Blob Storage as a revision source: `az://container/prefix/<name>/<rev>` and
`abfs://container@account.dfs.core.windows.net/prefix/<name>/<rev>` (design §4, Revision
sources).

adlfs (fsspec) owns the credentials and the client: its chain is
AZURE_STORAGE_CONNECTION_STRING, else AZURE_STORAGE_ACCOUNT_NAME (or the abfs:// host) with
AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, else azure-identity's
DefaultAzureCredential (AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, workload
identity, managed identity). fsspec owns the one event-loop thread all its calls run on; the
downloader's worker threads hand it coroutines (`run_coroutine_threadsafe`) and wait for
them, so one loop thread carries every connection of the process.

A range is read as ranged GETs of CHUNK bytes through the client adlfs built, the next chunk
requested while the caller copies the current one (memory: two chunks per worker). Each GET
is `download_blob(offset, length)`, the call adlfs's `_cat_file(path, start, end)` makes, made
here directly for two things `_cat_file` does not give: the blob's whole size from the
response (a blob rewritten during the fetch is an integrity error, as for S3) and
`retry_total=0`. The SDK's own retries are off on every call: its 503 ServerBusy would
otherwise be slept on for 15 s and more inside the SDK, out of reach of the downloader's
retries and AIMD gate; here it is a throttling `RetryRange` like S3's SlowDown.

Azure stores a Content-MD5 for a blob written in one Put Blob (or when the uploader set it):
the listing returns it, and `vouches()` hands it on as ("md5", hex).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from weightcache.config import is_digits
from weightcache.errors import (
    IntegrityError,
    SourceError,
    UsageError,
    WeightcacheError,
)
from weightcache.transfer.pacing import Retries, Verdict, retrying
from weightcache.transfer.sources import RangeReader, RetryRange

T = TypeVar("T")

#: Bytes per ranged GET. 4 MiB is the SDK's own download chunk: large enough that the
#: per-request cost (headers, one loop round trip) is small, small enough that a read waits
#: for at most 4 MiB and memory stays at two chunks per worker (benchmarks/azure_source.py).
CHUNK = 4 << 20
#: Attempts of a control-plane call (listing, SHA256SUMS) before a transient failure is
#: final, and the seconds one attempt may take (a listing is paged: several requests).
CONTROL_ATTEMPTS = 5
CONTROL_TIMEOUT = 120.0

CREDENTIALS_HINT = (
    "check the credentials: AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_NAME with "
    "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, or an identity (AZURE_CLIENT_ID/"
    "AZURE_TENANT_ID/AZURE_CLIENT_SECRET, workload or managed identity) with the role Storage "
    "Blob Data Reader on the container"
)


@dataclass(frozen=True)
class Listed:
    """One blob of a listing: its size and, when Azure holds one, its Content-MD5."""

    size: int
    md5: bytes | None


def split_location(bucket: str) -> tuple[str, str | None]:
    """(container, account) of a source's bucket: `container` (az://, the account from the
    environment: None) or `container@account.dfs.core.windows.net` (abfs://)."""
    container, _, host = bucket.partition("@")
    return container, (host.split(".", 1)[0] if host else None)


def connection_string_account(env: dict[str, str] | os._Environ[str]) -> str | None:
    """The AccountName of AZURE_STORAGE_CONNECTION_STRING, if one is set and names one."""
    for field in env.get("AZURE_STORAGE_CONNECTION_STRING", "").split(";"):
        key, _, value = field.partition("=")
        if key.strip().lower() == "accountname":
            return value.strip()
    return None


def refused(where: str, status: int, code: str) -> WeightcacheError | RetryRange:
    """The error for the service's refusal (HTTP status, x-ms-error-code) of a request for
    `where`: throttling (503 ServerBusy, 429) and other 5xx are retryable."""
    label = f"HTTP {status} {code}".strip()
    if status in (429, 503) or code in ("ServerBusy", "OperationTimedOut"):
        return RetryRange(label, throttle=True)
    if status >= 500 or status == 408:
        return RetryRange(label)
    if status in (401, 403):
        return SourceError(f"{where}: access denied ({label}); {CREDENTIALS_HINT}")
    if status == 404:
        return SourceError(
            f"{where}: not found ({label}); check the account, the container and the path"
        )
    if status == 416:
        return SourceError(f"{where}: {label}; the blob changed or vanished, run it again")
    return SourceError(f"{where}: unexpected {label}")


def translate(e: BaseException, where: str) -> WeightcacheError | RetryRange:
    """Map an azure-core, aiohttp or OS exception to the weightcache error for its exit
    code, or to a RetryRange for what a retry may fix."""
    if isinstance(e, WeightcacheError | RetryRange):
        return e
    from azure.core import exceptions as ax

    status = getattr(e, "status_code", None)
    if isinstance(e, ax.HttpResponseError) and status is not None and status >= 400:
        return refused(where, status, str(getattr(e, "error_code", None) or ""))
    if isinstance(e, ax.ClientAuthenticationError):  # no token: no credential in the chain
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return UsageError(f"{where}: no usable Azure credentials ({first}); {CREDENTIALS_HINT}")
    if isinstance(e, ax.AzureError | OSError):  # connection, timeout, truncated body
        return RetryRange(f"{type(e).__name__}: {e}")
    return WeightcacheError(f"{where}: unexpected {type(e).__name__}: {e}")


_FILESYSTEMS: dict[tuple[str | None, str | None], Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def _filesystem(account: str | None) -> Any:
    """adlfs's AzureBlobFileSystem for `account` (None: from the environment), one per
    account and connection string in the process: every blob of every fetch (and every
    thread: fsspec's own instance cache is per thread) shares its client, its connection
    pool and its credential's token."""
    named = connection_string_account(os.environ)
    if account is not None and named is not None and named != account:
        raise UsageError(
            f"AZURE_STORAGE_CONNECTION_STRING is for the account {named!r}, the source names "
            f"{account!r}: unset it, or use the source's account"
        )
    key = (account, os.environ.get("AZURE_STORAGE_CONNECTION_STRING"))
    with _FILESYSTEMS_LOCK:
        if key not in _FILESYSTEMS:
            _FILESYSTEMS[key] = _connect(account)
        return _FILESYSTEMS[key]


def _connect(account: str | None) -> Any:
    try:
        import adlfs
    except ImportError as e:
        raise UsageError(
            "az:// and abfs:// sources need adlfs: pip install 'weightcache[azure]'"
        ) from e
    # azure-core logs every request and response at INFO: the fetch's log is ours.
    logging.getLogger("azure").setLevel(logging.WARNING)
    try:
        return adlfs.AzureBlobFileSystem(account_name=account)
    except ValueError as e:
        raise UsageError(
            "no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME (or "
            "AZURE_STORAGE_CONNECTION_STRING), or name it in the URL, "
            "abfs://container@account.dfs.core.windows.net/..."
        ) from e


def _submit(fs: Any, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Run `coro` on fsspec's loop thread; the future is the caller's to wait for."""
    return asyncio.run_coroutine_threadsafe(coro, fs.loop)


async def _list(fs: Any, container: str, prefix: str) -> dict[str, Listed]:
    """Every blob under `prefix/` (paged by the SDK), folder markers left out."""
    client = fs.service_client.get_container_client(container)
    found: dict[str, Listed] = {}
    pages = client.list_blobs(name_starts_with=prefix, include=["metadata"], retry_total=0)
    async for blob in pages:
        meta = {k.lower(): v for k, v in (blob.metadata or {}).items()}
        if meta.get("hdi_isfolder") == "true":  # an ADLS Gen2 directory, not a file
            continue
        md5 = blob.content_settings.content_md5 if blob.content_settings else None
        found[blob.name[len(prefix) :]] = Listed(blob.size, bytes(md5) if md5 else None)
    return found


async def _get(blob_client: Any, offset: int, length: int | None) -> tuple[bytes, int]:
    """Bytes [offset, offset+length) of the blob (the rest if length is None), and the
    blob's whole size as the response's Content-Range states it (-1 if it has none)."""
    totals: list[int] = []

    def note_total(response: Any) -> None:
        total = response.http_response.headers.get("Content-Range", "").rpartition("/")[2]
        totals.append(int(total) if is_digits(total) else -1)

    stream = await blob_client.download_blob(
        offset=offset, length=length, max_concurrency=1, retry_total=0,
        raw_response_hook=note_total,
    )  # fmt: skip
    return await stream.readall(), totals[0] if totals else -1


class AzureRevision:
    """A revision as a prefix of an Azure Blob container (a RevisionSource). Listed once
    (sizes and Content-MD5s); its blobs are `AzureBlob`s on the same client."""

    def __init__(self, url: str, bucket: str, prefix: str, timeout: float) -> None:
        """Each call to the account is retried within `timeout` seconds (`--timeout`)."""
        self._url = url
        self._retries = Retries(timeout, CONTROL_ATTEMPTS)
        self.container, self.account = split_location(bucket)
        self.prefix = prefix
        self._fs = _filesystem(self.account)
        self._listing: dict[str, Listed] | None = None

    @property
    def url(self) -> str:
        return self._url

    @property
    def manifest_hint(self) -> str:
        return (
            f"make it with `weightcache manifest {self.url}/ > SHA256SUMS` and upload it "
            f"beside the files (`az storage blob upload --container-name {self.container} "
            f"--name {self.prefix}/SHA256SUMS --file SHA256SUMS`)"
        )

    def list_sizes(self) -> dict[str, int]:
        return {path: blob.size for path, blob in self._list().items()}

    def vouches(self) -> dict[str, tuple[str, str]]:
        """{relpath: ("md5", 32 hex digits)} for the blobs whose Content-MD5 Azure holds."""
        return {p: ("md5", b.md5.hex()) for p, b in self._list().items() if b.md5}

    def read_bytes(self, relpath: str) -> bytes:
        client = self._blob_client(relpath)
        return self._call(f"{self.url}/{relpath}", lambda: _get(client, 0, None))[0]

    def blob(self, relpath: str) -> AzureBlob:
        return AzureBlob(self._fs, self._blob_client(relpath), f"{self.url}/{relpath}")

    def _list(self) -> dict[str, Listed]:
        if self._listing is None:
            where = f"{self.url}/"
            names = f"{self.prefix}/"
            self._listing = self._call(where, lambda: _list(self._fs, self.container, names))
            if not self._listing:
                raise SourceError(
                    f"no blobs under {where}; check the account, the container and the prefix"
                )
        return self._listing

    def _blob_client(self, relpath: str) -> Any:
        return self._fs.service_client.get_blob_client(self.container, f"{self.prefix}/{relpath}")

    def _call(self, where: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """A control-plane call, retried with backoff on what a retry may fix; raises the
        translated error, TransientError once the revision's Retries are spent."""

        def attempt() -> T:
            future = _submit(self._fs, make())
            try:
                return future.result(min(self._retries.budget, CONTROL_TIMEOUT))
            except Exception:
                future.cancel()
                raise

        def classify(e: Exception) -> Verdict:
            error = translate(e, where)
            return error if isinstance(error, WeightcacheError) else str(error)

        advice = "check that the storage account is reachable"
        return retrying(where, attempt, classify, self._retries, advice)


class AzureBlob:
    """One blob of a container (a BlobSource), read by ranged GETs of CHUNK bytes on
    fsspec's loop thread. Azure's 503 ServerBusy and 429 lower the concurrency (AIMD)."""

    kind = "origin"
    attempts: int | None = None
    throttles = True

    def __init__(self, fs: Any, blob_client: Any, where: str) -> None:
        self._fs, self._client, self._where = fs, blob_client, where

    @property
    def where(self) -> str:
        return self._where

    @contextlib.contextmanager
    def open_range(self, start: int, end: int, size: int, timeout: float) -> Iterator[RangeReader]:
        reader = _AzureRange(self, start, end, size, timeout)
        try:
            yield reader
        finally:
            reader.close()

    def submit(self, offset: int, length: int) -> concurrent.futures.Future[tuple[bytes, int]]:
        return _submit(self._fs, _get(self._client, offset, length))


class _AzureRange:
    """[start, end) of an AzureBlob: one chunk in flight while the caller copies the
    previous one; `readinto` blocks at most `timeout` seconds, waiting for a chunk."""

    def __init__(self, blob: AzureBlob, start: int, end: int, size: int, timeout: float):
        self._blob, self._size, self._timeout = blob, size, timeout
        self._next, self._end = start, end
        self._chunk = memoryview(b"")
        self._pending: deque[tuple[int, concurrent.futures.Future[tuple[bytes, int]]]] = deque()
        self._request()

    def readinto(self, buf: memoryview) -> int:
        if not self._chunk:
            if not self._pending:
                return 0
            self._chunk = memoryview(self._wait(*self._pending.popleft()))
            self._request()
        n = min(len(buf), len(self._chunk))
        buf[:n] = self._chunk[:n]
        self._chunk = self._chunk[n:]
        return n

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()

    def _request(self) -> None:
        if self._next < self._end:
            length = min(CHUNK, self._end - self._next)
            self._pending.append((length, self._blob.submit(self._next, length)))
            self._next += length

    def _wait(self, length: int, future: concurrent.futures.Future[tuple[bytes, int]]) -> bytes:
        where = self._blob.where
        try:
            data, total = future.result(self._timeout)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise RetryRange(f"no answer from {where} in {self._timeout:.0f}s") from e
        except Exception as e:
            raise translate(e, f"GET {where}") from e
        if total not in (self._size, -1):
            raise IntegrityError(
                f"{where} is {total} bytes now but was {self._size} when listed; the blob "
                "changed during the fetch, run it again"
            )
        if len(data) != length:  # the next chunk starts at a fixed offset: no holes
            raise RetryRange(f"{where}: {len(data)} bytes of a {length}-byte range")
        return data
