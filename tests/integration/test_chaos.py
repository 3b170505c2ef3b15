"""A kill -9 and fault loop over the whole node: real `fetch`
processes (through the daemon or alone, some as Pods with a POD_UID), `gc` with a small
capacity, the daemon evicting under a small --capacity, kill -9 of any of them at random
moments, and a store that sometimes resets or throttles.

Two promises are checked after every round and at the end:
- a marked revision is verified bytes: `weightcache verify` passes on every revision that
  has a marker (design §3 invariant 1);
- a path printed to a Pod is never evicted while the Pod lives: for every fetch with a
  POD_UID that printed its path, as long as the Pod's directory exists under the daemon's
  --kubelet-pods-dir, the revision keeps its marker, its files and its directory (the
  same inode: evicted and fetched again is still evicted under the Pod's feet).

The seed is printed and can be set with WEIGHTCACHE_CHAOS_SEED to replay a run (the
interleavings still depend on the scheduler). Every broken promise is collected, with
its round and revision, and reported together at the end.
"""

from __future__ import annotations

import os
import random
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import CLI, Published, Running
from tests.integration.daemon_helpers import (
    DaemonProc,
    Daemons,
    daemons,  # noqa: F401 - fixture
    write_models,
)
from tests.support.checks import MARKER, describe, error_lines, markers, revision_files
from tests.support.faultproxy import FaultProxy
from tests.support.modelgen import sha256_file

KiB = 1024
ROUNDS = 20
DAEMON_CAPACITY = 3 * 1024 * KiB  # ~2.5 of the five revisions: the daemon must evict
ACCEPTABLE_EXITS = {0, 5, 6, -9}  # ready, no space (leases hold it), store faults, killed
FAULTY_STORE_EXITS = {4}  # a file corrupted twice by the store in a row


@dataclass
class Lease:
    """A Pod that was given a path: `uid`'s directory exists while it lives."""

    uid: str
    pub: Published
    inode: int
    since_round: int


@dataclass
class Chaos:
    """The state of one run: the node's directories, the Pods alive, what went wrong."""

    rng: random.Random
    seed: int
    cache_dir: Path
    pods_dir: Path
    pubs: list[Published]
    leases: list[Lease] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def pod_uid(self) -> str:
        """A new Pod: a Kubernetes UID (8-4-4-4-12 lowercase hex) with its directory."""
        uid = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        (self.pods_dir / uid).mkdir()
        return uid

    def end_pod(self, lease: Lease) -> None:
        shutil.rmtree(self.pods_dir / lease.uid, ignore_errors=True)
        self.leases.remove(lease)

    def broke(self, round_: int, what: str) -> None:
        self.violations.append(f"round {round_}: {what}")


@dataclass
class Started:
    """One process of a round and what it was asked to do."""

    kind: str  # "fetch-daemon", "fetch-alone", "gc"
    running: Running
    pub: Published | None = None
    uid: str | None = None
    killed: bool = False


def publish_models(publish: Callable[..., Published]) -> list[Published]:
    """Five small revisions; m0/r1 and m0/r2 share a shard (an upgrade), so evicting one of
    them must keep the blob the other links."""
    shard = 512 * KiB
    pubs = [
        publish([shard, shard], name="m0", rev="r1", seed="m0r1", shard_seeds=["s0", "m0r1b"]),
        publish([shard, shard], name="m0", rev="r2", seed="m0r2", shard_seeds=["s0", "m0r2b"]),
    ]
    pubs += [publish([shard, shard], name=f"m{i}", rev="r1", seed=f"m{i}") for i in (1, 2, 3)]
    return pubs


def start_round(chaos: Chaos, wc: CLI, proxy: FaultProxy, daemon_up: bool) -> list[Started]:
    """2-3 fetches of random revisions (through the daemon or alone, 60% as Pods), and
    two times in three a `gc` with a capacity smaller than the revisions."""
    rng = chaos.rng
    started = []
    for _ in range(rng.randint(2, 3)):
        pub = rng.choice(chaos.pubs)
        uid = chaos.pod_uid() if rng.random() < 0.6 else None
        alone = not daemon_up or rng.random() < 0.4
        args = ["--no-daemon"] if alone else []
        env = {"POD_UID": uid} if uid else {}
        running = wc.fetch_popen(pub.source, chaos.cache_dir, *args, "--part-size", "256K",
                                 "--timeout", "20s", endpoint=proxy.url, env=env)  # fmt: skip
        started.append(Started("fetch-alone" if alone else "fetch-daemon", running, pub, uid))
    for _ in range(rng.choice((0, 1, 1))):
        capacity = rng.randint(1024 * KiB, 3 * 1024 * KiB)
        running = wc.popen("gc", "--capacity", str(capacity), "--cache-dir", chaos.cache_dir)
        started.append(Started("gc", running))
    rng.shuffle(started)
    return started


