"""--terapipe composed with the other features: each run gives the losses, gradients and
parameters of the same run without --terapipe on the same batches (tests/parity_utils bounds).

* multi-task data (inputs + targets, loss on targets only): fixed padded micro-batches and
  packed rows (--pack-dataset, per-document attention across slice boundaries: a query sees
  the cached keys of earlier slices of its own document only);
* --sequence-parallel (TP2 x PP2), --recompute-granularity full, virtual pipeline stages;
* the distributed optimizer with overlapped reduce-scatters, --overlap-grad-reduce,
  --emb-comm-opt, PowerSGD data-parallel compression at full rank; fp16 / bf16 (to 16-bit
  precision).
"""
import dataclasses

import pytest

from megatron.config.core import TeraPipeConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity
from tests.training.test_dynapipe_training import multitask  # noqa: F401 (the data fixture)

pytestmark = pytest.mark.parity

SP = dict(sequence_parallel=True)


def _train_multitask(rank, world, data, mode, slices=None, pp=1):
    """tests/test_dynapipe_training._train with --terapipe --terapipe-slices `slices` when given."""
    import tests.training.test_dynapipe_training as td
    orig = td._cfg

    def cfg(*a, **k):
        c = orig(*a, **k)
        c.data.dynapipe_cost_model = None
        return c if slices is None else dataclasses.replace(c, terapipe=TeraPipeConfig(enabled=True, slices=slices))
    td._cfg = cfg
    try:
        return td._train(rank, world, "gpt", data, mode, pp=pp)
    finally:
        td._cfg = orig


@pytest.fixture(scope="module")
def packed_reference(multitask):  # noqa: F811
    return run_distributed(_train_multitask, 1, multitask, "packing")


@pytest.fixture(scope="module")
def fixed_reference(multitask):  # noqa: F811
    return run_distributed(_train_multitask, 1, multitask, "fixed")


def _check(ref, outs):
    last = [o for o in outs if o["is_last"]][0]
    assert last["samples"] == [o for o in ref if o["is_last"]][0]["samples"]
    assert_parity(ref, outs)


def test_terapipe_packed_rows_pp2_matches_unsliced(multitask, packed_reference):  # noqa: F811
    # 64-token rows cut at 8, 24, 40: documents straddle slice boundaries
    outs = run_distributed(_train_multitask, 2, multitask, "packing", "8,16,16,24", pp=2)
    info = [o for o in outs if o["is_last"]][0]["info"]
    assert all(i["planner"] == "packing" and i["slices"] == [8, 16, 16, 24] for i in info)
    _check(packed_reference, outs)


def test_terapipe_multitask_fixed_microbatches_pp2_matches_unsliced(multitask, fixed_reference):  # noqa: F811
    # micro-batches padded to their own lengths: 3 uniform slices of each
    outs = run_distributed(_train_multitask, 2, multitask, "fixed", "3", pp=2)
    info = [o for o in outs if o["is_last"]][0]["info"]
    slicings = [sl for i in info for sl in (i["slices"] if isinstance(i["slices"][0], list) else [i["slices"]])]
    assert any(len(sl) > 1 for sl in slicings) and len({sum(sl) for sl in slicings}) > 1  # sliced, lengths vary
    _check(fixed_reference, outs)


def test_fixed_slices_of_micro_batches_of_other_lengths():
    # multi-task micro-batches are padded to their own lengths (multiples of 8): a count N gives
    # at most one slice per 8-token cell; lengths l1,l2,... keep the boundaries inside the sequence
    from megatron.planner.terapipe.planner import TeraPipePlanner
    from tests.parity_utils import tiny_config
    base = tiny_config(seq=64, tp=2, world=2, arch=SP)
    count = TeraPipePlanner(dataclasses.replace(base, terapipe=TeraPipeConfig(enabled=True, slices="3")), 1)
    assert [count.fixed_slices(s) for s in (64, 16, 40)] == [[24, 24, 16], [8, 8], [16, 16, 8]]
    cuts = TeraPipePlanner(dataclasses.replace(base, terapipe=TeraPipeConfig(enabled=True, slices="8,16,16,24")), 1)
    assert [cuts.fixed_slices(s) for s in (64, 24, 8, 40)] == [[8, 16, 16, 24], [8, 16], [8], [8, 16, 16]]


# ----------------------------------------------------------------------------- layouts, flags
ITERS = 2  # steps per run: the second step checks the first update's parameters


def _terapipe(rank, world, slices, **kw):
    from tests.training.test_terapipe_training import run_terapipe
    return run_terapipe(rank, world, slices, iters=ITERS, **kw)



def test_terapipe_sequence_parallel_tp2_pp2_matches_unsliced():
    # each slice is split over the 2 TP ranks; stages exchange [l/2, b, h]; K/V cached after the
    # sequence all-gather of the QKV projection
    from tests.parity_utils import run_layout
    ref = run_distributed(run_layout, 4, dict(seq=16, tp=2, pp=2, arch=SP, iters=ITERS))
    assert_parity(ref, run_distributed(_terapipe, 4, "8,2,6", tp=2, pp=2, arch=SP))


