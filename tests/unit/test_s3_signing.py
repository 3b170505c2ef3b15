"""The control plane's own SigV4 signing (weightcache.transfer.backends.s3.sigv4): the URLs it
presigns
are botocore's, byte for byte in every signed part, and it is used only where botocore
would have used the same static credentials."""

from __future__ import annotations

import datetime as dt
import urllib.parse
from pathlib import Path

import pytest

from weightcache.errors import UsageError
from weightcache.transfer.backends.s3.sigv4 import SigV4, check_credentials, static_signer

NOW = dt.datetime(2026, 12, 1, 3, 4, 5, tzinfo=dt.UTC)
KEY, SECRET = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"


def botocore_url(
    monkeypatch: pytest.MonkeyPatch,
    endpoint: str,
    bucket: str,
    key: str,
    token: str | None,
    region: str,
) -> str:
    """What the boto3 client the origin builds otherwise presigns, at NOW."""
    import botocore.auth
    import botocore.config
    import botocore.session
    from botocore.compat import HAS_CRT

    def frozen(remove_tzinfo: bool = True) -> dt.datetime:
        return NOW.replace(tzinfo=None) if remove_tzinfo else NOW

    monkeypatch.setattr(botocore.auth, "get_current_datetime", frozen)
    if HAS_CRT:  # awscrt (a dependency) makes botocore sign with the CRT's signers
        import botocore.crt.auth

        monkeypatch.setattr(botocore.crt.auth, "get_current_datetime", frozen)
    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        aws_session_token=token,
        config=botocore.config.Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )
    url: str = client.generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600
    )
    return url


def parsed(url: str) -> tuple[str, str, str, dict[str, list[str]]]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.netloc, parts.path, urllib.parse.parse_qs(parts.query)


@pytest.mark.parametrize(
    ("endpoint", "key", "token", "region"),
    [
        ("http://127.0.0.1:8333", "m/r1/model-00001-of-00004.safetensors", None, "us-east-1"),
        ("https://s3.example.com", "m/r 1/ü+&=~x.bin", "FQoGZXIvYXdzE/tok+en=~", "eu-west-3"),
        ("http://store.local:80/base", "a/b/c (copy).json", None, "us-east-1"),
    ],
)
def test_presigned_urls_are_botocores(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, key: str, token: str | None, region: str
) -> None:
    from weightcache.transfer.backends.s3.transport import object_url

    env = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": region}
    if token:
        env["AWS_SESSION_TOKEN"] = token
    signer = static_signer(endpoint, env)
    assert signer == SigV4(KEY, SECRET, token, region)
    ours = signer.presign(object_url(endpoint, "models", key), {}, NOW)
    assert parsed(ours) == parsed(botocore_url(monkeypatch, endpoint, "models", key, token, region))


def test_query_parameters_are_signed_as_botocore_signs_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listing's parameters are part of the signature: a changed one no longer matches."""
    signer = SigV4(KEY, SECRET, None, "us-east-1")
    query = {"list-type": "2", "prefix": "m/r 1/", "encoding-type": "url"}
    one = parsed(signer.presign("http://h:1/models", query, NOW))[3]
    other = parsed(signer.presign("http://h:1/models", {**query, "prefix": "m/r 2/"}, NOW))[3]
    assert one["prefix"] == ["m/r 1/"] and one["list-type"] == ["2"]
    assert one["X-Amz-Signature"] != other["X-Amz-Signature"]


