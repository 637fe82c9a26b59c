"""Every parallel layout must match the single-process run (fp32): losses, grad norms,
first-step gradients and the parameters after several steps."""
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import assemble, run_layout

ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, {})


def _last(outs):
    return [o for o in outs if o["is_last"]][0]


def _compare(ref_outs, outs):
    """Both arguments are per-rank result lists of `run_layout`."""
    ref, last = _last(ref_outs), _last(outs)
    assert last["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
    assert last["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    ref_g = assemble([g for o in ref_outs for g in o["grads"]])
    got_g = assemble([g for o in outs for g in o["grads"]])
    assert set(got_g) == set(ref_g)
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {name}: {m}")
    ref_p = assemble([o["params"] for o in ref_outs])
    got_p = assemble([o["params"] for o in outs])
    for name in ref_p:
        torch.testing.assert_close(got_p[name], ref_p[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"param {name}: {m}")


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
