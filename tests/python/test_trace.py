"""refit-bench --trace: one Chrome trace of every receiver rank's refreshes.

A staged run of 4 receiver ranks and 3 versions writes the merged trace and
the reports; the spans per rank must match the reports: one GET batch per
attempt (a refresh and its retries) and one commit per committed version.
The trace is checked twice: read as the JSON it is, and loaded by Perfetto's
trace processor (PyPI `perfetto`) with a SQL query. The trace processor
needs its binary: $REFIT_TRACE_PROCESSOR names one, else the package fetches
its pinned one on first use; where neither can be had that test skips and
says so.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from conftest import BUILD, ROOT

BENCH = BUILD / "tools" / "refit-bench"
RANKS = 4
VERSIONS = 3


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    if not BENCH.exists():
        pytest.skip(f"no refit-bench at {BENCH} (build the project first)")
    tmp = tmp_path_factory.mktemp("trace")
    trace, reports = tmp / "trace.json", tmp / "reports.json"
    run = subprocess.run(
        [str(BENCH), "--scenario", str(ROOT / "examples/scenarios/tp2-to-tp2x2.json"), "--models",
         str(ROOT / "examples/models"), "--strategies", "refit", "--versions", str(VERSIONS), "--mode", "staged",
         "--timeout", "30", "--trace", str(trace), "--reports", str(reports)],
        capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(trace.read_text()), json.loads(reports.read_text()), trace


def expected_per_rank(reports):
    """What each receiver rank's reports say: GET batches (attempts) and commits."""
    batches, commits = Counter(), Counter()
    for version in reports["refit"]:
        assert len(version["reports"]) == RANKS
        for rank, report in enumerate(version["reports"]):  # in receiver rank order
            batches[rank] += 1 + report["retries"]
            commits[rank] += 1 if report.get("committed") else 0
    return batches, commits


def test_trace_spans_match_the_reports(bench_run):
    events, reports, _ = bench_run
    batches, commits = expected_per_rank(reports)
    assert sum(commits.values()) == RANKS * VERSIONS
    spans = [e for e in events if e.get("ph") == "X"]
    got_batches = Counter(e["tid"] for e in spans if e["name"] == "get_batch")
    got_commits = Counter(e["tid"] for e in spans if e["name"] == "commit")
    assert got_batches == batches
    assert got_commits == commits
    # Every step of a staged refresh is there, on every rank's track.
    for name in ("refresh", "lease", "fetch_plan", "get_batch", "fan_out", "barrier", "commit"):
        assert {e["tid"] for e in spans if e["name"] == name} == set(range(RANKS)), name
    # A track per rank: each process names its thread after its rank.
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert sorted(names.values()) == [f"receiver {r}" for r in range(RANKS)]
    # The fan-out's sends, batch by batch: summed over a refresh they are its
    # report's pushes and local bytes. Only refreshes of one attempt are
    # summed: a failed attempt's sends would count twice.
    for rank in range(RANKS):
        sends = [e for e in spans if e["tid"] == rank and e["name"] == "fan_out_send"]
        assert sends and all(e["args"]["ok"] for e in sends), rank
        for r in (e for e in spans if e["tid"] == rank and e["name"] == "refresh"):
            report = next(v["reports"][rank] for v in reports["refit"] if v["version"] == r["args"]["version"])
            if report["retries"]:
                continue
            inside = [e for e in sends if r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"]]
            assert sum(e["args"]["sends"] for e in inside) == report["pushes"], (rank, r["args"])
            assert sum(e["args"]["peer_bytes"] for e in inside) == report["local_bytes"], (rank, r["args"])
    counters = [e for e in events if e.get("ph") == "C" and e["name"] == "get_bytes_in_flight"]
    assert counters and max(c["args"]["bytes"] for c in counters) > 0
    assert all(c["args"]["bytes"] >= 0 for c in counters)
    # Spans of one rank's refresh lie inside it, on one clock for all ranks.
    for rank in range(RANKS):
        refreshes = [e for e in spans if e["tid"] == rank and e["name"] == "refresh"]
        for b in (e for e in spans if e["tid"] == rank and e["name"] == "get_batch"):
            assert any(r["ts"] <= b["ts"] and b["ts"] + b["dur"] <= r["ts"] + r["dur"] for r in refreshes)


def trace_processor(trace: Path):
    tp_module = pytest.importorskip("perfetto.trace_processor", reason="PyPI perfetto is not installed")
    config = tp_module.TraceProcessorConfig(bin_path=os.environ.get("REFIT_TRACE_PROCESSOR"))
    try:
        return tp_module.TraceProcessor(trace=str(trace), config=config)
    except Exception as e:  # the package's binary could not be fetched (no network) or started
        pytest.skip(f"Perfetto's trace processor could not start ({type(e).__name__}: the package fetches its "
                    "binary on first use, which needs the network); set REFIT_TRACE_PROCESSOR to a "
                    "trace_processor_shell binary")


def test_perfetto_counts_get_batches_and_commits_per_rank(bench_run):
    _, reports, trace = bench_run
    batches, commits = expected_per_rank(reports)
    tp = trace_processor(trace)
    try:
        rows = tp.query("""
            select thread.tid as rank, slice.name as name, count(*) as n
            from slice
            join thread_track on slice.track_id = thread_track.id
            join thread using (utid)
            where slice.name in ('get_batch', 'commit')
            group by thread.tid, slice.name""")
        got = {(r.rank, r.name): r.n for r in rows}
    finally:
        tp.close()
    assert {rank: got.get((rank, "get_batch"), 0) for rank in range(RANKS)} == dict(batches)
    assert {rank: got.get((rank, "commit"), 0) for rank in range(RANKS)} == dict(commits)