def kill_some(chaos: Chaos, started: list[Started], daemon: DaemonProc | None) -> bool:
    """kill -9 a quarter of the processes (and a fifth of the time the daemon) at random
    moments within 1.5 s; returns whether the daemon was killed."""
    rng = chaos.rng
    plan: list[tuple[float, Started | None]] = [
        (rng.uniform(0.0, 1.5), s) for s in started if rng.random() < 0.25
    ]
    if daemon is not None and rng.random() < 0.2:
        plan.append((rng.uniform(0.0, 1.5), None))
    t0 = time.monotonic()
    daemon_killed = False
    for at, target in sorted(plan, key=lambda p: p[0]):
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        if target is None:
            assert daemon is not None
            daemon.kill9()
            daemon_killed = True
        elif target.running.poll() is None:
            target.running.kill9()
            target.killed = True
    return daemon_killed


def finish_round(chaos: Chaos, round_: int, started: list[Started], faulty: bool) -> None:
    """Wait for the round's processes; check their exits; lease the printed paths."""
    acceptable = ACCEPTABLE_EXITS | (FAULTY_STORE_EXITS if faulty else set())
    for s in started:
        result = s.running.finish(timeout=90)
        what = f"{s.kind} {s.pub.name}/{s.pub.rev}" if s.pub else s.kind
        if result.returncode not in acceptable or "Traceback" in result.stderr:
            chaos.broke(round_, f"{what} exited {result.returncode}\n{describe(result)}")
        elif result.returncode in (4, 5, 6):
            print(f"round {round_}: {what} exited {result.returncode}: "
                  f"{error_lines(result.stderr)}")  # fmt: skip
        if s.pub is None or s.uid is None or not result.stdout.strip():
            continue
        # The fetch printed the path to a Pod that still lives: it must be there now.
        rev_dir = s.pub.local_path(chaos.cache_dir)
        try:
            inode = rev_dir.stat().st_ino
        except FileNotFoundError:
            chaos.broke(round_, f"{what} (POD_UID {s.uid}) printed {rev_dir}, which is gone")
            continue
        if not (rev_dir / MARKER).is_file():
            chaos.broke(round_, f"{what} (POD_UID {s.uid}) printed {rev_dir}, not marked")
        chaos.leases.append(Lease(s.uid, s.pub, inode, round_))


def check_leases(chaos: Chaos, round_: int) -> None:
    """No revision leased by a live Pod was evicted (or evicted and fetched again).

    A broken lease is reported once, then its Pod ends (so one eviction is one line)."""
    for lease in list(chaos.leases):
        problem = lease_problem(chaos, lease)
        if problem is not None:
            what = f"{lease.pub.name}/{lease.pub.rev}, leased by live Pod {lease.uid}"
            chaos.broke(round_, f"{what} since round {lease.since_round}, {problem}")
            chaos.end_pod(lease)


def lease_problem(chaos: Chaos, lease: Lease) -> str | None:
    rev_dir = lease.pub.local_path(chaos.cache_dir)
    try:
        inode = rev_dir.stat().st_ino
    except FileNotFoundError:
        return "was evicted"
    if inode != lease.inode:
        return "was evicted and fetched again (new directory)"
    if not (rev_dir / MARKER).is_file():
        return "lost its marker"
    sizes = {rel: p.stat().st_size for rel, p in revision_files(rev_dir).items()}
    expected = lease.pub.model.sizes
    if {rel: sizes.get(rel) for rel in expected} != expected:
        return f"lost files or bytes: {sizes}"
    return None


