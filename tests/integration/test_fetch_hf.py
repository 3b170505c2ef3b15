"""hf://org/repo@revision (design §4, Revision sources): a Hub repository read through
huggingface_hub's metadata and ranged GETs of its files, against a small Hub on loopback
(tests/support/hubserver.py) with the Hub's own headers, redirects and errors."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CLI, Published, dead_endpoint
from tests.integration.daemon_helpers import (
    Daemons,
    daemons,  # noqa: F401 - fixture
    wait_for,
    write_models,
)
from tests.support.checks import (
    assert_blobs_valid,
    assert_fails,
    assert_revision_ok,
    blobs_dir,
    describe,
    kill9_mid_download,
    markers,
)
from tests.support.hubserver import HubServer
from tests.support.modelgen import MANIFEST, Model, make_model
from tests.support.webservers import web_page

MiB = 1024 * 1024


@pytest.fixture(scope="session")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    server = HubServer(tmp_path_factory.mktemp("hub")).start()
    yield server
    server.stop()


@pytest.fixture
def hf_env(hub: HubServer, tmp_path: Path) -> dict[str, str | None]:
    """The CLI's environment: the loopback Hub, no token, no token file of the host."""
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN": None,
            "HF_HUB_OFFLINE": None, "HUGGING_FACE_HUB_TOKEN": None}  # fmt: skip


def _repo(hub: HubServer, uniq: str, model: Model, **kwargs: object) -> tuple[str, str]:
    """Commit the model's files to org/<uniq> on the Hub; (repo id, commit)."""
    repo_id = f"org/{re.sub('-+', '-', uniq)}"  # the Hub refuses `--` in a name
    files = {p.relative_to(model.root).as_posix(): p.read_bytes()
             for p in model.root.rglob("*") if p.is_file()}  # fmt: skip
    return repo_id, hub.add_commit(repo_id, files, **kwargs)  # type: ignore[arg-type]


def _lfs_model(tmp_path: Path, sizes: list[int], seed: int | str = 0) -> Model:
    """Shards only, no SHA256SUMS: every file in LFS, vouched for by its sha256."""
    root = tmp_path / "hub-src" / str(seed)
    return make_model(root, sizes, small_files=False, manifest=False, seed=seed)