@pytest.mark.parametrize(
    ("endpoint", "env", "config_exists", "expected"),
    [
        ("http://s:1", {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}, False,
         SigV4("a", "s", None, "us-east-1")),
        ("http://s:1", {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s",
                        "AWS_DEFAULT_REGION": "eu-north-1", "AWS_SESSION_TOKEN": "t"}, True,
         SigV4("a", "s", "t", "eu-north-1")),
        # AWS's own endpoints: botocore's endpoint rules decide the URL.
        (None, {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}, False, None),
        # Credentials from files, web identity, instance metadata: botocore's chain.
        ("http://s:1", {"AWS_ROLE_ARN": "r", "AWS_WEB_IDENTITY_TOKEN_FILE": "/t"}, False, None),
        ("http://s:1", {"AWS_ACCESS_KEY_ID": "a"}, False, None),
        ("http://s:1", {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s",
                        "AWS_CREDENTIAL_EXPIRATION": "2026-12-01T04:00:00Z"}, False, None),
        # A shared config's profile may name the region the signature must carry.
        ("http://s:1", {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}, True, None),
        ("store:9000", {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s"}, False, None),
    ],
)  # fmt: skip
def test_the_signed_path_is_taken_only_where_botocore_would_sign_the_same(
    tmp_path: Path, endpoint: str | None, env: dict[str, str], config_exists: bool,
    expected: SigV4 | None,
) -> None:  # fmt: skip
    config = tmp_path / "config"
    if config_exists:
        config.write_text("[default]\nregion = ap-south-1\n")
    assert static_signer(endpoint, {**env, "AWS_CONFIG_FILE": str(config)}) == expected


class _ClosingStore:
    """An HTTP server on loopback that answers each request with `body`, keep-alive, and
    then closes the connection without saying so (as a store does with an idle one)."""

    def __init__(self, body: bytes) -> None:
        import socket
        import threading

        self.body, self.requests = body, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if b"\r\n\r\n" in conn.recv(65536):
                    self.requests += 1
                    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(self.body)}\r\n\r\n"
                    conn.sendall(head.encode() + self.body)


def test_a_keep_alive_connection_the_store_closed_is_replaced_without_an_attempt(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """botocore's pool reconnects silently; so must the signed path: no backoff, no
    'attempt 1/N failed' warning for a connection the store closed while idle."""
    from weightcache.config import OriginSettings
    from weightcache.transfer.backends.s3.client import Origin

    store = _ClosingStore(b"sha256  file\n")
    for name, value in {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    origin = Origin(OriginSettings(endpoint_url=store.url))
    try:
        for _ in range(3):
            assert origin.get_bytes("models", "m/r/SHA256SUMS") == b"sha256  file\n"
    finally:
        store.sock.close()
    assert store.requests == 3
    assert not [r for r in caplog.records if "attempt" in r.getMessage()], caplog.text


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG\n"),  # a Secret made from `echo`
        ("AWS_ACCESS_KEY_ID", " AKIDEXAMPLE"),
        ("AWS_SESSION_TOKEN", "tok\ten"),
    ],
)
def test_credentials_with_a_line_break_or_space_are_refused_naming_the_variable(
    name: str, value: str
) -> None:
    good = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "wJalr/K7+MDENG"}
    check_credentials(good)
    check_credentials({**good, "AWS_SESSION_TOKEN": "IQoJb3JpZ2luX2VjE//////////wEaCXVz=="})
    with pytest.raises(UsageError, match=rf"^{name} holds a line break") as raised:
        check_credentials({**good, name: value})
    assert value.strip() not in str(raised.value)  # the secret is not printed


def test_interrupt_ends_the_pause_between_two_attempts_of_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM while a control-plane call waits to be tried again: the wait ends at once,
    Interrupted, and no other attempt is made."""
    import threading

    from tests.support.pauses import interrupted_in_pause, long_backoff
    from weightcache.config import OriginSettings
    from weightcache.errors import Interrupted
    from weightcache.transfer.backends.s3.client import Origin

    for name, value in {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    settings = OriginSettings(endpoint_url="http://127.0.0.1:9", timeout=600.0)
    origin = Origin(settings, long_backoff())
    failed = threading.Event()
    attempts: list[int] = []

    def attempt() -> None:
        attempts.append(1)
        failed.set()
        raise ConnectionResetError("reset by the store")

    raised = interrupted_in_pause(
        lambda: origin.call("LIST s3://models/m/r/", attempt), failed, origin.interrupt
    )
    assert [type(e) for e in raised] == [Interrupted] and attempts == [1]
