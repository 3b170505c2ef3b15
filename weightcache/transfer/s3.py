"""The S3 control plane (boto3): listing, small objects, uploads, presigned data-plane URLs.

boto3 owns credentials (the standard AWS chain: env, shared config, web identity / IRSA,
instance profile; `AWS_ENDPOINT_URL` works like `--endpoint-url`). Its own retries are
off: `call()` retries with the same policy as the data plane, bounded by `--timeout`, and
translates every botocore exception into a weightcache error.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from weightcache.config import OriginSettings
from weightcache.errors import SourceError, TransientError, UsageError, WeightcacheError
from weightcache.transfer.pacing import Backoff

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Error codes that mean "slow down": they count as throttling and lower concurrency.
THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestThrottled",
    }
)
_TRANSIENT_CODES = THROTTLE_CODES | {
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeTooSkewed",
}
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AllAccessDisabled",
    }
)
PRESIGN_SECONDS = 3600


class Origin:
    """One S3-compatible endpoint. Thread-safe; create one per process."""

    def __init__(self, settings: OriginSettings, backoff: Backoff | None = None) -> None:
        import boto3
        import botocore.config

        self.settings = settings
        self._backoff = backoff or Backoff()
        session = boto3.session.Session()
        self.endpoint_url = settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        config = botocore.config.Config(
            retries={"total_max_attempts": 1},  # call() retries, with our policy and budget
            connect_timeout=min(settings.timeout, 10.0),
            read_timeout=min(settings.timeout, 60.0),
            max_pool_connections=max(10, settings.max_concurrency),
            signature_version="s3v4",
            s3={"addressing_style": "path"} if self.endpoint_url else {},
        )
        self._client = session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=session.region_name or "us-east-1",
            config=config,
        )

    # -- the retry loop shared by every control-plane call ---------------------------------

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run fn, retrying transient failures until `--timeout` without success."""
        start = time.monotonic()
        deadline = start + self.settings.timeout
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as e:
                error = translate(e, what)
                if not isinstance(error, TransientError):
                    raise error from e
                delay = self._backoff.delay(attempt)
                if attempt >= self.settings.max_attempts or time.monotonic() + delay > deadline:
                    raise TransientError(
                        f"{what} failed {attempt} times in {time.monotonic() - start:.0f}s, "
                        f"last: {error}; check that the object store is reachable"
                    ) from e
                log.warning(
                    "%s: attempt %d/%d failed (%s); retrying in %.1fs",
                    what,
                    attempt,
                    self.settings.max_attempts,
                    error,
                    delay,
                )
                time.sleep(delay)

    # -- operations ---------------------------------------------------------------------------

    def get_bytes(self, bucket: str, key: str) -> bytes:
        """A small object's content. Missing object: SourceError naming it."""
        url = f"s3://{bucket}/{key}"

        def get() -> bytes:
            body: bytes = self._client.get_object(Bucket=bucket, Key=key)["Body"].read()
            return body

        return self.call(f"GET {url}", get)

    def list_sizes(self, bucket: str, prefix: str) -> dict[str, int]:
        """{path relative to prefix: size} of every object under `prefix/`."""
        prefix = prefix.rstrip("/") + "/"

        def list_all() -> dict[str, int]:
            sizes: dict[str, int] = {}
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    sizes[obj["Key"][len(prefix) :]] = int(obj["Size"])
            return sizes

        return self.call(f"LIST s3://{bucket}/{prefix}", list_all)

    def upload_file(self, path: Path, bucket: str, key: str) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_chunksize=self.settings.part_size,
            max_concurrency=self.settings.max_concurrency,
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
        url: str = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=PRESIGN_SECONDS
        )
        return url


def translate(e: BaseException, what: str) -> WeightcacheError:
    """Map a botocore/urllib3 exception to the weightcache error for its exit code."""
    import botocore.exceptions as bx

    if isinstance(e, WeightcacheError):
        return e
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return TransientError(f"{what}: {code or status} from the object store")
        if code in _DENIED_CODES or status == 403:
            return SourceError(
                f"{what}: access denied ({code or status}); check the credentials and that "
                "they may read this bucket"
            )
        if code == "NoSuchBucket":
            return SourceError(f"{what}: the bucket does not exist; check the source URL")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return SourceError(f"{what}: no such object; check the source URL")
        return SourceError(f"{what}: {code or status}: {err.get('Message', '')}".rstrip(": "))
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return UsageError(
            "no usable AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "mount a shared config, or use IRSA (web identity)"
        )
    if isinstance(e, bx.BotoCoreError | OSError):
        return TransientError(f"{what}: {type(e).__name__}: {e}")
    return WeightcacheError(f"{what}: unexpected {type(e).__name__}: {e}")
