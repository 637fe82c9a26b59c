"""Every parallel layout must match the single-process run (fp32): losses, grad norms,
first-step gradients and the parameters after several steps."""
import pytest

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, {})


def _compare(ref_outs, outs):
    """Both arguments are per-rank result lists of `run_layout`; bounds derived in parity_utils."""
    assert_parity(ref_outs, outs)


LAYOUTS = {
    "tp2": (2, dict(tp=2)),
    "dp2": (2, dict()),
    "tp2_dp2": (4, dict(tp=2)),
    "pp2_1f1b": (2, dict(pp=2)),
    "pp2_gpipe": (2, dict(pp=2, schedule="gpipe")),
    "pp4": (4, dict(pp=4)),
    "pp2_interleaved": (2, dict(pp=2, vpp_layers=1)),
    "tp2_pp2": (4, dict(tp=2, pp=2)),
    "pp2_dp2": (4, dict(pp=2)),
    "pp2_uneven": (2, dict(pp=2, stage_layers=[1, 3])),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_process(reference, name):
    world, kwargs = LAYOUTS[name]
    _compare(reference, run_distributed(run_layout, world, kwargs))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_matches_no_recompute(reference, recompute):
    _compare(reference, run_distributed(run_layout, 2, dict(tp=2, recompute=recompute)))


def test_dropout_replays_under_full_recompute():
    # Recomputed dropout masks (default and TP-tracked streams) must equal the originals.
    plain = run_distributed(run_layout, 2, dict(tp=2, dropout=0.2))
    recomputed = run_distributed(run_layout, 2, dict(tp=2, dropout=0.2, recompute="full"))
    _compare(plain, recomputed)


def test_loss_falls():
    out = run_distributed(run_layout, 1, dict(iters=20, lr=1e-2))[0]
    assert out["loss"][-1] < out["loss"][0] - 0.5