def _fetch_json(
    wc: CLI, source: str, cache_dir: Path, env: dict[str, str | None], *extra: str
) -> dict[str, object]:
    proc = wc.fetch(source, cache_dir, "--no-daemon", "--json", *extra, env=env)
    assert proc.returncode == 0, describe(proc)
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_miss_then_hit_and_a_commit_is_a_hit_without_the_hub(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    model = _lfs_model(tmp_path, [3 * MiB, 1 * MiB, 20_000])
    repo_id, commit = _repo(hub, uniq, model)
    name = repo_id.replace("/", "--")
    first = _fetch_json(wc, f"hf://{repo_id}@main", cache_dir, hf_env, "--part-size", "256K")
    assert first["hit"] is False and first["bytes_from_origin"] == model.total_size, first
    assert first["path"] == str(cache_dir / name / commit)
    assert_revision_ok(cache_dir, name, commit, model)
    marker = json.loads((cache_dir / name / commit / ".weightcache").read_text())
    assert marker["source"] == f"hf://{repo_id}@{commit}"
    again = _fetch_json(wc, f"hf://{repo_id}", cache_dir, hf_env)  # main by default
    assert again["hit"] is True and again["path"] == first["path"], again
    offline = {**hf_env, "HF_ENDPOINT": dead_endpoint()}
    pinned = _fetch_json(wc, f"hf://{repo_id}@{commit}", cache_dir, offline)
    assert pinned["hit"] is True and pinned["path"] == first["path"], pinned


def test_a_branch_resolves_to_its_commit_each_time(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    old = _lfs_model(tmp_path, [1 * MiB], seed="old")
    repo_id, first = _repo(hub, uniq, old)
    name = repo_id.replace("/", "--")
    assert _fetch_json(wc, f"hf://{repo_id}@main", cache_dir, hf_env)["path"] == str(
        cache_dir / name / first
    )
    new = _lfs_model(tmp_path, [1 * MiB, 30_000], seed="new")
    _, second = _repo(hub, uniq, new)
    _, pr = _repo(hub, uniq, old, branch="refs/pr/1")
    moved = _fetch_json(wc, f"hf://{repo_id}@main", cache_dir, hf_env)
    assert moved["hit"] is False and moved["path"] == str(cache_dir / name / second), moved
    assert_revision_ok(cache_dir, name, second, new)
    assert_revision_ok(cache_dir, name, first, old)  # the old commit stays as it was
    by_flag = _fetch_json(wc, f"hf://{repo_id}", cache_dir, hf_env, "--revision", "refs/pr/1")
    assert by_flag["path"] == str(cache_dir / name / pr), by_flag


@pytest.mark.timeout(180)
def test_kill9_then_resume(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    model = _lfs_model(tmp_path, [24 * MiB])
    repo_id, commit = _repo(hub, uniq, model)
    source = f"hf://{repo_id}@{commit}"
    args = ("--no-daemon", "--part-size", "1M", "--max-concurrency", "4")
    running = wc.fetch_popen(source, cache_dir, *args, "--bwlimit", "3M", env=hf_env)
    kill9_mid_download(running, cache_dir)
    resumed = _fetch_json(wc, source, cache_dir, hf_env, *args[1:])
    assert_revision_ok(cache_dir, repo_id.replace("/", "--"), commit, model)
    # 2.5 s at 3 MiB/s is ~7 MiB; a kill loses at most the 4 parts in flight.
    assert int(str(resumed["bytes_from_origin"])) <= model.total_size - 2 * MiB, resumed


def test_a_corrupted_lfs_file_is_exit_4_and_nothing_is_published(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    model = _lfs_model(tmp_path, [2 * MiB, 1 * MiB], seed=uniq)
    repo_id, commit = _repo(hub, uniq, model)
    bad = model.shard_names()[0]
    hub.corrupt((model.root / bad).read_bytes())
    proc = wc.fetch(f"hf://{repo_id}@main", cache_dir, "--no-daemon", env=hf_env)
    message = assert_fails(proc, 4)
    assert "sha256 mismatch" in message and bad in message, message
    assert markers(cache_dir) == []
    assert not (cache_dir / repo_id.replace("/", "--") / commit).exists()
    assert not (blobs_dir(cache_dir) / model.hashes[bad]).exists()
    assert_blobs_valid(cache_dir)


def test_a_missing_repository_or_revision_is_exit_3(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    repo_id, _ = _repo(hub, uniq, _lfs_model(tmp_path, [100_000]))
    proc = wc.fetch(f"hf://org/{uniq}-nope@main", cache_dir, "--no-daemon", env=hf_env)
    message = assert_fails(proc, 3)
    assert f"no repository org/{uniq}-nope" in message and "HF_TOKEN" in message, message
    proc = wc.fetch(f"hf://{repo_id}@no-such-branch", cache_dir, "--no-daemon", env=hf_env)
    message = assert_fails(proc, 3)
    assert "no revision 'no-such-branch'" in message, message
    assert markers(cache_dir) == []


def test_a_mirror_that_ignores_blobs_is_listed_by_its_tree(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    """As olah's offline mirror answers: a model info without sizes or hashes (it ignores
    ?blobs=true), a tree listing with them, which `hf download` reads too."""
    model = make_model(tmp_path / "hub-src" / "tree", [200_000], small_files=True,
                       manifest=False, seed="tree")  # fmt: skip
    repo_id, commit = _repo(hub, uniq, model, blobs=False)
    name = repo_id.replace("/", "--")
    fetched = _fetch_json(wc, f"hf://{repo_id}@main", cache_dir, hf_env)
    assert fetched["path"] == str(cache_dir / name / commit), fetched
    assert_revision_ok(cache_dir, name, commit, model)
    marker = json.loads((cache_dir / name / commit / ".weightcache").read_text())
    how = {p: f["verified"] for p, f in marker["files"].items()}
    assert set(how.values()) == {"hf:git-sha1", "hf:sha256"}, how
    bare, _ = _repo(hub, f"{uniq}-bare", model, blobs=False, tree=False)
    proc = wc.fetch(f"hf://{bare}@main", cache_dir, "--no-daemon", env=hf_env)
    message = assert_fails(proc, 3)  # not retried as if the Hub were down (exit 6)
    assert "?blobs=true" in message and "tree listing" in message, message


def test_a_mirror_answering_another_commit_is_exit_3_naming_both(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    """A mirror that answers main's model info whatever revision is asked for: a commit
    must come back as itself (else its directory would hold another commit's bytes, and
    every later fetch of it be an offline hit on them); a branch is the commit it answers."""
    old = _lfs_model(tmp_path, [100_000], seed="asked")
    repo_id, asked = _repo(hub, uniq, old)
    new = _lfs_model(tmp_path, [120_000], seed="main")
    _, head = _repo(hub, uniq, new, main_only=True)
    proc = wc.fetch(f"hf://{repo_id}@{asked}", cache_dir, "--no-daemon", env=hf_env)
    message = assert_fails(proc, 3)
    assert asked in message and head in message and "HF_ENDPOINT" in message, message
    assert markers(cache_dir) == []
    branch = _fetch_json(wc, f"hf://{repo_id}@v1", cache_dir, hf_env)
    assert branch["path"] == str(cache_dir / repo_id.replace("/", "--") / head), branch
    assert_revision_ok(cache_dir, repo_id.replace("/", "--"), head, new)


def test_an_hf_endpoint_that_is_no_hub_is_said_at_once(
    wc: CLI, hf_env: dict[str, str | None], cache_dir: Path
) -> None:
    """HF_ENDPOINT without a scheme is exit 2, a web page there exit 3, both naming
    HF_ENDPOINT: configuration, not a Hub that is down (retried, exit 6 'try again')."""
    source = "hf://org/model@main"
    bad = wc.fetch(source, cache_dir, "--no-daemon", env={**hf_env, "HF_ENDPOINT": "hub.local"})
    message = assert_fails(bad, 2)
    assert "HF_ENDPOINT" in message and "hub.local" in message, message
    with web_page() as page:
        proc = wc.fetch(source, cache_dir, "--no-daemon", env={**hf_env, "HF_ENDPOINT": page})
    message = assert_fails(proc, 3)
    assert "HF_ENDPOINT" in message and page in message, message
    assert "attempt" not in proc.stderr, proc.stderr


def test_a_gated_repository_needs_hf_token(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    model = _lfs_model(tmp_path, [1 * MiB, 50_000])
    repo_id, commit = _repo(hub, uniq, model, gated_token="hf_right")
    source = f"hf://{repo_id}@main"
    message = assert_fails(wc.fetch(source, cache_dir, "--no-daemon", env=hf_env), 3)
    assert "gated" in message and "set HF_TOKEN" in message, message
    wrong = {**hf_env, "HF_TOKEN": "hf_wrong"}
    message = assert_fails(wc.fetch(source, cache_dir, "--no-daemon", env=wrong), 3)
    assert "gated" in message and "the token in HF_TOKEN has no access" in message, message
    # The token goes to the Hub, never to the LFS storage it redirects to (which refuses it).
    right = _fetch_json(wc, source, cache_dir, {**hf_env, "HF_TOKEN": "hf_right"})
    assert right["bytes_from_origin"] == model.total_size, right
    assert_revision_ok(cache_dir, repo_id.replace("/", "--"), commit, model)


def test_an_hf_token_no_header_can_carry_is_exit_2_naming_it(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    """Configuration to fix, not a Hub that is down (retried, then exit 6)."""
    repo_id, _ = _repo(hub, uniq, _lfs_model(tmp_path, [100_000]))
    env = {**hf_env, "HF_TOKEN": "hf_t\u00f6ken"}
    proc = wc.fetch(f"hf://{repo_id}@main", cache_dir, "--no-daemon", env=env)
    message = assert_fails(proc, 2)
    assert "HF_TOKEN" in message and "ASCII" in message, message
    assert "attempt" not in proc.stderr, proc.stderr


def test_the_hubs_429_is_retried(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    model = _lfs_model(tmp_path, [2 * MiB], seed=uniq)
    repo_id, commit = _repo(hub, uniq, model)
    hub.throttle(4)
    try:
        _fetch_json(wc, f"hf://{repo_id}@{commit}", cache_dir, hf_env, "--part-size", "256K")
    finally:
        hub.throttle(0)
    assert_revision_ok(cache_dir, repo_id.replace("/", "--"), commit, model)


def test_the_same_file_from_s3_and_from_the_hub_is_stored_once(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str,
    publish: Callable[..., Published], cache_dir: Path,
) -> None:  # fmt: skip
    """A repository with small files and its own SHA256SUMS: the manifest path, and the
    blobs of the S3 revision serve it."""
    pub = publish([2 * MiB, 1 * MiB], name="m", rev="r1")
    from_s3 = _fetch_json(wc, pub.source, cache_dir, hf_env)
    assert from_s3["bytes_from_origin"] == pub.model.total_size, from_s3
    repo_id, commit = _repo(hub, uniq, pub.model)
    assert MANIFEST in hub.repos[repo_id].commits[commit]
    from_hub = _fetch_json(wc, f"hf://{repo_id}@main", cache_dir, hf_env)
    assert from_hub["bytes_from_origin"] == 0, from_hub
    assert_revision_ok(cache_dir, repo_id.replace("/", "--"), commit, pub.model)
    assert assert_blobs_valid(cache_dir) == len(set(pub.model.hashes.values()))


def test_a_revision_from_a_directory_serves_the_hub_commit_with_the_same_content(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    """One name/revision holds one content: a directory whose SHA256SUMS is the manifest
    the Hub's sha256 make serves hf:// of that commit without a download."""
    model = _lfs_model(tmp_path, [1 * MiB, 40_000], seed=uniq)
    repo_id, commit = _repo(hub, uniq, model)
    name = repo_id.replace("/", "--")
    volume = make_model(tmp_path / "volume" / "m" / "v1", [1 * MiB, 40_000], seed=uniq,
                        small_files=False)  # fmt: skip
    _fetch_json(wc, str(volume.root), cache_dir, hf_env, "--name", name, "--revision", commit)
    served = _fetch_json(wc, f"hf://{repo_id}@main", cache_dir, hf_env)
    assert served["hit"] is True and served["bytes_from_origin"] == 0, served
    assert_revision_ok(cache_dir, name, commit, model)


@pytest.mark.timeout(150)
def test_the_daemon_fetches_hf_commits_with_its_token_for_pods_without_one(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    """The node daemon holds HF_TOKEN; a Pod asks for a pinned commit through the socket
    and needs neither the token nor the Hub. The models file prefetches hf:// commits."""
    listed = _lfs_model(tmp_path, [1 * MiB], seed=f"{uniq}-listed")
    listed_repo, listed_commit = _repo(hub, f"{uniq}-listed", listed, gated_token="hf_node")
    asked = _lfs_model(tmp_path, [1 * MiB, 60_000], seed=f"{uniq}-asked")
    asked_repo, asked_commit = _repo(hub, f"{uniq}-asked", asked, gated_token="hf_node")
    listing = [{"source": f"hf://{listed_repo}@{listed_commit}", "pin": True}]
    models = write_models(tmp_path / "models.yaml", listing)
    daemons.start(cache_dir, models, endpoint=dead_endpoint(), allow_source=["hf://org"],
                  env={**hf_env, "HF_TOKEN": "hf_node"})  # fmt: skip
    listed_dir = cache_dir / listed_repo.replace("/", "--") / listed_commit
    wait_for("the prefetch of the listed commit", (listed_dir / ".weightcache").is_file)
    assert_revision_ok(cache_dir, listed_repo.replace("/", "--"), listed_commit, listed)
    pod = {**hf_env, "HF_ENDPOINT": dead_endpoint()}  # no token, no Hub
    proc = wc.fetch(f"hf://{asked_repo}@{asked_commit}", cache_dir, env=pod)
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout.strip() == str(cache_dir / asked_repo.replace("/", "--") / asked_commit)
    assert "fetching alone" not in proc.stderr, describe(proc)
    assert_revision_ok(cache_dir, asked_repo.replace("/", "--"), asked_commit, asked)


def test_small_files_without_a_manifest_are_verified_by_their_git_blob_id(
    wc: CLI, hub: HubServer, hf_env: dict[str, str | None], uniq: str, tmp_path: Path,
    cache_dir: Path,
) -> None:  # fmt: skip
    """No SHA256SUMS and files outside LFS (config.json, tokenizer files): each small file is
    downloaded, its git blob id computed while it lands and compared with the one the Hub
    lists, and the marker says so."""
    root = tmp_path / "hub-src" / "small"
    model = make_model(root, [2 * MiB], small_files=True, manifest=False, seed="small")
    repo_id, commit = _repo(hub, uniq, model)
    name = repo_id.replace("/", "--")
    first = _fetch_json(wc, f"hf://{repo_id}@{commit}", cache_dir, hf_env)
    assert first["hit"] is False, first
    assert_revision_ok(cache_dir, name, commit, model)
    marker = json.loads((cache_dir / name / commit / ".weightcache").read_text())
    how = {p: f["verified"] for p, f in marker["files"].items()}
    assert "hf:git-sha1" in how.values() and "hf:sha256" in how.values(), how
    assert _fetch_json(wc, f"hf://{repo_id}@{commit}", cache_dir, hf_env)["hit"] is True
