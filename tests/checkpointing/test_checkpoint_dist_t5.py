"""--ckpt-format torch_dist for T5: encoder and decoder layers under their global indices, the
tied embedding copies (first decoder stage, last stage) read the first stage's tables, the
vocabulary-padded LM-head bias is stored cut; bit-exact resume and a resume at another layout."""
import pytest

from megatron.checkpointing.torch_format import load_checkpoint
from megatron.checkpointing.dist_format import read_index
from tests.dist_harness import run_distributed
from tests.resume_harness import TOTAL, assert_resume_bit_exact, first_half, make_trainer, resume_cfg
from tests.training.test_t5_parity import VOCAB


@pytest.mark.parametrize("world,t5,dist_opt", [(2, dict(pp=2, split=1), False), (4, dict(tp=2), True),
                                                pytest.param(2, dict(pp=2, split=1, pos="learned_absolute"), True,
                                                             marks=pytest.mark.slow)])
def test_t5_torch_dist_resume_is_bit_exact(tmp_path, world, t5, dist_opt):
    def check_saved(path):
        index = read_index(str(path / f"iter_{TOTAL // 2:07d}"))
        for layer in ("encoder.layers.1", "decoder.layers.1"):
            assert f"model.{layer}.self_attention.query_key_value.weight" in index
        assert index["model.lm_head_bias"][0] == (VOCAB,)  # padded rows cut
        assert not any(k.startswith("model.output_layer") for k in index)  # tied: stored once
    assert_resume_bit_exact(tmp_path, world, dict(fmt="torch_dist", t5=t5, dist_opt=dist_opt), check_saved)


def _losses(rank, world, ckpt, t5):
    t = make_trainer(resume_cfg(world, load=ckpt, fmt="torch_dist", t5=t5))
    if ckpt is not None:
        assert load_checkpoint(t) and t.iteration == TOTAL // 2
    return [h["loss"] for h in t.train()]


def test_t5_torch_dist_loads_at_another_layout(tmp_path):
    """Saved at PP = 3 (split rank 1: the last stage holds a tied copy of the embedding),
    continued at PP = 1 and at TP = 2: the uninterrupted run's losses."""
    ref = run_distributed(_losses, 1, None, {})[-1][TOTAL // 2:]
    run_distributed(first_half, 3, str(tmp_path), dict(fmt="torch_dist", t5=dict(pp=3, split=1)))
    for world, t5 in ((1, {}), (2, dict(tp=2))):
        got = run_distributed(_losses, world, str(tmp_path), t5)[-1]
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-6), (t5, got, ref)
