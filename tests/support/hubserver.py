"""A small Hugging Face Hub on loopback, for the hf:// tests and benchmark: the endpoints
huggingface_hub and weightcache use, with the Hub's real headers, serving repositories
made in the test (no network, no mirror of the real Hub).

- `GET /api/models/{org}/{repo}/revision/{rev}[?blobs=true]`: the model info (`sha`, the
  commit; `siblings` with `size`, `blobId` and, for an LFS file, `lfs.sha256`/`size`).
- `GET /api/models/{org}/{repo}/tree/{rev}?recursive=true`: the files (`hf download`).
- `HEAD|GET /{org}/{repo}/resolve/{rev}/{path}`: a small file is served here (ETag: its git
  blob id, Range -> 206); an LFS file answers 302 to its storage with `X-Linked-Etag` (its
  sha256), `X-Linked-Size`, and `X-Repo-Commit` as the Hub does.
- `HEAD|GET /lfs/{sha256}` on another host name (localhost rather than 127.0.0.1), the
  LFS storage: Range -> 206 with Content-Range; like a signed storage URL, it refuses a
  request that carries an Authorization header (400).

Errors as the Hub answers them: an unknown repository is 401 with `X-Error-Code:
RepoNotFound` (404 with a token), an unknown revision 404 `RevisionNotFound`, a gated one
without access 401/403 `GatedRepo`, a missing file 404 `EntryNotFound`. `throttle(n)` makes
the next n data reads (ranged GETs of either host) answer 429. `corrupt(repo, path)` serves
an LFS file with one byte flipped (its listed sha256 unchanged). `bytes_sent` counts body
bytes of data reads per path.

Mirrors that answer otherwise, per repository (`add_commit`): `blobs=False` ignores
?blobs=true (no sizes in the model info, as olah's offline mirror: its tree listing has
them; `tree=False` has no tree listing either), `main_only=True` answers main's commit
whatever revision is asked for.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

#: Files at least this big are stored in LFS unless a test says otherwise.
LFS_MIN = 10_000


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    )


@dataclass
class HubRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    lfs: dict[str, set[str]] = field(default_factory=dict)  # commit -> its LFS paths
    refs: dict[str, str] = field(default_factory=dict)
    gated_token: str | None = None  # gated: only this token may read it
    blobs: bool = True  # False: ignores ?blobs=true, as olah's mirror of a local git repo
    main_only: bool = False  # True: answers main's commit for every revision (a bad mirror)
    tree: bool = True  # False: no tree listing (404)


class HubServer:
    """The Hub on 127.0.0.1 (its LFS storage on localhost), on a free port, in a thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.repos: dict[str, HubRepo] = {}
        self.bytes_sent: collections.Counter[str] = collections.Counter()
        self._throttle = 0
        self._corrupt: set[str] = set()  # sha256 of LFS files served corrupted
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        (root / "lfs").mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- what tests set up ------------------------------------------------------------------

    def add_commit(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        branch: str = "main",
        lfs: set[str] | None = None,
        gated_token: str | None = None,
        blobs: bool = True,
        main_only: bool = False,
        tree: bool = True,
    ) -> str:
        """Commit `files` (the whole tree) to `branch` of `repo_id`; return the commit id.
        LFS holds `lfs` if given, else every file of LFS_MIN bytes or more."""
        repo = self.repos.setdefault(repo_id, HubRepo())
        repo.gated_token, repo.blobs, repo.main_only = gated_token, blobs, main_only
        repo.tree = tree
        commit = hashlib.sha1(
            json.dumps([repo_id, branch, len(repo.commits), sorted(files)]).encode()
        ).hexdigest()
        in_lfs = lfs if lfs is not None else {p for p, d in files.items() if len(d) >= LFS_MIN}
        for path in in_lfs:
            store = self.root / "lfs" / hashlib.sha256(files[path]).hexdigest()
            if not store.exists():
                store.write_bytes(files[path])
        repo.commits[commit] = dict(files)
        repo.lfs[commit] = set(in_lfs)
        repo.refs[branch] = commit
        return commit

    def throttle(self, n: int) -> None:
        with self._lock:
            self._throttle = n

    def corrupt(self, data: bytes) -> None:
        """Serve the LFS file of content `data` with one byte flipped."""
        sha = hashlib.sha256(data).hexdigest()
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0xFF
        (self.root / "lfs" / f"{sha}.corrupt").write_bytes(bytes(bad))
        self._corrupt.add(sha)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> HubServer:
        ready = threading.Event()
        self._ready = ready
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/revision/{rev:.+}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev:.+}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        app.router.add_route("*", "/lfs/{sha}", self._lfs)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.SockSite(runner, self._sock).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    # -- the endpoints ----------------------------------------------------------------------

    def _access(self, request: web.Request) -> tuple[HubRepo, str] | web.Response:
        """The repository and commit a request names, or the Hub's refusal."""
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404 if token else 401, "RepoNotFound", "Repository not found")
        if repo.gated_token is not None and token != repo.gated_token:
            return _error(403 if token else 401, "GatedRepo", "Access to model is restricted")
        rev = "main" if repo.main_only else request.match_info["rev"]
        commit = rev if rev in repo.commits else repo.refs.get(rev)
        if commit is None:
            return _error(404, "RevisionNotFound", "Invalid rev id")
        return repo, commit

    async def _info(self, request: web.Request) -> web.Response:
        found = self._access(request)
        if isinstance(found, web.Response):
            return found
        repo, commit = found
        blobs = repo.blobs and request.query.get("blobs", "").lower() == "true"
        siblings = [self._sibling(repo, commit, p, blobs) for p in sorted(repo.commits[commit])]
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        body = {"_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit,
                "private": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "gated": "auto" if repo.gated_token else False, "siblings": siblings,
                "lastModified": "2026-01-01T00:00:00.000Z"}  # fmt: skip
        return web.json_response(body)

    async def _tree(self, request: web.Request) -> web.Response:
        """The files of the revision, recursively (what `hf download` lists)."""
        found = self._access(request)
        if isinstance(found, web.Response):
            return found
        repo, commit = found
        if not repo.tree:
            return web.Response(status=404, text="Not Found")
        entries = []
        for path in sorted(repo.commits[commit]):
            s = self._sibling(repo, commit, path, True)
            entry = {"type": "file", "oid": s["blobId"], "size": s["size"], "path": path}
            if "lfs" in s:
                entry["lfs"] = {"oid": s["lfs"]["sha256"], "size": s["size"],
                                "pointerSize": s["lfs"]["pointerSize"]}  # fmt: skip
            entries.append(entry)
        return web.json_response(entries)

    def _sibling(self, repo: HubRepo, commit: str, path: str, blobs: bool) -> dict[str, Any]:
        if not blobs:
            return {"rfilename": path}
        data = repo.commits[commit][path]
        if path not in repo.lfs[commit]:
            return {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
        sha = hashlib.sha256(data).hexdigest()
        pointer = lfs_pointer(sha, len(data))
        return {"rfilename": path, "size": len(data), "blobId": git_blob_id(pointer),
                "lfs": {"sha256": sha, "size": len(data), "pointerSize": len(pointer)}}  # fmt: skip

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        found = self._access(request)
        if isinstance(found, web.Response):
            return found
        repo, commit = found
        path = request.match_info["path"]
        data = repo.commits[commit].get(path)
        if data is None:
            return _error(404, "EntryNotFound", "Entry not found")
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if path in repo.lfs[commit]:
            sha = hashlib.sha256(data).hexdigest()
            headers.update({
                "ETag": f'"{git_blob_id(lfs_pointer(sha, len(data)))}"',
                "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                "Location": f"http://localhost:{self.port}/lfs/{sha}?X-Amz-Signature=t",
            })  # fmt: skip
            return web.Response(status=302, headers=headers)
        headers["ETag"] = f'"{git_blob_id(data)}"'
        return self._ranged(request, data, path, headers)

    async def _lfs(self, request: web.Request) -> web.StreamResponse:
        if "Authorization" in request.headers:
            return web.Response(status=400, text="Only one auth mechanism allowed")
        sha = request.match_info["sha"]
        name = f"{sha}.corrupt" if sha in self._corrupt else sha
        store = self.root / "lfs" / name
        if not store.exists():
            return web.Response(status=404)
        throttled = self._throttled(request)
        if throttled is not None:
            return throttled
        size = store.stat().st_size
        start, end = _range(request, size)
        if request.method == "GET":
            self.bytes_sent[sha] += end - start
        return web.FileResponse(store, headers={"ETag": f'"{sha}"'})

    def _ranged(
        self, request: web.Request, data: bytes, path: str, headers: dict[str, str]
    ) -> web.Response:
        throttled = self._throttled(request)
        if throttled is not None:
            return throttled
        start, end = _range(request, len(data))
        body = b"" if request.method == "HEAD" else data[start:end]
        if request.method == "GET":
            self.bytes_sent[path] += len(body)
        if "Range" not in request.headers:
            return web.Response(body=body, headers=headers)
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        return web.Response(status=206, body=body, headers=headers)

    def _throttled(self, request: web.Request) -> web.Response | None:
        if request.method != "GET" or "Range" not in request.headers:
            return None
        with self._lock:
            if self._throttle <= 0:
                return None
            self._throttle -= 1
        return web.Response(status=429, text="Too Many Requests", headers={"Retry-After": "0"})


def _range(request: web.Request, size: int) -> tuple[int, int]:
    """[start, end) of a `bytes=a-b` Range (the whole body without one)."""
    spec = request.headers.get("Range", "")
    if not spec.startswith("bytes="):
        return 0, size
    first, _, last = spec.removeprefix("bytes=").partition("-")
    start = int(first) if first else max(size - int(last), 0)
    end = min(int(last) + 1, size) if first and last else size
    return start, end


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response(
        {"error": message}, status=status,
        headers={"X-Error-Code": code, "X-Error-Message": message},
    )  # fmt: skip
