"""What an S3 store answers, read: its error codes and error documents as weightcache errors
(`translate`, for boto3's calls and the signed ones alike) and a ListObjectsV2 page
(`listing_page`) for the signed transport of `s3.Origin`."""

from __future__ import annotations

import http.client

from weightcache.config import is_digits
from weightcache.errors import (
    AccessDenied,
    SourceError,
    TransientError,
    UsageError,
    WeightcacheError,
)

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
#: A store's answer to a request it does not implement (some say 501 without a code);
#: compiled on use, not by every fetch.
UNSUPPORTED = r"\b(NotImplemented|501)\b"


def listing_page(body: bytes) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """A ListObjectsV2 page: (key, size) of each Contents, and the text of the result's
    other fields by name (IsTruncated, NextContinuationToken, EncodingType), whatever their
    namespace. Read with expat alone: ElementTree's import cost ~3 ms before a cold fetch's
    first GET. Raises ValueError for a body that is not such a page (not XML, another
    document such as a web page, a Size that is not ASCII digits)."""
    from xml.parsers import expat

    objects: list[tuple[str, int]] = []
    fields: dict[str, str] = {}
    obj: dict[str, str] = {}
    path: list[str] = []  # the open elements' local names
    text: list[str] = []  # the character data since the last tag
    root: list[str] = []  # the document element's local name

    def start(name: str, _: object) -> None:
        if not path:
            root.append(name.rpartition("}")[2])
        path.append(name.rpartition("}")[2])
        text.clear()

    def end(_: str) -> None:
        name = path.pop()
        if len(path) == 1 and name == "Contents":
            size = obj.get("Size", "0")
            if not is_digits(size):  # int() takes " 12", "+1", "1_0", "-1" and "١٢"
                raise ValueError(f"the Size of {obj.get('Key')!r} is {size[:40]!r}")
            objects.append((obj.get("Key", ""), int(size)))
            obj.clear()
        elif len(path) == 1:
            fields[name] = "".join(text)
        elif path[1:] == ["Contents"]:
            obj[name] = "".join(text)
        text.clear()

    parser = expat.ParserCreate(namespace_separator="}")
    parser.StartElementHandler, parser.EndElementHandler = start, end
    parser.CharacterDataHandler = text.append
    try:
        parser.Parse(body, True)
    except expat.ExpatError as e:
        raise ValueError(f"not XML: {e}") from None
    if root != ["ListBucketResult"]:  # well-formed, but another document (a web page)
        raise ValueError(f"a <{''.join(root)}> document, not ListBucketResult")
    return objects, fields


class StoreError(Exception):
    """An error response to a signed request: the signed transport's botocore ClientError."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message

    @classmethod
    def from_response(cls, status: int, body: bytes) -> StoreError:
        """The S3 error document's Code and Message, if the body is one."""
        from xml.etree import ElementTree

        try:
            root = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            return cls(status, "", "")
        return cls(status, root.findtext("{*}Code", ""), root.findtext("{*}Message", ""))


def translate(e: BaseException, what: str) -> WeightcacheError:
    """Map a botocore/urllib3/http.client exception to the weightcache error for its exit
    code (botocore is imported only for an exception no other branch knows)."""
    if isinstance(e, WeightcacheError):
        return e
    if isinstance(e, StoreError):
        return _refused(what, e.code, e.status, e.message)
    if isinstance(e, OSError | http.client.HTTPException):
        return TransientError(f"{what}: {type(e).__name__}: {e}")
    import botocore.exceptions as bx

    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return _refused(what, str(err.get("Code", "")), status, str(err.get("Message", "")))
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return UsageError(
            "no usable AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "mount a shared config, or use IRSA (web identity)"
        )
    if isinstance(e, bx.ProfileNotFound):
        return UsageError(f"{e} (AWS_PROFILE); name a profile of the AWS config, or unset it")
    if isinstance(e, bx.ConfigParseError):
        return UsageError(
            f"{e}; fix that file or unset the variable that names it (AWS_CONFIG_FILE, "
            "AWS_SHARED_CREDENTIALS_FILE)"
        )
    if isinstance(e, bx.BotoCoreError):
        return TransientError(f"{what}: {type(e).__name__}: {e}")
    if isinstance(e.__context__, bx.ClientError):  # boto3's S3UploadFailedError wraps one
        return translate(e.__context__, what)
    return WeightcacheError(f"{what}: unexpected {type(e).__name__}: {e}")


_KEYS = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or the role"
_SOURCE = "(or the AWS_PROFILE, credentials file or role that supplies the keys)"
#: The refusals that tell which half of the key pair is wrong, and where it is set.
_WRONG_KEY = {
    "InvalidAccessKeyId": f"the store knows no such access key: check AWS_ACCESS_KEY_ID {_SOURCE}",
    "SignatureDoesNotMatch": "the secret key does not match the access key: check "
    f"AWS_SECRET_ACCESS_KEY {_SOURCE}",
}


def _refused(what: str, code: str, status: int, message: str) -> WeightcacheError:
    """The error for the store's refusal (its S3 error code and HTTP status)."""
    if code in _TRANSIENT_CODES or status >= 500 or status == 429:
        return TransientError(f"{what}: {code or status} from the object store")
    if code in _DENIED_CODES or status == 403:
        verb = "write to" if what.startswith("PUT") else "read"
        fix = _WRONG_KEY.get(code, f"check the credentials ({_KEYS}) and that they may {verb} "
                             "this bucket")  # fmt: skip
        return AccessDenied(f"{what}: access denied ({code or status}); {fix}")
    if code == "NoSuchBucket":
        return SourceError(f"{what}: the bucket does not exist; check the source URL")
    if code in ("NoSuchKey", "404", "NotFound") or status == 404:
        return SourceError(f"{what}: no such object; check the source URL")
    return SourceError(f"{what}: {code or status}: {message}".rstrip(": "))