def check_marked_bytes(chaos: Chaos, round_: int) -> None:
    """Every marked revision holds the manifest's bytes (hashed here: the daemon may be
    evicting, so a revision that vanishes while being read is skipped, not blamed)."""
    by_dir = {pub.local_path(chaos.cache_dir): pub for pub in chaos.pubs}
    for marker in markers(chaos.cache_dir):
        pub = by_dir[marker.parent]
        for rel, digest in pub.model.hashes.items():
            try:
                ok = sha256_file(marker.parent / rel) == digest
            except FileNotFoundError:
                ok = False
            if not ok and marker.is_file():
                chaos.broke(round_, f"{pub.name}/{pub.rev} is marked but {rel} is wrong or gone")
                break


def end_some_pods(chaos: Chaos) -> None:
    for lease in list(chaos.leases):
        if chaos.rng.random() < 0.5:
            chaos.end_pod(lease)


def set_store_faults(chaos: Chaos, proxy: FaultProxy) -> bool:
    """A third of the rounds, the store resets, throttles or corrupts some data requests;
    returns whether it does."""
    if chaos.rng.random() < 1 / 3:
        proxy.configure(scope="data", reset_rate=0.03, slowdown_rate=0.05, corrupt_rate=0.02,
                        max_consecutive=2)  # fmt: skip
        return True
    proxy.clear_faults()
    return False


def verify_all(chaos: Chaos, wc: CLI, when: str) -> None:
    """`weightcache verify` on every marked revision (nothing else runs on the cache)."""
    for marker in markers(chaos.cache_dir):
        target = f"{marker.parent.parent.name}/{marker.parent.name}"
        proc = wc.run("verify", target, "--cache-dir", chaos.cache_dir, timeout=60)
        if proc.returncode != 0:
            chaos.violations.append(f"{when}: verify {target} failed\n{describe(proc)}")


@pytest.mark.timeout(420)
def test_fetch_gc_daemon_and_kill9_keep_marked_bytes_and_leased_paths(
    wc: CLI, publish: Callable[..., Published], proxy: FaultProxy, cache_dir: Path,
    tmp_path: Path, daemons: Daemons,  # noqa: F811
) -> None:  # fmt: skip
    seed = int(os.environ.get("WEIGHTCACHE_CHAOS_SEED") or random.SystemRandom().getrandbits(32))
    print(f"chaos seed {seed} (replay with WEIGHTCACHE_CHAOS_SEED={seed})")
    pods_dir = tmp_path / "pods"
    chaos = Chaos(random.Random(seed), seed, cache_dir, pods_dir, publish_models(publish))
    models = write_models(tmp_path / "models.yaml", [])

    def start_daemon() -> DaemonProc:
        return daemons.start(cache_dir, models, endpoint=proxy.url, pods_dir=pods_dir,
                             capacity=str(DAEMON_CAPACITY),
                             extra=["--part-size", "256K"])  # fmt: skip

    daemon: DaemonProc | None = start_daemon()
    started_at = time.monotonic()
    for round_ in range(ROUNDS):
        end_some_pods(chaos)
        faulty = set_store_faults(chaos, proxy)
        if daemon is None:
            daemon = start_daemon()
        started = start_round(chaos, wc, proxy, daemon_up=True)
        if kill_some(chaos, started, daemon):
            daemon = None
        finish_round(chaos, round_, started, faulty)
        if daemon is not None and not daemon.alive():
            chaos.broke(round_, f"the daemon exited {daemon.proc.returncode}\n{daemon.log()}")
            daemon = None
        check_leases(chaos, round_)
        check_marked_bytes(chaos, round_)
        print(f"round {round_}: {[(s.kind, s.pub and s.pub.name + '/' + s.pub.rev, s.uid and s.uid[:8], s.killed, s.running.poll()) for s in started]}; "  # noqa: E501
              f"{len(chaos.leases)} live leases, {len(markers(cache_dir))} marked, "
              f"{time.monotonic() - started_at:.0f}s")  # fmt: skip

    if daemon is not None:
        daemon.kill9()
    proxy.clear_faults()
    check_leases(chaos, ROUNDS)
    verify_all(chaos, wc, "at the end")
    if chaos.violations:
        pytest.fail(
            f"chaos seed {seed}: {len(chaos.violations)} broken promise(s):\n"
            + "\n".join(chaos.violations),
            pytrace=False,
        )
