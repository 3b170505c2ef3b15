"""The two ways `Origin` (backends/s3/client.py) makes the three calls of a fetch's control
plane (list, small GET, presign), behind one interface, `Transport`, chosen once per Origin.

`SignedTransport` signs them with SigV4 (backends/s3/sigv4.py) and sends them with
http.client: for static credentials from the environment at an explicit endpoint, exactly
what botocore would do, without importing it (design §4). `BotoTransport` makes them
through boto3, whose client also serves every other call (uploads, HeadObject,
GetObjectAttributes) whichever transport lists. Each call is one attempt: `Origin`
retries it and translates its errors.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Protocol

from weightcache.config import OriginSettings
from weightcache.errors import SourceError
from weightcache.transfer.backends.s3.sigv4 import PRESIGN_SECONDS, SigV4
from weightcache.transfer.backends.s3.wire import StoreError, listing_page
from weightcache.transfer.httpclient import (
    OpenConnections,
    ca_file,
    new_connection,
    read_small_body,
    too_large,
)
from weightcache.transfer.sources import SMALL_BODY_MAX

#: Fields every ListObjectsV2 answer has (a page without any of them was not one).
_LISTING_FIELDS = frozenset({"Name", "IsTruncated", "KeyCount", "Contents"})
#: Truncated listing pages without a key, in a row, before the listing is called endless
#: (a store handing out a new token on every empty page paged 663 times in 30 s).
MAX_EMPTY_PAGES = 10


class Transport(Protocol):
    """The control-plane calls a fetch makes, one attempt each."""

    def get_small(self, bucket: str, key: str) -> bytes:
        """A small object's content; TransientError (`too_large`) past SMALL_BODY_MAX."""
        ...

    def listing(self, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every object under `prefix`, page after page; SourceError for an
        answer that is not a listing."""
        ...

    def presign_get(self, bucket: str, key: str) -> str:
        """A URL for plain-HTTP ranged GETs of the object (valid PRESIGN_SECONDS)."""
        ...


def store_name(endpoint_url: str | None) -> str:
    """The store as messages name it."""
    return f"the store at {endpoint_url}" if endpoint_url else "the store"


def not_a_listing(store: str, bucket: str, prefix: str, why: str) -> SourceError:
    return SourceError(
        f"{store} answered the listing of s3://{bucket}/{prefix} with something "
        f"that is not ListObjectsV2 XML ({why}); check that --endpoint-url points at an "
        "S3 store"
    )


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


class BotoTransport:
    """The calls through boto3 (credentials from its whole chain, AWS's endpoint rules).
    Its retries are off: `Origin.call()` retries. Thread-safe."""

    def __init__(self, settings: OriginSettings, endpoint_url: str | None) -> None:
        self._settings, self._endpoint_url = settings, endpoint_url
        self._store = store_name(endpoint_url)
        self._lock = threading.Lock()
        self._built: Any = None

    @property
    def client(self) -> Any:
        """The boto3 S3 client, built on first use (tens of ms of imports and models)."""
        with self._lock:
            if self._built is None:
                self._built = self._build()
            return self._built

    def _build(self) -> Any:
        import boto3
        import botocore.config

        settings = self._settings
        session = boto3.session.Session()
        config = botocore.config.Config(
            retries={"total_max_attempts": 1},  # call() retries, with our policy and budget
            connect_timeout=min(settings.timeout, 10.0),
            read_timeout=min(settings.timeout, 60.0),
            max_pool_connections=max(10, settings.max_concurrency),
            signature_version="s3v4",
            s3={"addressing_style": "path"} if self._endpoint_url else {},
        )
        client = session.client(
            "s3",
            endpoint_url=self._endpoint_url,
            region_name=session.region_name or "us-east-1",
            config=config,
        )
        return without_expect_continue(client)

    def get_small(self, bucket: str, key: str) -> bytes:
        answer = self.client.get_object(Bucket=bucket, Key=key)
        body: bytes = answer["Body"].read(SMALL_BODY_MAX + 1)
        if answer.get("ContentLength", 0) > SMALL_BODY_MAX or len(body) > SMALL_BODY_MAX:
            answer["Body"].close()
            raise too_large(f"GET s3://{bucket}/{key}")
        return body

    def listing(self, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            if not page.keys() & _LISTING_FIELDS:  # botocore reads a web page as {}
                raise not_a_listing(self._store, bucket, prefix, "no ListBucketResult fields")
            for obj in page.get("Contents", []):
                yield obj["Key"], int(obj["Size"])

    def presign_get(self, bucket: str, key: str) -> str:
        url: str = self.client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=PRESIGN_SECONDS
        )
        return url


def object_url(endpoint_url: str, bucket: str, key: str = "") -> str:
    """Path-style URL of a bucket, or of an object in it (as botocore's with an endpoint)."""
    url = f"{endpoint_url.rstrip('/')}/{bucket}"
    return f"{url}/{urllib.parse.quote(key, safe='/~')}" if key else url


class SignedTransport:
    """The calls signed here and sent with http.client, on one keep-alive connection per
    thread to the endpoint; each connection joins `connections`, which `Origin.interrupt()`
    shuts down."""

    def __init__(
        self, signer: SigV4, endpoint_url: str, timeout: float, connections: OpenConnections
    ) -> None:
        self._signer, self._endpoint_url = signer, endpoint_url
        self._store = store_name(endpoint_url)
        self._timeout = min(timeout, 60.0)
        self._open = connections
        self._local = threading.local()

    def get_small(self, bucket: str, key: str) -> bytes:
        return self._get(bucket, key, {})

    def listing(self, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:
        """Paging through ListObjectsV2 as botocore does."""
        query = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
        tokens: set[str] = set()
        empty = 0  # truncated pages without a key, in a row
        while True:
            objects, fields = self._page(bucket, query)
            encoded = fields.get("EncodingType") == "url"
            for key, size in objects:
                yield (urllib.parse.unquote_plus(key) if encoded else key), size
            token = fields.get("NextContinuationToken")
            if fields.get("IsTruncated") != "true" or not token:
                return
            empty = 0 if objects else empty + 1
            if token in tokens or empty > MAX_EMPTY_PAGES:  # a broken store's endless listing
                raise SourceError(
                    f"{self._store} sent the same continuation token twice, or "
                    f"{MAX_EMPTY_PAGES} pages without a key that said more follow, listing "
                    f"s3://{bucket}/{prefix}; its listing is broken: check the server behind "
                    "--endpoint-url"
                )
            tokens.add(token)
            query = {**query, "continuation-token": token}

    def presign_get(self, bucket: str, key: str) -> str:
        return self._presign(bucket, key, {})

    def _presign(self, bucket: str, key: str, query: dict[str, str]) -> str:
        return self._signer.presign(
            object_url(self._endpoint_url, bucket, key), query, datetime.now(UTC)
        )

    def _page(
        self, bucket: str, query: dict[str, str]
    ) -> tuple[list[tuple[str, int]], dict[str, str]]:
        """One ListObjectsV2 page; SourceError if the answer is not one."""
        body = self._get(bucket, "", query)
        try:
            return listing_page(body)
        except ValueError as e:
            raise not_a_listing(self._store, bucket, query["prefix"], str(e)) from None

    def _get(self, bucket: str, key: str, query: dict[str, str]) -> bytes:
        """GET an object (or, without key, the bucket with `query`); StoreError if refused."""
        parts = urllib.parse.urlsplit(self._presign(bucket, key, query))
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

    def _connection(self, url: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        """This thread's keep-alive connection to the endpoint."""
        self._open.check()
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        conn = new_connection(url.scheme, url.netloc, self._timeout, ca_file("AWS_CA_BUNDLE"))
        self._open.add(conn)
        self._local.conn = conn
        return conn
