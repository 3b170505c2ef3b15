"""The swarm benchmark's pure helpers: what it reads from tc and /metrics, and its table.

The harness itself needs root and namespaces and is not run by the test suite.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import netlab
import swarm

# `tc -s -j qdisc show dev X` of iproute2 6.1, a shaped veth end after some traffic.
TC_JSON = (
    '[{"kind":"tbf","handle":"8002:","root":true,"refcnt":3,"options":{"rate":50000000,'
    '"burst":500000,"lat":50000},"bytes":281920318,"packets":9371,"drops":0,"overlimits":812,'
    '"requeues":0,"backlog":0,"qlen":0}]'
)


def test_qdisc_sent_bytes_reads_the_root_qdisc() -> None:
    assert netlab.qdisc_sent_bytes(TC_JSON) == 281920318
    with pytest.raises(ValueError, match="no root qdisc"):
        netlab.qdisc_sent_bytes("[]")  # a veth end without shaping: nothing to count


def test_rates_are_tc_decimal_bits() -> None:
    assert netlab.parse_rate("400mbit") == 400_000_000
    assert netlab.parse_rate("1.6Gbit") == 1_600_000_000
    assert netlab.fmt_rate(1_600_000_000) == "1.6gbit"
    with pytest.raises(ValueError):
        netlab.parse_rate("400M")  # bytes or bits? tc's own words only
    # 10 ms of the rate, never below 64 KiB.
    for bits, burst in ((400_000_000, 500_000), (1_000_000, 64 << 10)):
        args = netlab.tbf_args(bits)
        assert args[args.index("burst") + 1] == str(burst)


METRICS = """\
# HELP weightcache_revision_ready 1 when the revision is ready on this node
# TYPE weightcache_revision_ready gauge
weightcache_revision_ready{name="m",pinned="true",revision="r1"} {value}
weightcache_revision_ready{name="other",pinned="false",revision="r9"} 0.0
"""


def test_pinned_ready_needs_every_pinned_revision_at_one() -> None:
    assert swarm.pinned_ready(METRICS.replace("{value}", "1.0"))
    assert not swarm.pinned_ready(METRICS.replace("{value}", "0.0"))
    # Before the models file is loaded there is no pinned series: not ready.
    assert not swarm.pinned_ready("# TYPE weightcache_revision_ready gauge\n")
    two = METRICS.replace("{value}", "1.0") + (
        'weightcache_revision_ready{name="n",pinned="true",revision="r2"} 0.0\n'
    )
    assert not swarm.pinned_ready(two)


def test_summarize_in_line_rates_and_model_copies() -> None:
    s = swarm.summarize([6.0, 12.0, 9.0, 3.0], 3.0, store_payload=200.0, model_bytes=100,
                        store_wire=209.0)  # fmt: skip
    assert (s.nodes_ready, s.last_s, s.p50_s) == (4, 12.0, 7.5)
    assert (s.last_x_line, s.p50_x_line, s.store_x_model, s.wire_x_model) == (4, 2.5, 2, 2.09)
    # A node that never got ready: no "last" (the run did not finish), p50 still known.
    s = swarm.summarize([6.0, None, 9.0], line_s=3.0, store_payload=0.0, model_bytes=100)
    assert s.nodes_ready == 2 and math.isnan(s.last_s) and s.p50_s == 7.5


def test_line_rate_is_the_model_over_one_link() -> None:
    assert swarm.line_rate_s(256 << 20, 400_000_000) == pytest.approx(5.37, abs=0.01)
