"""--emb-comm-opt with --use-distributed-optimizer and with --overlap-grad-reduce (PP2 x DP2):
the fused sync sums the tied gradient over every replica of the first and last stage, so the
tied parameters stay out of the overlapped all-reduce, and into the distributed optimizer's
reduce-scatter goes one replica's copy (the others zero). Exact: parity with the single-process
run of the same batches."""
import pytest

from tests.aceso.test_hetero_grads import check, hetero_run
from tests.dist_harness import run_distributed
from tests.parity_utils import run_layout

pytestmark = pytest.mark.parity

ITERS = 2


@pytest.mark.parametrize("flags,compare_grads", [
    ({"training.use_distributed_optimizer": True}, False),  # gradients are sharded away
    ({"training.overlap_grad_reduce": True, "training.ddp_bucket_size": 2000}, True),
], ids=["distributed-optimizer", "overlap-grad-reduce"])
def test_fused_embedding_sync_with(flags, compare_grads):
    ref = run_distributed(run_layout, 1, dict(iters=ITERS))
    outs = run_distributed(hetero_run, 4, dict(pp=2, iters=ITERS), **{"compression.emb_comm_opt": True}, **flags)
    check(ref, outs, compare_grads=compare_grads)
