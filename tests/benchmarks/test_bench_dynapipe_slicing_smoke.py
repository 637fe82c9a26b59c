"""Smoke test of benchmarks/bench_dynapipe_slicing.py: one JSON row per layout, self-consistent
(auto slicing never loses to DynaPipe alone, the post-pass alone never beats the full search).
Speed-ups are printed, not asserted."""
import json

from benchmarks.bench_dynapipe_slicing import main


def test_rows_are_consistent(capsys):
    main(["--max-lens", "1024", "--batches", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["layout"] for r in rows] == ["PP4xDP2", "PP8xDP1"]
    for r in rows:
        assert r["sliced_ms"] <= r["dynapipe_ms"] + 1e-6
        assert r["sliced_ms"] <= r["postpass_only_ms"] + 1e-6 <= r["dynapipe_ms"] + 2e-6
        assert abs(r["speedup"] - r["dynapipe_ms"] / r["sliced_ms"]) < 1e-2