def test_terapipe_sequence_parallel_dropout_matches_one_slice_single_process():
    # keyed dropout masks at the absolute positions of each rank's sequence chunk
    from tests.training.test_training_parity import _compare
    ref = run_distributed(_terapipe, 1, "1", dropout=0.2)
    _compare(ref, run_distributed(_terapipe, 2, "4,2,10", tp=2, dropout=0.2, arch=SP))


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_terapipe_recompute_pp2_matches_unsliced(recompute):
    # full: the replay of a checkpointed layer reads the K/V cache, gradients reach each slice's
    # K/V once; selective: the core attention over cached + own K/V is recomputed
    from tests.parity_utils import run_layout
    ref = run_distributed(run_layout, 2, dict(seq=16, pp=2, recompute=recompute, iters=ITERS))
    assert_parity(ref, run_distributed(_terapipe, 2, "5,3,8", pp=2, recompute=recompute))


def test_terapipe_full_recompute_dropout_replays_keyed_masks():
    from tests.training.test_training_parity import _compare
    ref = run_distributed(_terapipe, 1, "1", dropout=0.2)
    _compare(ref, run_distributed(_terapipe, 2, "8,8", pp=2, dropout=0.2, recompute="full"))


def test_terapipe_virtual_stages_pp2_matches_unsliced():
    # 4 layers on PP2 as 4 virtual stages of 1 layer: units in groups of PP, chunk by chunk
    from tests.parity_utils import run_layout
    ref = run_distributed(run_layout, 2, dict(seq=16, pp=2, vpp_layers=1, iters=ITERS))
    assert_parity(ref, run_distributed(_terapipe, 2, "5,3,8", pp=2, vpp_layers=1))


def _run_with(rank, world, slices, training=None, compression=None, **kw):
    """run_layout with TrainingConfig / CompressionConfig fields changed, and --terapipe
    --terapipe-slices `slices` unless None."""
    import tests.parity_utils as pu
    from megatron.config.core import CompressionConfig
    orig = pu.tiny_config

    def patched(**k):
        c = orig(**k)
        c = dataclasses.replace(c, training=dataclasses.replace(c.training, **(training or {})),
                                compression=CompressionConfig(**(compression or {})))
        return c if slices is None else dataclasses.replace(c, terapipe=TeraPipeConfig(enabled=True, slices=slices))
    pu.tiny_config = patched
    try:
        return pu.run_layout(rank, world, dict(seq=16, iters=ITERS, **kw))
    finally:
        pu.tiny_config = orig


@pytest.mark.parametrize("world,kw", [
    (4, dict(pp=2, training=dict(use_distributed_optimizer=True, overlap_grad_reduce=True))),  # PP2 x DP2
    (4, dict(pp=2, training=dict(overlap_grad_reduce=True))),
    (2, dict(pp=2, compression=dict(emb_comm_opt=True))),
    (4, dict(pp=2, compression=dict(grad_comp=True, grad_comp_rank=32))),         # PowerSGD at full rank
], ids=["distopt_overlap", "overlap", "emb_comm_opt", "grad_comp"])
def test_terapipe_with_optimizer_and_dp_features_matches_unsliced(world, kw):
    ref = run_distributed(_run_with, world, None, **kw)
    got = run_distributed(_run_with, world, "8,3,5", **kw)
    if kw.get("training", {}).get("use_distributed_optimizer"):
        # The distributed optimizer shards the gradients away; the single-process run of the
        # same model supplies every step's full gradients, which the derived bounds need.
        from tests.parity_utils import run_layout
        single = run_distributed(run_layout, 1, dict(seq=16, iters=ITERS))[0]["grads"]
        for i, o in enumerate(ref):
            o["grads"] = single if i == 0 else [{} for _ in single]
        for o in got:
            o["grads"] = []
    assert_parity(ref, got)


@pytest.mark.fp32  # autocast leaves float64 alone: the 16-bit path needs float32 weights
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_terapipe_mixed_precision_trains_like_unsliced(dtype):
    # 16-bit autocast rounds the sliced and unsliced sums differently: same losses and grad
    # norms to 16-bit precision. fp16 starts at a loss scale that does not overflow, so both
    # steps update the model (the default 2**32 would skip them).
    kw = dict(pp=2, training=dict(initial_loss_scale=2.0 ** 12), **{dtype: True})
    ref = [o for o in run_distributed(_run_with, 2, None, **kw) if o["is_last"]][0]
    got = [o for o in run_distributed(_run_with, 2, "8,3,5", **kw) if o["is_last"]][0]
    assert None not in ref["grad_norm"] and None not in got["grad_norm"]
    u = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}[dtype]  # unit roundoff of the 16-bit format
    assert got["loss"] == pytest.approx(ref["loss"], rel=u)  # fp32 loss of 16-bit logits
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=4 * u)
