"""The S3 control plane: listing, small objects, uploads, presigned data-plane URLs.

boto3 owns credentials (the standard AWS chain: env, shared config, web identity / IRSA,
instance profile; `AWS_ENDPOINT_URL` works like `--endpoint-url`). Its own retries are
off: `call()` retries with the same policy as the data plane, bounded by `--timeout`, and
translates every botocore exception into a weightcache error.

A cold fetch's first GET waits for the control plane, and importing botocore and building
its S3 client cost more than the rest of the process start (design §4). So when the
credentials are static ones from the environment and the endpoint is given (an
S3-compatible store), the three calls a fetch makes (list, small GET, presign) are signed
here with SigV4 (backends/s3/sigv4.py) and sent with http.client: exactly what botocore would pick
in that case
(its chain reads the environment first), without loading it. Everything else (uploads,
other credentials, AWS's own endpoints) goes through boto3 as before, built on first use.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import threading
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from weightcache.config import OriginSettings
from weightcache.errors import SourceError, TransientError
from weightcache.transfer.backends.s3.sigv4 import PRESIGN_SECONDS, check_credentials, static_signer
from weightcache.transfer.backends.s3.wire import UNSUPPORTED, StoreError, listing_page, translate
from weightcache.transfer.httpclient import (
    OpenConnections,
    ca_file,
    new_connection,
    read_small_body,
    too_large,
)
from weightcache.transfer.pacing import Backoff, Retries, Verdict, retrying
from weightcache.transfer.sources import SMALL_BODY_MAX

log = logging.getLogger(__name__)
T = TypeVar("T")


def without_expect_continue(client: Any) -> Any:
    """Make a boto3 S3 client send uploads without `Expect: 100-continue`; returns it.

    A store may answer such a request at once, without `100 Continue` (an S3-compatible
    store does for an empty body, any store for an early refusal). botocore then keeps that
    status line and parses the next response on the same pooled connection against it: the
    response never ends, so that next call waits out the whole read timeout (60 s) and is
    sent again. The header is not signed, so dropping it changes nothing else.
    """
    client.meta.events.register("before-send.s3", _drop_expect_header)
    return client


def _drop_expect_header(request: Any, **_: Any) -> None:
    if "Expect" in request.headers:
        del request.headers["Expect"]


#: Fields every ListObjectsV2 answer has (a page without any of them was not one).
_LISTING_FIELDS = frozenset({"Name", "IsTruncated", "KeyCount", "Contents"})
#: Truncated listing pages without a key, in a row, before the listing is called endless
#: (a store handing out a new token on every empty page paged 663 times in 30 s).
MAX_EMPTY_PAGES = 10


class Origin:
    """One S3-compatible endpoint. Thread-safe; create one per process."""

    #: Parts per GetObjectAttributes page (S3's most; an upload has at most 10,000 parts).
    parts_page = 1000

    def __init__(self, settings: OriginSettings, backoff: Backoff | None = None) -> None:
        self.settings = settings
        self._retries = Retries(settings.timeout, settings.max_attempts, backoff or Backoff())
        self.endpoint_url = settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        check_credentials(os.environ)
        self._signer = static_signer(self.endpoint_url, os.environ)
        self._client_lock = threading.Lock()
        self._boto: Any = None
        self._local = threading.local()  # the signed path's connection, one per thread
        self._open = OpenConnections()  # the signed path's, for interrupt()

    @property
    def _client(self) -> Any:
        """The boto3 S3 client, built on first use (tens of ms of imports and models)."""
        with self._client_lock:
            if self._boto is None:
                self._boto = self._build_client()
            return self._boto

    def _build_client(self) -> Any:
        import boto3
        import botocore.config

        settings = self.settings
        session = boto3.session.Session()
        config = botocore.config.Config(
            retries={"total_max_attempts": 1},  # call() retries, with our policy and budget
            connect_timeout=min(settings.timeout, 10.0),
            read_timeout=min(settings.timeout, 60.0),
            max_pool_connections=max(10, settings.max_concurrency),
            signature_version="s3v4",
            s3={"addressing_style": "path"} if self.endpoint_url else {},
        )
        client = session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=session.region_name or "us-east-1",
            config=config,
        )
        return without_expect_continue(client)

    # -- the retry loop shared by every control-plane call ---------------------------------

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run fn, retrying transient failures until `--timeout` without success; every
        botocore or network error translated (`s3.wire.translate`). Raises Interrupted
        after `interrupt()`."""

        def classify(e: Exception) -> Verdict:
            error = translate(e, what)
            return str(error) if isinstance(error, TransientError) else error

        advice = f"check that {self._store()} is reachable"
        return retrying(what, fn, classify, self._retries, advice, self._open.stopped)

    # -- operations ---------------------------------------------------------------------------

    def get_bytes(self, bucket: str, key: str) -> bytes:
        """A small object's content. Missing object: SourceError naming it."""
        url = f"s3://{bucket}/{key}"

        def get() -> bytes:
            if self._signer is not None:
                return self._signed_get(bucket, key, {})
            answer = self._client.get_object(Bucket=bucket, Key=key)
            body: bytes = answer["Body"].read(SMALL_BODY_MAX + 1)
            if answer.get("ContentLength", 0) > SMALL_BODY_MAX or len(body) > SMALL_BODY_MAX:
                answer["Body"].close()
                raise too_large(f"GET {url}")
            return body

        return self.call(f"GET {url}", get)

    def list_sizes(self, bucket: str, prefix: str) -> dict[str, int]:
        """{path relative to prefix: size} of every object under `prefix/`."""
        prefix = prefix.rstrip("/") + "/"

        def list_all() -> dict[str, int]:
            if self._signer is not None:
                return self._signed_list(bucket, prefix)
            sizes: dict[str, int] = {}
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                if not page.keys() & _LISTING_FIELDS:  # botocore reads a web page as {}
                    raise self._not_a_listing(bucket, prefix, "no ListBucketResult fields")
                for obj in page.get("Contents", []):
                    self._listed(sizes, obj["Key"], int(obj["Size"]), bucket, prefix)
            return sizes

        return self.call(f"LIST s3://{bucket}/{prefix}", list_all)

    def head_checksums(self, bucket: str, key: str) -> dict[str, str]:
        """The object's checksums as HeadObject with ChecksumMode=ENABLED returns them, and
        its ETag: {"ChecksumSHA256": base64, "ChecksumType": "FULL_OBJECT", "ETag": ...}."""

        def head() -> dict[str, str]:
            resp = self._client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
            return {k: str(v) for k, v in resp.items() if k.startswith("Checksum") or k == "ETag"}

        return self.call(f"HEAD s3://{bucket}/{key}", head)

    def checksum_type(self, bucket: str, key: str) -> str | None:
        """The object's ChecksumType ("COMPOSITE" or "FULL_OBJECT") as GetObjectAttributes
        tells it, for a store whose HeadObject does not; None when it does not either, or
        the store or the credentials refuse it. Raises TransientError."""

        def attributes() -> str | None:
            resp = self._client.get_object_attributes(
                Bucket=bucket, Key=key, ObjectAttributes=["Checksum"]
            )
            kind = resp.get("Checksum", {}).get("ChecksumType")
            return str(kind) if kind else None

        return self._unless_refused(f"GetObjectAttributes s3://{bucket}/{key}", attributes)

    def listed_part_sizes(self, bucket: str, key: str, count: int) -> tuple[int, ...] | None:
        """The sizes of a multipart object's `count` parts, in order, as GetObjectAttributes
        lists them (ObjectParts, paged); None when the store or the credentials refuse it,
        or it lists other than `count` parts (then `part_size` per part may tell them).
        Raises TransientError."""
        listed = partial(self._listed_parts, bucket, key)
        sizes = self._unless_refused(f"GetObjectAttributes s3://{bucket}/{key}", listed)
        return tuple(sizes) if sizes is not None and len(sizes) == count else None

    def part_size(self, bucket: str, key: str, number: int) -> int | None:
        """The size of part `number` of a multipart object, from one HeadObject with
        PartNumber (for a store without GetObjectAttributes, or credentials without
        s3:GetObjectAttributes); None when the store refuses it. Thread-safe: callers ask
        for many parts at once. Raises TransientError."""
        head = partial(self._part_size, bucket, key, number)
        return self._unless_refused(f"HEAD part {number} of s3://{bucket}/{key}", head)

    def _unless_refused(self, what: str, fn: Callable[[], T]) -> T | None:
        """`call(what, fn)`, or None when the store refuses it as unknown, unsupported or
        not allowed (its transient failures are retried by `call`)."""

        def attempt() -> T | None:
            try:
                return fn()
            except Exception as e:
                error = translate(e, what)
                if isinstance(error, TransientError) and not re.search(UNSUPPORTED, str(error)):
                    raise
                return None

        return self.call(what, attempt)

    def _listed_parts(self, bucket: str, key: str) -> list[int] | None:
        """The part sizes GetObjectAttributes lists, every page (None: not all of them)."""
        sizes: list[int] = []
        marker = 0
        while True:
            resp = self._client.get_object_attributes(
                Bucket=bucket,
                Key=key,
                ObjectAttributes=["ObjectParts"],
                MaxParts=self.parts_page,
                PartNumberMarker=marker,
            )
            parts = resp.get("ObjectParts", {})
            for part in parts.get("Parts", []):
                if int(part["PartNumber"]) != len(sizes) + 1:
                    return None  # not every part, in order: the boundaries are unknown
                sizes.append(int(part["Size"]))
            if not parts.get("IsTruncated"):
                return sizes
            if int(parts.get("NextPartNumberMarker") or 0) <= marker:
                return None  # a page that does not move on: the rest is unknown
            marker = int(parts["NextPartNumberMarker"])

    def _part_size(self, bucket: str, key: str, number: int) -> int:
        resp = self._client.head_object(Bucket=bucket, Key=key, PartNumber=number)
        return int(resp["ContentLength"])

    def upload_file(self, path: Path, bucket: str, key: str) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_chunksize=self.settings.part_size,
            max_concurrency=self.settings.max_concurrency,
            max_bandwidth=self.settings.bwlimit,  # None: unbounded
            # awscrt (a dependency, for checksums) would otherwise switch boto3 to the CRT
            # transfer client on the EC2 GPU instance types, with other retries and limits.
            preferred_transfer_client="classic",
        )
        self.call(
            f"PUT s3://{bucket}/{key}",
            lambda: self._client.upload_file(str(path), bucket, key, Config=config),
        )

    def put_bytes(self, data: bytes, bucket: str, key: str) -> None:
        self.call(
            f"PUT s3://{bucket}/{key}",
            lambda: self._client.put_object(Bucket=bucket, Key=key, Body=data),
        )

    def presign_get(self, bucket: str, key: str) -> str:
        """A URL for plain-HTTP ranged GETs of the data plane (valid for an hour)."""
        if self._signer is not None:
            return self._signer.presign(self._object_url(bucket, key), {}, datetime.now(UTC))
        url: str = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=PRESIGN_SECONDS
        )
        return url

    # -- the signed path: static credentials, no botocore ---------------------------------

    def _object_url(self, bucket: str, key: str = "") -> str:
        """Path-style URL of a bucket, or of an object in it (as botocore's with an endpoint)."""
        assert self.endpoint_url is not None
        url = f"{self.endpoint_url.rstrip('/')}/{bucket}"
        return f"{url}/{urllib.parse.quote(key, safe='/~')}" if key else url

    def _signed_get(self, bucket: str, key: str, query: dict[str, str]) -> bytes:
        """GET an object (or, without key, the bucket with `query`); StoreError if refused."""
        assert self._signer is not None
        url = self._signer.presign(self._object_url(bucket, key), query, datetime.now(UTC))
        parts = urllib.parse.urlsplit(url)
        reused = getattr(self._local, "conn", None) is not None
        try:
            status, body = self._send(parts)
        except ConnectionError:
            if not reused:
                raise
            # The store closed our idle keep-alive connection: a new one, at once, as
            # urllib3 does for botocore (not an attempt of call()'s, with its backoff).
            status, body = self._send(parts)
        if not 200 <= status < 300:
            raise StoreError.from_response(status, body)
        return body

    def _send(self, url: urllib.parse.SplitResult) -> tuple[int, bytes]:
        conn = self._connection(url)
        try:
            conn.request("GET", f"{url.path}?{url.query}")
            resp = conn.getresponse()
            return resp.status, read_small_body(resp, f"GET {url.scheme}://{url.netloc}{url.path}")
        except BaseException:
            self._local.conn = None
            conn.close()
            raise

    def _signed_list(self, bucket: str, prefix: str) -> dict[str, int]:
        """{path relative to prefix: size}, paging through ListObjectsV2 as botocore does."""
        sizes: dict[str, int] = {}
        query = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
        tokens: set[str] = set()
        empty = 0  # truncated pages without a key, in a row
        while True:
            objects, fields = self._page(bucket, query)
            encoded = fields.get("EncodingType") == "url"
            for key, size in objects:
                key = urllib.parse.unquote_plus(key) if encoded else key
                self._listed(sizes, key, size, bucket, prefix)
            token = fields.get("NextContinuationToken")
            if fields.get("IsTruncated") != "true" or not token:
                return sizes
            empty = 0 if objects else empty + 1
            if token in tokens or empty > MAX_EMPTY_PAGES:  # a broken store's endless listing
                raise SourceError(
                    f"{self._store()} sent the same continuation token twice, or "
                    f"{MAX_EMPTY_PAGES} pages without a key that said more follow, listing "
                    f"s3://{bucket}/{prefix}; its listing is broken: check the server behind "
                    "--endpoint-url"
                )
            tokens.add(token)
            query = {**query, "continuation-token": token}

    def _listed(self, sizes: dict[str, int], key: str, size: int, bucket: str, prefix: str) -> None:
        """Add a listed object to `sizes` by its path under `prefix`; SourceError for a key
        outside the prefix (a store that ignored it) or listed twice: its path would take
        another object's place."""
        path = key[len(prefix) :]
        if not key.startswith(prefix) or path in sizes:
            why = "outside the prefix" if not key.startswith(prefix) else "twice"
            raise SourceError(
                f"{self._store()} listed {key[:200]!r} {why} listing s3://{bucket}/{prefix}; "
                "its listing is broken: check the server behind --endpoint-url"
            )
        sizes[path] = size

    def _page(
        self, bucket: str, query: dict[str, str]
    ) -> tuple[list[tuple[str, int]], dict[str, str]]:
        """One ListObjectsV2 page; SourceError if the answer is not one."""
        body = self._signed_get(bucket, "", query)
        try:
            return listing_page(body)
        except ValueError as e:
            raise self._not_a_listing(bucket, query["prefix"], str(e)) from None

    def _not_a_listing(self, bucket: str, prefix: str, why: str) -> SourceError:
        return SourceError(
            f"{self._store()} answered the listing of s3://{bucket}/{prefix} with something "
            f"that is not ListObjectsV2 XML ({why}); check that --endpoint-url points at an "
            "S3 store"
        )

    def _store(self) -> str:
        endpoint = self.endpoint_url
        return f"the store at {endpoint}" if endpoint else "the store"

    def _connection(self, url: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        """This thread's keep-alive connection to the endpoint (one host per Origin)."""
        self._open.check()
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        timeout = min(self.settings.timeout, 60.0)
        conn = new_connection(url.scheme, url.netloc, timeout, ca_file("AWS_CA_BUNDLE"))
        self._open.add(conn)
        self._local.conn = conn
        return conn

    def interrupt(self) -> None:
        """SIGTERM: the signed path's requests in flight end at once (their sockets shut
        down), and `call()` tries nothing more (Interrupted). A boto3 call in flight ends at
        its own read timeout."""
        self._open.interrupt()
