"""--sequence-parallel matches the single-process run (fp32) and saves what it should."""
import pytest
import torch

from megatron.config.core import ConfigError
from tests.dist_harness import run_distributed
from tests.parity_utils import run_layout, tiny_config
from tests.training.test_training_parity import _compare

pytestmark = pytest.mark.parity

SP = dict(sequence_parallel=True)
LLAMA = dict(sequence_parallel=True, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
             position_embedding_type="rope", num_query_groups=2)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, {})


@pytest.mark.parametrize("name,world,kw", [
    ("tp2", 2, dict(tp=2, arch=SP)),
    ("tp2_pp2", 4, dict(tp=2, pp=2, arch=SP)),
    ("tp2_selective_recompute", 2, dict(tp=2, arch=SP, recompute="selective")),
    ("tp2_full_recompute", 2, dict(tp=2, arch=SP, recompute="full")),
])
def test_sequence_parallel_matches_single_process(reference, name, world, kw):
    _compare(reference, run_distributed(run_layout, world, kw))


def test_llama_style_sequence_parallel_matches_single_process():
    ref = run_distributed(run_layout, 1, dict(arch={k: v for k, v in LLAMA.items() if k != "sequence_parallel"}))
    _compare(ref, run_distributed(run_layout, 2, dict(tp=2, arch=LLAMA)))


def test_sequence_parallel_dropout_replays_under_recompute():
    # Dropout masks differ per TP rank under SP (different tokens); recompute must replay them.
    plain = run_distributed(run_layout, 2, dict(tp=2, dropout=0.2, arch=SP))
    recomputed = run_distributed(run_layout, 2, dict(tp=2, dropout=0.2, arch=SP, recompute="full"))
    selective = run_distributed(run_layout, 2, dict(tp=2, dropout=0.2, arch=SP, recompute="selective"))
    _compare(plain, recomputed)
    _compare(plain, selective)


def _boundary_shape(rank, world):
    from tests.parity_utils import make_trainer
    t = make_trainer(tiny_config(world=world, tp=2, pp=2, arch=SP, iters=1))
    work = t.batch_source.next(1, 0)
    from megatron.pipeline import instructions as I
    t.train_step()  # the executor refuses a send whose tensor differs from the planned shape
    assert t.sequence_parallel_params, "norm weights must be tagged for the TP all-reduce"
    return sorted({tuple(x.buffer_shapes[0]) for x in work.plan.instructions
                   if isinstance(x, (I.SendActivationStart, I.RecvActivationStart))})


def test_stages_exchange_sequence_chunks():
    shapes = run_distributed(_boundary_shape, 4)
    assert all(s == [(8, 2, 32)] for s in shapes)  # seq 16 / TP 2, micro-batch 2, hidden 32


def test_sequence_length_must_divide():
    with pytest.raises(ConfigError, match="--seq-length .* multiple of --tensor-model-parallel-size"):
        tiny_config(world=4, tp=4, seq=18, arch=SP)


def test_cost_model_sees_the_activation_saving():
    from megatron.planner.dynapipe.planner import sp_memory_factor
    assert sp_memory_factor("full", 4, 2048, 4096, 32) == pytest.approx(0.25)
    assert sp_memory_factor("selective", 2, 2048, 4096, 32) == pytest.approx(17 / 22)
    f = sp_memory_factor("none", 8, 2048, 4096, 32)
    assert 1 / 8 < float(f) < 1.0
