"""The image, built from this tree and run the way the shipped manifests run it.

The init container of initcontainer/ and the daemon of daemonset/ are taken from the rendered
YAML and run with podman (`conftest.podman_args`): uid 65532, read-only root, every
capability dropped, no-new-privileges, the memory limit, exactly their volumes. The store is
the tests' SeaweedFS on 127.0.0.1 (fake-gcs-server and Azurite for gs:// and az://), reached
with the host's network.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.image.conftest import Podman, PodSandbox, node_dir, podman_args
from tests.packaging.conftest import (
    DAEMONSET,
    INITCONTAINER,
    NODE_PREP,
    Container,
    Rendered,
    kustomize,
    overlay,
)
from tests.support.azurite import upload_dir
from tests.support.checks import assert_revision_ok
from tests.support.modelgen import Model, make_model

#: Added to the rendered environment only so the test can tell a hit from a miss:
#: `fetch --json` reads it (every option has a WEIGHTCACHE_* variable).
JSON_OUTPUT = {"WEIGHTCACHE_JSON": "true"}
PEER_TOKEN = "image-test-peer-token-0123456789abcdef"


def _only(rendered: Rendered, word: str) -> Container:
    found = [c for c in rendered.weightcache_containers() if word in c.argv]
    assert len(found) == 1, f"{rendered.name}: expected one `weightcache {word}` container"
    return found[0]


def _with_source(c: Container, source: str) -> Container:
    """The init container with its SOURCE (the s3:// argument) pointed at the test's model."""
    args = [source if str(a).startswith("s3://") else a for a in c.spec["args"]]
    return Container(c.workload, c.pod_spec, {**c.spec, "args": args}, c.init)


def _fetch_sandbox(tmp_path: Path, store: Any, cache: Path) -> PodSandbox:
    return _pod(tmp_path, cache, {**store.env, "AWS_EC2_METADATA_DISABLED": "true"})


def _pod(tmp_path: Path, cache: Path, env: dict[str, str]) -> PodSandbox:
    """The init container's Pod: the node's cache dir, `env` as its Secret, JSON output."""
    return PodSandbox(
        tmp_path / "pod", host_paths={"weight-cache": cache}, secrets={**env, **JSON_OUTPUT}
    )


def _run_fetch(podman: Podman, image: str, c: Container, sandbox: PodSandbox) -> dict[str, Any]:
    proc = podman.run(podman_args(c, sandbox, image, podman.name()))
    assert proc.returncode == 0, f"init container exited {proc.returncode}:\n{proc.stderr}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_image_runs_as_the_non_root_uid(image: str, podman: Podman) -> None:
    proc = podman.run(["--entrypoint", "id", image])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("uid=65532(weightcache) gid=65532(weightcache)"), proc.stdout
    help_ = podman.run([image])
    assert help_.returncode == 0 and "Usage: weightcache" in help_.stdout, help_.stderr


def _read_write(tmp_path: Path) -> Rendered:
    """initcontainer/ with its read-write component: the fetch alone, without a daemon."""
    component = INITCONTAINER / "components" / "read-write"
    directory = tmp_path / "overlay"
    directory.mkdir()
    return Rendered("initcontainer+read-write",
                    kustomize(overlay(directory, INITCONTAINER, (component,))))  # fmt: skip


def test_init_container_miss_then_hit(
    image: str,
    podman: Podman,
    initcontainer_rendered: Rendered,
    store: Any,
    publish: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """The read-write fallback fetches alone; the default read-only init container then
    hits, and without a daemon its miss is exit 2 in one line."""
    pub = publish([3 << 20, 1 << 20])
    absent = publish([1 << 20], name="absent", rev="r1")
    fetch = _with_source(_only(_read_write(tmp_path), "fetch"), pub.source)
    read_only = _only(initcontainer_rendered, "fetch")
    cache = node_dir(tmp_path / "node" / "weightcache")
    sandbox = _fetch_sandbox(tmp_path, store, cache)

    miss = _run_fetch(podman, image, fetch, sandbox)
    assert miss["hit"] is False and miss["bytes_from_origin"] >= 4 << 20, miss
    assert miss["path"] == f"{fetch.option('--cache-dir')}/{pub.name}/{pub.rev}"
    for f in pub.model.files:
        local = pub.local_path(cache) / f.relpath
        assert hashlib.sha256(local.read_bytes()).hexdigest() == f.sha256, f.relpath

    hit = _run_fetch(podman, image, _with_source(read_only, pub.source), sandbox)
    assert hit["hit"] is True and hit["bytes_from_origin"] == 0, hit
    miss = podman.run(podman_args(_with_source(read_only, absent.source), sandbox, image,
                                  podman.name()))  # fmt: skip
    errors = [line for line in miss.stderr.splitlines() if line.startswith("weightcache: error:")]
    assert miss.returncode == 2 and len(errors) == 1, miss.stderr
    assert "read-only" in errors[0] and "no node daemon answers" in errors[0], errors


def test_init_container_takes_over_a_read_only_partial(
    image: str,
    podman: Podman,
    store: Any,
    publish: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """A kill between publishing's chmod 0444 of a verified partial and its rename leaves a
    read-only `<hex>.part`. Root ignores file modes, so only uid 65532 (as the image runs)
    shows whether the next fetch takes it over instead of failing on EACCES for a day."""
    pub = publish([2 << 20], name="ro-partial", seed="ro-partial")
    fetch = _with_source(_only(_read_write(tmp_path), "fetch"), pub.source)  # alone: no daemon
    cache = node_dir(tmp_path / "node" / "weightcache")
    tmp = node_dir(node_dir(cache / ".weightcache") / "tmp")
    sha = next(f.sha256 for f in pub.model.files if f.size == 2 << 20)
    partial = tmp / f"{sha}.part"
    partial.write_bytes(b"\0" * 4096)
    os.chown(partial, 65532, 65532)
    os.chmod(partial, 0o444)

    miss = _run_fetch(podman, image, fetch, _fetch_sandbox(tmp_path, store, cache))
    assert miss["hit"] is False, miss
    for f in pub.model.files:
        local = pub.local_path(cache) / f.relpath
        assert hashlib.sha256(local.read_bytes()).hexdigest() == f.sha256, f.relpath


def test_init_container_hits_with_the_store_stopped(
    image: str, podman: Podman, initcontainer_rendered: Rendered, tmp_path: Path
) -> None:
    """A warm node starts Pods while the object store is down."""
    import boto3

    from weightcache.ops.devstore import DevStore

    local = DevStore(tmp_path / "store").start()
    try:
        env = local.env
        s3 = boto3.client(
            "s3",
            endpoint_url=local.endpoint_url,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_REGION"],
        )
        _put_model(s3, "offline/m/r1", {"model.safetensors": b"w" * (1 << 20)})
        fetch = _with_source(_only(_read_write(tmp_path), "fetch"), "s3://models/offline/m/r1")
        cache = node_dir(tmp_path / "node" / "weightcache")
        sandbox = _fetch_sandbox(tmp_path, local, cache)
        assert _run_fetch(podman, image, fetch, sandbox)["hit"] is False
    finally:
        local.stop()
    read_only = _with_source(_only(initcontainer_rendered, "fetch"), "s3://models/offline/m/r1")
    hit = _run_fetch(podman, image, read_only, sandbox)
    assert hit["hit"] is True and hit["bytes_from_origin"] == 0, hit


def _miss_then_hit(
    podman: Podman,
    image: str,
    rendered: Rendered,
    tmp_path: Path,
    source: str,
    model: Model,
    env: dict[str, str],
) -> None:
    """The read-write init container fetches `source` (model llama/v1) alone, then the
    default read-only one hits: as for S3 above, with the scheme's library in the image."""
    fetch = _with_source(_only(_read_write(tmp_path), "fetch"), source)
    cache = node_dir(tmp_path / "node" / "weightcache")
    sandbox = _pod(tmp_path, cache, env)
    miss = _run_fetch(podman, image, fetch, sandbox)
    assert miss["hit"] is False and miss["bytes_from_origin"] == model.total_size, miss
    assert miss["path"] == f"{fetch.option('--cache-dir')}/llama/v1", miss
    assert_revision_ok(cache, "llama", "v1", model)
    read_only = _with_source(_only(rendered, "fetch"), source)
    hit = _run_fetch(podman, image, read_only, sandbox)
    assert hit["hit"] is True and hit["bytes_from_origin"] == 0, hit


def test_init_container_miss_then_hit_from_gcs(
    image: str,
    podman: Podman,
    initcontainer_rendered: Rendered,
    gcs: Any,
    uniq: str,
    tmp_path: Path,
) -> None:
    """gs:// through the image's gcsfs (fake-gcs-server; GCS's crc32c beside sha256)."""
    model = make_model(tmp_path / "src" / "llama" / "v1", [3 << 20, 1 << 20])
    prefix = f"models/{uniq}/llama/v1"
    gcs.fs().put(f"{model.root}/", f"{prefix}/", recursive=True)
    env = {"STORAGE_EMULATOR_HOST": gcs.url}
    _miss_then_hit(podman, image, initcontainer_rendered, tmp_path, f"gs://{prefix}", model, env)


def test_init_container_miss_then_hit_from_azure(
    image: str,
    podman: Podman,
    initcontainer_rendered: Rendered,
    azurite: Any,
    uniq: str,
    tmp_path: Path,
) -> None:
    """az:// through the image's adlfs and Azure SDK (Azurite; Content-MD5 beside sha256)."""
    model = make_model(tmp_path / "src" / "llama" / "v1", [3 << 20, 1 << 20])
    container = azurite.service().get_container_client("models")
    upload_dir(container, model.root, f"{uniq}/llama/v1")
    env = {"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string}
    source = f"az://models/{uniq}/llama/v1"
    _miss_then_hit(podman, image, initcontainer_rendered, tmp_path, source, model, env)


def _put_model(s3: Any, prefix: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        s3.put_object(Bucket="models", Key=f"{prefix}/{rel}", Body=data)
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {rel}\n" for rel, d in files.items())
    s3.put_object(Bucket="models", Key=f"{prefix}/SHA256SUMS", Body=sums.encode())


def _pins_ready(base: str) -> bool:
    """Every `weightcache_revision_ready{pinned="true"}` series is 1 (and there is one)."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return False
    series = "weightcache_revision_ready{"
    pins = [
        line for line in text.splitlines() if line.startswith(series) and 'pinned="true"' in line
    ]
    return bool(pins) and all(line.endswith(" 1.0") for line in pins)


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def _probe_url(c: Container, probe: str) -> str:
    get = c.spec[probe]["httpGet"]
    port = get["port"] if isinstance(get["port"], int) else c.port(get["port"])
    return f"http://127.0.0.1:{port}{get['path']}"


def test_daemon_prefetches_then_is_ready_and_serves_metrics(
    image: str,
    podman: Podman,
    daemonset_rendered: Rendered,
    store: Any,
    publish: Callable[..., Any],
    tmp_path: Path,
) -> None:
    pub = publish([2 << 20, 1 << 20])
    daemon = _only(daemonset_rendered, "daemon")
    models = tmp_path / "configmap"
    models.mkdir()
    (models / "models.yaml").write_text(
        f"models:\n  - source: {pub.source}\n    name: {pub.name}\n"
        f"    revision: {pub.rev}\n    pin: true\n"
    )
    cache = node_dir(tmp_path / "node" / "weightcache")
    kubelet_pods = tmp_path / "node" / "kubelet-pods"
    kubelet_pods.mkdir(mode=0o751)
    sandbox = PodSandbox(
        tmp_path / "pod",
        host_paths={"weight-cache": cache, "kubelet-pods": kubelet_pods},
        config_maps={"models": models},
        secrets={**store.env, "AWS_EC2_METADATA_DISABLED": "true", "token": PEER_TOKEN},
    )
    name = podman.name()
    podman.start(podman_args(daemon, sandbox, image, name))
    ready, metrics = _probe_url(daemon, "readinessProbe"), _probe_url(daemon, "livenessProbe")
    deadline = time.monotonic() + 180
    # /readyz means serving; the prefetch of the pin is the metric.
    while _http_status(ready) != 200 or not _pins_ready(ready.rsplit("/", 1)[0]):
        state = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Running}}", name],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        assert state == "true", f"the daemon container exited:\n{podman.logs(name)}"
        assert time.monotonic() < deadline, f"/readyz or the pin never ready:\n{podman.logs(name)}"
        time.sleep(1)
    assert (pub.local_path(cache) / pub.model.files[0].relpath).exists(), "not prefetched"
    assert _http_status(metrics) == 200, podman.logs(name)
    base = ready.rsplit("/", 1)[0]
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert "weightcache_cache_bytes" in text, text[:2000]
    stop = subprocess.run(
        ["podman", "stop", "--time=30", name], capture_output=True, text=True, check=False
    )
    assert stop.returncode == 0, stop.stderr


def test_node_prep_prepares_a_fresh_node(
    image: str, podman: Podman, tmp_path: Path, tmp_path_factory: Any
) -> None:
    """components/node-prep's init container, as rendered (root, CAP_CHOWN and CAP_FOWNER
    only), turns the kubelet's fresh directories into what the daemon needs."""
    directory = tmp_path_factory.mktemp("node-prep")
    rendered = Rendered("node-prep", kustomize(overlay(directory, DAEMONSET, (NODE_PREP,))))
    (prep,) = [c for c in rendered.containers() if c.init]
    node = tmp_path / "node"
    cache = node / "weightcache"  # as the kubelet creates a DirectoryOrCreate hostPath
    cache.mkdir(parents=True, mode=0o755)
    pods = node / "kubelet-pods"  # as the kubelet creates it
    pods.mkdir(mode=0o750)
    os.chmod(pods, 0o750)
    sandbox = PodSandbox(tmp_path / "pod", host_paths={"weight-cache": cache, "kubelet-pods": pods})
    for _ in range(2):  # idempotent: a restarted Pod runs it again
        proc = podman.run(podman_args(prep, sandbox, image, podman.name()))
        assert proc.returncode == 0, proc.stderr
    st = cache.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65532, 65532, 0o755)
    assert stat.S_IMODE(pods.stat().st_mode) == 0o751, oct(pods.stat().st_mode)
