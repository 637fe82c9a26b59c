"""Aceso's activation rule (PerfModel.activation_terms) against what the runtime keeps, for every
per-layer recompute set the search can emit plus residual / dropout cases: within 5 %
(measured at hidden 256, sequence 512, micro-batch 1 and 2: all rows within 1 %)."""
import pytest

from megatron.aceso.memory_check import EXTRA_SETTINGS, aceso_rows


@pytest.mark.slow
def test_kept_bytes_within_five_percent():
    rows = list(aceso_rows(((256, 512, 1), (256, 512, 2)), heads=8, vocab=256))
    assert {"none", "full"} <= {r["setting"] for r in rows}
    assert sum(r["source"] == "search" for r in rows) >= 6
    assert len({r["setting"] for r in rows}) >= len(EXTRA_SETTINGS) + 4
    bad = [(r["mbs"], r["setting"], r["error"]) for r in rows if abs(r["error"]) > 0.05]
    assert not bad, bad
