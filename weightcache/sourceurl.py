"""Source URLs: what a model revision's URL names (`Source`) and the prefixes the node
daemon may fetch under for Pods (`SourcePrefix`, `--allow-source`), parsed and refused here
by one set of rules for every scheme (s3://, gs://, az://, abfs://, http(s)://, file://
and plain paths, hf://). Design §4, Revision sources.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightcache.errors import UsageError

#: The schemes a source may have; a plain absolute path is a `file://` source.
SCHEMES = ("s3", "file", "gs", "az", "abfs", "hf", "http", "https")
_S3 = r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])"
#: A GCS bucket name: 3-63 characters, or up to 222 in dotted (domain) names.
_GS = r"gs://([a-z0-9][a-z0-9._\-]{1,220}[a-z0-9])"
# Azure: a container name (3-63 of a-z 0-9 -, no "--"), abfs:// with its account's host.
_CONTAINER = r"[a-z0-9](?:[a-z0-9]|-(?!-)){1,61}[a-z0-9]"
_AZURE = (
    ("az", rf"az://({_CONTAINER})"),
    ("abfs", rf"abfs://({_CONTAINER}@[a-z0-9]{{3,24}}\.dfs\.core\.windows\.net)"),
)
#: http(s)://host[:port]: no user:password@ (a marker would record it), no query, no fragment.
_HTTP = r"(https?)://([A-Za-z0-9.\-]+(?::\d{1,5})?|\[[0-9A-Fa-f:.]+\](?::\d{1,5})?)(/[^?#]*)?"
_SOURCE_FORMS = (
    "s3://bucket/prefix/<name>/<revision>, gs://bucket/prefix/<name>/<revision>, "
    "az://container/prefix/<name>/<revision>, "
    "abfs://container@account.dfs.core.windows.net/prefix/<name>/<revision>, "
    "https://host/path/<name>/<revision>, file:///path/<name>/<revision>, "
    "/path/<name>/<revision> or hf://org/repo@revision"
)
# Patterns used only by some commands or sources are kept as text and compiled on first
# use (re caches them): compiling them all at import delayed every fetch (design §4).
#: A Hub repository's owner or name (the Hub's own rule: letters, digits, . _ -, not
#: starting or ending with . or -, no `--` or `..`).
_HUB_PART = r"(?!.*(--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
#: A full git commit id: the only Hub revision that names one content for good.
HUB_COMMIT = r"[0-9a-f]{40}"


def _split_source(text: str) -> tuple[str, str, str] | None:
    """(scheme, bucket, path) of a source or prefix URL, or None if it is none of the forms;
    the path is "" or starts with "/". A `file://` URL and a plain absolute path are the
    same source, of bucket "". The callers split the path and refuse bad segments."""
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", scheme):  # RFC 3986: any case
        text = scheme.lower() + sep + rest
    m = re.fullmatch(_S3 + r"(/.*)?", text)
    if m is not None:
        return "s3", m.group(1), m.group(2) or ""
    m = re.fullmatch(_GS + r"(/.*)?", text)
    if m is not None:
        return "gs", m.group(1), m.group(2) or ""
    for scheme, pattern in _AZURE:
        m = re.fullmatch(pattern + r"(/.*)?", text)
        if m is not None:
            return scheme, m.group(1), m.group(2) or ""
    if text.startswith("hf://"):
        return "hf", "", "/" + text[len("hf://") :]
    m = re.fullmatch(_HTTP, text)
    if m is not None:  # the host (and port) is the bucket
        return m.group(1), m.group(2).lower(), m.group(3) or ""
    if text.startswith("file://"):
        text = text[len("file://") :]  # file://host/... has no leading slash: refused below
    if not text.startswith("/"):
        return None
    return "file", "", text


def _what_is_wrong(url: str, split: tuple[str, str, str] | None, segments: list[str]) -> str:
    """What makes `url` no source, in words (Source.parse refused it)."""
    if split is None:
        scheme = url.strip().partition("://")[0].lower() if "://" in url else ""
        extra = _url_extras(scheme, url.strip().partition("://")[2])
        if extra is not None:
            return extra
        if scheme in ("s3", "gs", "az", "abfs"):
            bucket = url.partition("://")[2].partition("/")[0]
            return (f"{bucket!r} is no valid {scheme}:// bucket or container name (at least "
                    "3 characters: lowercase letters, digits, dots, hyphens)")  # fmt: skip
        return f"unknown scheme {scheme!r}" if scheme else "no scheme and not an absolute path"
    if _bad_segment(segments) and segments != [""]:
        return "an empty, '.' or '..' path segment"
    return "it does not end in <name>/<revision>"


#: Where each scheme takes its credentials from, for a URL that carries them.
_CREDENTIALS = {
    "http": "put a bearer token in WEIGHTCACHE_HTTP_TOKEN",
    "https": "put a bearer token in WEIGHTCACHE_HTTP_TOKEN",
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile or a role) give them",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS (or the node's service account) gives them",
    "az": "AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or an identity give them",
}


def _url_extras(scheme: str, rest: str) -> str | None:
    """What a URL carries that no source takes (user info, a query, a fragment), in words,
    or None. Credentials would be recorded in markers and logs; a query or fragment names
    no directory of files."""
    authority = rest.partition("/")[0]
    if "@" in authority and scheme in _CREDENTIALS:
        return f"credentials in the URL are not taken: {_CREDENTIALS[scheme]}"
    if scheme not in ("http", "https", "hf"):
        return None  # an object key or a path may hold ? and #
    if "?" in rest:
        return ("a query (?...) is not taken: give the revision's URL alone, and access in "
                "the environment (WEIGHTCACHE_HTTP_TOKEN, HF_TOKEN)")  # fmt: skip
    if "#" in rest:
        return "a fragment (#...) is not taken: give the revision's URL alone"
    return None


def _bad_segment(segments: list[str] | tuple[str, ...]) -> bool:
    return any(s in ("", ".", "..") or "\0" in s for s in segments)


@dataclass(frozen=True)
class Source:
    """A model revision at its origin: s3://bucket/prefix/<name>/<revision> (gs:// alike),
    an Azure container's az://container/... or abfs://container@account.dfs.core.windows.net/...
    (bucket: the part before the first slash), http(s)://host[:port]/path/<name>/<revision>
    (bucket the host and port, lowercased), a directory on a mounted filesystem,
    file:///path/<name>/<revision> (bucket "", `prefix` the path without its leading
    slash), or a model repository of the Hugging Face Hub, hf://org/repo@revision (bucket
    "", `prefix` the repo id, name `org--repo`, revision the branch, tag or commit:
    `resolve` pins it to its commit before the cache is looked at). Design §4, Revision
    sources."""

    bucket: str
    prefix: str  # key prefix (or path) of the revision, no leading or trailing slash
    name: str
    revision: str
    scheme: str = "s3"

    @classmethod
    def parse(cls, url: str, name: str | None = None, revision: str | None = None) -> Source:
        """Raises UsageError for anything but the forms above, for a path with an
        empty, `.` or `..` segment (the same rules for every scheme), and for a `name` or
        `revision` given empty: None takes the URL's segment, "" is refused, not read as
        None (an unset variable, a Pod's request, would name another revision)."""
        for what, value in (("model name", name), ("revision", revision)):
            if value is not None and not value.strip():
                raise UsageError(f"the {what} is empty; give one, or none to take the URL's")
        split = _split_source(url)
        if split is not None and split[0] == "hf":
            return cls._parse_hub(url, split[2][1:], name, revision)
        segments = split[2][1:].rstrip("/").split("/") if split else []
        if split is None or len(segments) < 2 or _bad_segment(segments):
            why = _what_is_wrong(url, split, segments)
            raise UsageError(f"invalid source {url!r}: {why}; expected {_SOURCE_FORMS}")
        return cls(
            bucket=split[1],
            prefix="/".join(segments),
            name=name or segments[-2],
            revision=revision or segments[-1],
            scheme=split[0],
        )

    @classmethod
    def _parse_hub(cls, url: str, path: str, name: str | None, revision: str | None) -> Source:
        """hf://org/repo[@revision]: the revision is `revision`, else the URL's, else main."""
        extra = _url_extras("hf", path)
        if extra is not None:
            raise UsageError(f"invalid source {url!r}: {extra}; expected hf://org/repo@revision")
        repo, _, ref = path.partition("@")
        parts = repo.rstrip("/").split("/")
        ref = revision or ref or "main"
        if len(parts) != 2 or not all(re.fullmatch(_HUB_PART, p) for p in parts) or (
            not ref.isprintable() or " " in ref or ".." in ref.split("/")
        ):  # fmt: skip
            raise UsageError(
                f"invalid source {url!r}: expected hf://org/repo@revision (a branch, a tag or "
                "a commit; main if omitted), such as hf://Qwen/Qwen3-8B@main"
            )
        return cls("", "/".join(parts), name or "--".join(parts), ref, "hf")

    @property
    def pinned(self) -> bool:
        """Whether the revision names one content for good: always, except an hf:// branch
        or tag (a full commit id is pinned), which `fetch.revision.resolve` pins."""
        return self.scheme != "hf" or re.fullmatch(HUB_COMMIT, self.revision) is not None

    @property
    def url(self) -> str:
        """The canonical URL (what markers record): a plain path reads as file:///path."""
        if self.scheme == "hf":
            return f"hf://{self.prefix}@{self.revision}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}"

    @property
    def label(self) -> str:
        return f"{self.name}/{self.revision}"

    def key(self, relpath: str) -> str:
        return f"{self.prefix}/{relpath}"


@dataclass(frozen=True, order=True)
class SourcePrefix:
    """A bucket and key prefix (or a directory) the node daemon may fetch under for Pods
    (`--allow-source`).

    Matching is by scheme and whole path segments: s3://models/team covers
    s3://models/team/llama/v1, never s3://models/teamB/llama/v1 nor file:///models/team/...
    (design §5, who may ask: else the socket is a confused deputy).
    """

    bucket: str
    segments: tuple[str, ...] = ()  # () covers the whole bucket
    scheme: str = "s3"

    @classmethod
    def parse(cls, text: str, what: str = "--allow-source") -> SourcePrefix:
        """`s3://bucket`, `s3://bucket/a/b/` (gs:// alike), `file:///mnt/models`, `/mnt/models`,
        `https://host[:port]/a/b` (a whole host: `https://host`), `az://container/a`,
        `hf://org` or `hf://org/repo` (every revision). Raises UsageError; a file prefix
        must name a directory below the root."""
        split = _split_source(str(text))
        segments = tuple(split[2].strip("/").split("/")) if split else ()
        if segments == ("",) and split and split[0] != "file":
            segments = ()
        hub_bad = bool(split and split[0] == "hf" and (len(segments) > 2 or "@" in text))
        if split is None or _bad_segment(segments) or hub_bad:
            raise UsageError(
                f"invalid {what} {text!r}: expected s3://bucket or s3://bucket/prefix, "
                "gs://bucket/prefix, az://container/prefix, https://host/path, "
                "file:///directory, or hf://org or hf://org/repo, such as s3://models/team-a, "
                "file:///mnt/models, https://models.example.com/team-a or hf://Qwen"
            )
        return cls(split[1], segments, split[0])

    @classmethod
    def parent_of(cls, source: Source) -> SourcePrefix:
        """The source URL without its last segment: every revision of a listed model (an
        hf:// source's repository)."""
        keep = None if source.scheme == "hf" else -1
        return cls(source.bucket, tuple(source.prefix.split("/"))[:keep], source.scheme)

    def covers(self, source: Source) -> bool:
        parts = tuple(source.prefix.split("/"))
        return (source.scheme, source.bucket) == (self.scheme, self.bucket) and parts[
            : len(self.segments)
        ] == self.segments

    def __str__(self) -> str:
        if self.scheme == "hf":
            return "hf://" + "/".join(self.segments)
        return "/".join((f"{self.scheme}://{self.bucket}", *self.segments))


def parse_allow_sources(
    values: tuple[str, ...], what: str = "--allow-source"
) -> tuple[SourcePrefix, ...] | None:
    """The daemon's `--allow-source` values; None when none is given (the default then
    comes from the models file). Raises UsageError."""
    if not values:
        return None
    return tuple(sorted({SourcePrefix.parse(v, what) for v in values}))
