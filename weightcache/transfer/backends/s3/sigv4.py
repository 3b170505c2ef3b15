"""AWS Signature Version 4 query signing for S3, stdlib only: the presigned URLs of the
control plane's signed transport (backends/s3/transport.py), for static credentials at an
explicit endpoint."""

from __future__ import annotations

import hashlib
import hmac
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from weightcache.errors import UsageError

PRESIGN_SECONDS = 3600
_UNRESERVED = "-_.~"  # RFC 3986: never percent-encoded in a SigV4 canonical request


@dataclass(frozen=True)
class SigV4:
    """AWS Signature Version 4 query signing (presigned URLs) for S3, stdlib only."""

    access_key: str
    secret_key: str
    token: str | None
    region: str

    def presign(self, url: str, query: Mapping[str, str], now: datetime) -> str:
        """`url` (scheme, host, percent-encoded path) with `query` and the signature
        parameters, valid PRESIGN_SECONDS from `now`, for a GET."""
        parts = urllib.parse.urlsplit(url)
        date, stamp = now.strftime("%Y%m%d"), now.strftime("%Y%m%dT%H%M%SZ")
        scope = f"{date}/{self.region}/s3/aws4_request"
        params = {
            **query,
            "X-Amz-Algorithm": "AWS4-HMAC-SHA256",
            "X-Amz-Credential": f"{self.access_key}/{scope}",
            "X-Amz-Date": stamp,
            "X-Amz-Expires": str(PRESIGN_SECONDS),
            "X-Amz-SignedHeaders": "host",
        }
        if self.token:
            params["X-Amz-Security-Token"] = self.token
        canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(params.items()))
        canonical = "\n".join(
            ["GET", parts.path or "/", canonical_query, f"host:{_host(parts)}", "", "host",
             "UNSIGNED-PAYLOAD"]
        )  # fmt: skip
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{digest}"
        signature = hmac.new(self._key(date), to_sign.encode(), hashlib.sha256).hexdigest()
        query_text = f"{canonical_query}&X-Amz-Signature={signature}"
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, query_text, ""))

    def _key(self, date: str) -> bytes:
        key = f"AWS4{self.secret_key}".encode()
        for part in (date, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        return key


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe=_UNRESERVED)


def _host(url: urllib.parse.SplitResult) -> str:
    """The Host header http.client sends: the port only when it is not the scheme's default."""
    default = {"http": 80, "https": 443}[url.scheme]
    host = url.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return host if url.port in (None, default) else f"{host}:{url.port}"


#: The environment's static credentials (botocore's chain reads them first).
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def check_credentials(env: Mapping[str, str]) -> None:
    """UsageError naming the credential variable that holds white space at an end or a
    control character: a Kubernetes Secret made from `echo key | base64` holds a line
    break, and the store's answer would be a bare signature mismatch. The value is not
    printed."""
    for name in CREDENTIAL_VARIABLES:
        value = env.get(name)
        if value and (value != value.strip() or not value.isprintable()):
            raise UsageError(
                f"{name} holds a line break, a space at one end or another control "
                "character (a Kubernetes Secret made from `echo ... | base64` ends with a "
                "line break); set it to the key alone (`printf %s ... | base64`)"
            )


def static_signer(endpoint_url: str | None, env: Mapping[str, str]) -> SigV4 | None:
    """The signer for what botocore would use at an explicit endpoint when the environment
    holds static credentials (its chain reads them first); None where only botocore can
    decide: no endpoint (AWS's endpoint rules), credentials that expire, no region in the
    environment while a shared config file (whose profile may name one) exists."""
    access_key, secret_key = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not endpoint_url or urllib.parse.urlsplit(endpoint_url).scheme not in ("http", "https"):
        return None
    if not access_key or not secret_key or env.get("AWS_CREDENTIAL_EXPIRATION"):
        return None
    region = env.get("AWS_DEFAULT_REGION")
    if not region:
        if Path(env.get("AWS_CONFIG_FILE") or "~/.aws/config").expanduser().exists():
            return None
        region = "us-east-1"
    token = env.get("AWS_SESSION_TOKEN") or env.get("AWS_SECURITY_TOKEN") or None
    return SigV4(access_key, secret_key, token, region)
