"""--ckpt-format torch_dist under --aceso-config (each stage its own TP x DP size) and with
Optimus-CC: bit-exact resume at the same layout (compression residuals and factors restored
per rank), a checkpoint saved with per-stage sizes continues at a uniform layout (and back)
with the uninterrupted run's losses, and compression state saved at another layout starts
afresh with a note (as the torch format does at another DP size)."""
import pytest

from megatron.checkpointing.torch_format import load_checkpoint
from tests.dist_harness import run_distributed
from tests.resume_harness import TOTAL, assert_resume_bit_exact, first_half, make_trainer, resume_cfg

HETERO = dict(pp=2, stage_parallel=[[2, 1], [1, 2]], stage_layers=[1, 3])  # TP2 -> DP2 on 4 ranks


@pytest.mark.parametrize("kw", [HETERO, pytest.param(dict(HETERO, dist_opt=True), marks=pytest.mark.slow)])
def test_per_stage_layout_resume_is_bit_exact(tmp_path, kw):
    # dropout on: every rank's RNG streams are restored (the layout recorded is the job's)
    assert_resume_bit_exact(tmp_path, 4, dict(kw, fmt="torch_dist"))


EMB_COMP = dict(emb_comm_opt=True, emb_grad_comp=True, emb_grad_comp_rank=2, grad_comp=True, grad_comp_rank=2,
                use_error_feedback=True)


def test_embedding_and_data_parallel_compression_resume_is_bit_exact(tmp_path):
    assert_resume_bit_exact(tmp_path, 4, dict(pp=2, fmt="torch_dist", dist_opt=True, compression=EMB_COMP))


def _trains(rank, world, ckpt, kw):
    t = make_trainer(resume_cfg(world, load=ckpt, fmt="torch_dist", **kw))
    assert load_checkpoint(t)
    return [h["loss"] for h in t.train()]


def test_compression_state_of_another_layout_starts_afresh(tmp_path, capfd):
    comp = dict(grad_comp=True, grad_comp_rank=2, use_error_feedback=True)
    run_distributed(first_half, 2, str(tmp_path), dict(fmt="torch_dist", compression=comp))
    losses = run_distributed(_trains, 4, str(tmp_path), dict(tp=2, compression=comp))[-1]
    assert len(losses) == TOTAL // 2 and all(x == x for x in losses)
    assert "compression residuals and warm starts begin afresh" in capfd.readouterr().err


def _losses(rank, world, ckpt, kw):
    t = make_trainer(resume_cfg(world, load=ckpt, fmt="torch_dist", dropout=0.0, **kw))
    if ckpt is not None:
        assert load_checkpoint(t) and t.iteration == TOTAL // 2
    return [h["loss"] for h in t.train()]


@pytest.mark.parametrize("saved,loaded", [((4, HETERO), (1, {})),
                                          pytest.param((2, dict(tp=2)), (4, HETERO), marks=pytest.mark.slow)])
def test_per_stage_layout_reshards(tmp_path, saved, loaded):
    ref = run_distributed(_losses, 1, None, {})[-1][TOTAL // 2:]
    run_distributed(first_half, saved[0], str(tmp_path), dict(saved[1], fmt="torch_dist", dropout=0.0))
    got = run_distributed(_losses, loaded[0], str(tmp_path), loaded[1])[-1]
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6), (saved, loaded, got, ref)
