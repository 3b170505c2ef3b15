"""Optional node labels: `weightcache.io/<name>=<revision>` once a revision is ready.

Inference Deployments can then prefer (or require) warm nodes with node affinity. Off by
default; on with `--node-name` (usually from the downward API's spec.nodeName), which
needs the ClusterRole in daemonset/components/node-labels/ (get and patch on nodes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import ssl
import urllib.request
from collections.abc import Iterable

from weightcache.config import format_hostport

PREFIX = "weightcache.io/"
_SA = "/var/run/secrets/kubernetes.io/serviceaccount"
_BAD = re.compile(r"[^A-Za-z0-9._-]")


def label_safe(value: str) -> str:
    """A Kubernetes label name segment or value: <= 63 chars, alphanumeric at both ends."""
    clean = _BAD.sub("-", value).strip("-._")
    if len(clean) > 63:
        digest = hashlib.sha256(value.encode()).hexdigest()[:8]
        clean = clean[:54].rstrip("-._") + "-" + digest
    return clean or hashlib.sha256(value.encode()).hexdigest()[:8]


def node_labels(ready: Iterable[tuple[str, str]]) -> dict[str, str]:
    """{label: value} for the ready revisions; the newest-listed revision wins per model."""
    out: dict[str, str] = {}
    for name, revision in ready:
        out[PREFIX + label_safe(name)] = label_safe(revision)
    return out


def merge_patch(wanted: dict[str, str], previous: dict[str, str]) -> dict[str, object]:
    """The JSON merge patch that sets `wanted` and removes labels no longer wanted."""
    labels: dict[str, str | None] = {k: None for k in previous if k not in wanted}
    labels.update(wanted)
    return {"metadata": {"labels": labels}}


def in_cluster() -> bool:
    """Whether this runs in a Kubernetes cluster, where `patch_node` finds its API:
    Kubernetes sets KUBERNETES_SERVICE_HOST in every container it starts."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def patch_node(node: str, wanted: dict[str, str], previous: dict[str, str]) -> None:
    """PATCH the node through the API server with the Pod's service account token (call
    it `in_cluster()` only)."""
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    with open(f"{_SA}/token") as fh:
        token = fh.read().strip()
    req = urllib.request.Request(
        f"https://{format_hostport(host, port)}/api/v1/nodes/{node}",
        data=json.dumps(merge_patch(wanted, previous)).encode(),
        method="PATCH",
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/merge-patch+json",
        },
    )
    context = ssl.create_default_context(cafile=f"{_SA}/ca.crt")
    with urllib.request.urlopen(req, context=context, timeout=10) as resp:
        resp.read()
