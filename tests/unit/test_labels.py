"""Node label computation (design §5, node labels): pure, no cluster needed."""

from __future__ import annotations

import re

from weightcache.daemon.labels import PREFIX, label_safe, merge_patch, node_labels

_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


def test_ready_revisions_become_labels() -> None:
    assert node_labels([("qwen3-70b", "2026-10-01"), ("llama", "v1")]) == {
        "weightcache.io/qwen3-70b": "2026-10-01",
        "weightcache.io/llama": "v1",
    }


def test_values_are_made_valid_label_segments() -> None:
    assert label_safe("rev+1@x") == "rev-1-x"
    assert label_safe("_leading.and.trailing_") == "leading.and.trailing"
    long = "a" * 80
    safe = label_safe(long)
    assert len(safe) <= 63 and _LABEL.fullmatch(safe), safe
    assert label_safe("a" * 80) != label_safe("a" * 79 + "b")  # the digest keeps them apart


def test_every_generated_label_is_valid() -> None:
    for name, rev in [("m", "2026-10-01"), ("M.o_d-e+l", "r=1"), ("x" * 100, "y" * 100)]:
        for key, value in node_labels([(name, rev)]).items():
            assert key.startswith(PREFIX)
            assert _LABEL.fullmatch(key.removeprefix(PREFIX)), key
            assert _LABEL.fullmatch(value), value


def test_merge_patch_sets_new_and_removes_stale_labels() -> None:
    previous = {"weightcache.io/a": "r1", "weightcache.io/b": "r1"}
    wanted = {"weightcache.io/a": "r2"}
    assert merge_patch(wanted, previous) == {
        "metadata": {"labels": {"weightcache.io/a": "r2", "weightcache.io/b": None}}
    }
