"""The S3 control plane: listing, small objects, uploads, presigned data-plane URLs.

boto3 owns credentials (the standard AWS chain: env, shared config, web identity / IRSA,
instance profile; `AWS_ENDPOINT_URL` works like `--endpoint-url`). Its own retries are
off: `call()` retries with the same policy as the data plane, bounded by `--timeout`, and
translates every botocore exception into a weightcache error.

A cold fetch's first GET waits for the control plane, and importing botocore and building
its S3 client cost more than the rest of the process start (design §4). So the three calls
a fetch makes (list, small GET, presign) go through a transport chosen once per Origin
(backends/s3/transport.py): signed with SigV4 and sent with http.client when the
credentials are static ones from the environment and the endpoint is given (an
S3-compatible store), exactly what botocore would pick in that case (its chain reads the
environment first), without loading it; through boto3 otherwise. Everything else
(uploads, HeadObject, GetObjectAttributes) goes through boto3, built on first use.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from weightcache.config import OriginSettings
from weightcache.errors import SourceError, TransientError
from weightcache.transfer.backends.s3.sigv4 import check_credentials, static_signer
from weightcache.transfer.backends.s3.transport import (
    BotoTransport,
    SignedTransport,
    Transport,
    store_name,
)
from weightcache.transfer.backends.s3.wire import UNSUPPORTED, translate
from weightcache.transfer.httpclient import OpenConnections
from weightcache.transfer.pacing import Backoff, Retries, Verdict, retrying

log = logging.getLogger(__name__)
T = TypeVar("T")


class Origin:
    """One S3-compatible endpoint. Thread-safe; create one per process."""

    #: Parts per GetObjectAttributes page (S3's most; an upload has at most 10,000 parts).
    parts_page = 1000

    def __init__(self, settings: OriginSettings, backoff: Backoff | None = None) -> None:
        self.settings = settings
        self._retries = Retries(settings.timeout, settings.max_attempts, backoff or Backoff())
        self.endpoint_url = settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        self._store = store_name(self.endpoint_url)
        check_credentials(os.environ)
        self._open = OpenConnections()  # the signed transport's, for interrupt()
        self._boto = BotoTransport(settings, self.endpoint_url)
        signer = static_signer(self.endpoint_url, os.environ)  # None: only botocore can tell
        self._transport: Transport = self._boto
        if signer is not None and self.endpoint_url is not None:
            self._transport = SignedTransport(
                signer, self.endpoint_url, settings.timeout, self._open
            )

    # -- the retry loop shared by every control-plane call ---------------------------------

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run fn, retrying transient failures until `--timeout` without success; every
        botocore or network error translated (`s3.wire.translate`). Raises Interrupted
        after `interrupt()`."""

        def classify(e: Exception) -> Verdict:
            error = translate(e, what)
            return str(error) if isinstance(error, TransientError) else error

        advice = f"check that {self._store} is reachable"
        return retrying(what, fn, classify, self._retries, advice, self._open.stopped)

    # -- operations ---------------------------------------------------------------------------

    def get_bytes(self, bucket: str, key: str) -> bytes:
        """A small object's content. Missing object: SourceError naming it."""
        get = partial(self._transport.get_small, bucket, key)
        return self.call(f"GET s3://{bucket}/{key}", get)

    def list_sizes(self, bucket: str, prefix: str) -> dict[str, int]:
        """{path relative to prefix: size} of every object under `prefix/`."""
        prefix = prefix.rstrip("/") + "/"

        def list_all() -> dict[str, int]:
            sizes: dict[str, int] = {}
            for key, size in self._transport.listing(bucket, prefix):
                self._listed(sizes, key, size, bucket, prefix)
            return sizes

        return self.call(f"LIST s3://{bucket}/{prefix}", list_all)

    def head_checksums(self, bucket: str, key: str) -> dict[str, str]:
        """The object's checksums as HeadObject with ChecksumMode=ENABLED returns them, and
        its ETag: {"ChecksumSHA256": base64, "ChecksumType": "FULL_OBJECT", "ETag": ...}."""

        def head() -> dict[str, str]:
            resp = self._boto.client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
            return {k: str(v) for k, v in resp.items() if k.startswith("Checksum") or k == "ETag"}

        return self.call(f"HEAD s3://{bucket}/{key}", head)

    def checksum_type(self, bucket: str, key: str) -> str | None:
        """The object's ChecksumType ("COMPOSITE" or "FULL_OBJECT") as GetObjectAttributes
        tells it, for a store whose HeadObject does not; None when it does not either, or
        the store or the credentials refuse it. Raises TransientError."""

        def attributes() -> str | None:
            resp = self._boto.client.get_object_attributes(
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
            resp = self._boto.client.get_object_attributes(
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
        resp = self._boto.client.head_object(Bucket=bucket, Key=key, PartNumber=number)
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
            lambda: self._boto.client.upload_file(str(path), bucket, key, Config=config),
        )

    def put_bytes(self, data: bytes, bucket: str, key: str) -> None:
        self.call(
            f"PUT s3://{bucket}/{key}",
            lambda: self._boto.client.put_object(Bucket=bucket, Key=key, Body=data),
        )

    def presign_get(self, bucket: str, key: str) -> str:
        """A URL for plain-HTTP ranged GETs of the data plane (valid for an hour)."""
        return self._transport.presign_get(bucket, key)

    def _listed(self, sizes: dict[str, int], key: str, size: int, bucket: str, prefix: str) -> None:
        """Add a listed object to `sizes` by its path under `prefix`; SourceError for a key
        outside the prefix (a store that ignored it) or listed twice: its path would take
        another object's place."""
        path = key[len(prefix) :]
        if not key.startswith(prefix) or path in sizes:
            why = "outside the prefix" if not key.startswith(prefix) else "twice"
            raise SourceError(
                f"{self._store} listed {key[:200]!r} {why} listing s3://{bucket}/{prefix}; "
                "its listing is broken: check the server behind --endpoint-url"
            )
        sizes[path] = size

    def interrupt(self) -> None:
        """SIGTERM: the signed transport's requests in flight end at once (their sockets
        shut down), and `call()` tries nothing more (Interrupted). A boto3 call in flight
        ends at its own read timeout."""
        self._open.interrupt()
