"""--decoupled-lr with --use-distributed-optimizer: the word embedding and output layer get their
own learning-rate curve in every DP shard, and DP 2 (and TP 2 x DP 2) with the distributed
optimizer match one process with the plain optimizer (float64 parity, tests/parity_utils.py)."""
import pytest

from megatron.config.extras import ExtrasConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, make_trainer, tiny_config, train_and_record

pytestmark = pytest.mark.parity
DECOUPLED = dict(decoupled_lr=3e-2, decoupled_min_lr=1e-3)  # far from --lr 1e-3: a missed group shows


def _run(rank, world, kw, dist_opt, decoupled=True):
    cfg = tiny_config(world=world, iters=3, **kw)
    cfg.training.use_distributed_optimizer = dist_opt
    cfg.training.weight_decay = 0.1
    if decoupled:
        cfg.extras = ExtrasConfig(**DECOUPLED)
    return train_and_record(make_trainer(cfg), world)


@pytest.mark.parametrize("world,kw", [(2, {}), (4, dict(tp=2)), (2, dict(untie=True))])
def test_distributed_optimizer_carries_the_decoupled_group(world, kw):
    ref = run_distributed(_run, 1, {k: v for k, v in kw.items() if k != "tp"}, False)
    got = run_distributed(_run, world, kw, True, timeout_s=180)
    assert_parity(ref, got, compare_grads=False)


def test_the_decoupled_curve_changes_the_embedding():
    with_it = run_distributed(_run, 2, {}, True)[0]["params"]
    without = run_distributed(_run, 2, {}, True, False)[0]["params"]
    emb = [n for n in with_it if "word_embeddings" in n]
    assert emb and not any(bool((with_it[n][0] == without[n][0]).all()) for n in emb)
