"""--overlap-grad-reduce with the fused embedding sync (--emb-comm-opt): the overlapped buckets
reduce every gradient except the tied embeddings, which the fused first/last-stage x DP sync
sums after the backward (with --use-distributed-optimizer: its own bucket, cut locally)."""
import dataclasses

import pytest

from megatron.config import CompressionConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout

pytestmark = pytest.mark.parity


def _run(rank, world, dist_opt):
    import tests.parity_utils as pu
    orig, orig_make, seen = pu.tiny_config, pu.make_trainer, {}

    def cfg(**k):
        c = orig(**k)
        c = dataclasses.replace(c, training=dataclasses.replace(c.training, overlap_grad_reduce=True,
                                                                 use_distributed_optimizer=dist_opt, ddp_bucket_size=2000))
        return dataclasses.replace(c, compression=CompressionConfig(emb_comm_opt=True))

    def make(c):
        seen["t"] = orig_make(c)
        return seen["t"]

    pu.tiny_config, pu.make_trainer = cfg, make
    try:
        out = run_layout(rank, world, dict(pp=2))
    finally:
        pu.tiny_config, pu.make_trainer = orig, orig_make
    t = seen["t"]
    tied = {id(p) for p in t.tied_params}
    overlapped = {id(p) for b in t.overlap_reducer.buckets for p in b}
    if dist_opt:  # the optimizer's late buckets are never launched by the overlapped reducer
        overlapped = {id(p) for i, b in enumerate(t.overlap_reducer.buckets) if i not in t.overlap_reducer.late
                      for p in b}
    return dict(out, tied=bool(tied), tied_overlapped=bool(tied & overlapped), buckets=len(t.overlap_reducer.buckets))


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, dict())


@pytest.mark.parametrize("dist_opt", [False, True])
def test_overlapped_reduction_with_fused_embedding_sync_equals_single_process(reference, dist_opt):
    outs = run_distributed(_run, 4, dist_opt)  # PP2 x DP2
    assert all(o["tied"] and not o["tied_overlapped"] and o["buckets"] > 2 for o in outs)
    assert_parity(reference, outs, compare_grads=not dist_opt)
