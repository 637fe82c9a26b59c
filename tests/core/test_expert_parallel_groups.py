"""Expert-parallel groups in Megatron-Core's rank order: checked against megatron-core's own
RankGenerator (the expert generator of `initialize_model_parallel`, tp=ETP 1, order tp-cp-ep-dp-pp)
when MEGATRON_CORE_PYTHONPATH is set, and against the layout read in its source otherwise."""
import json
import os
import subprocess
import sys

import pytest

from megatron.core.expert_parallel import expert_groups_layout

ORACLE = r"""
import json, sys
from megatron.core.parallel_state import RankGenerator
out = []
for world, pp, ep in json.loads(sys.argv[1]):
    g = RankGenerator(tp=1, ep=ep, dp=world // (pp * ep), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out.append([g.get_ranks("ep"), g.get_ranks("dp")])
print(json.dumps(out))
"""
LAYOUTS = [(16, 2, 4), (8, 1, 2), (8, 2, 2), (4, 1, 4), (4, 2, 1), (12, 3, 2)]


def test_layout_read_in_megatron_core():
    # research/moe.md: W 16, TP 2, PP 2, EP 4, ETP 1 -> EP [0..3], [4..7], ...; EDP [0,4], [1,5], ...
    ep, edp = expert_groups_layout(16, 2, 4)
    assert ep == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert edp[:2] == [[0, 4], [1, 5]] and edp[4:6] == [[8, 12], [9, 13]]


@pytest.mark.skipif(not os.environ.get("MEGATRON_CORE_PYTHONPATH"), reason="set MEGATRON_CORE_PYTHONPATH")
def test_groups_equal_megatron_core_rank_generator(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.environ["MEGATRON_CORE_PYTHONPATH"], CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", ORACLE, json.dumps(LAYOUTS)], env=env, capture_output=True, text=True,
                         timeout=300, check=True, cwd=tmp_path)  # not here: our package is `megatron` too
    for (world, pp, ep), (want_ep, want_edp) in zip(LAYOUTS, json.loads(res.stdout.strip().splitlines()[-1])):
        got_ep, got_edp = expert_groups_layout(world, pp, ep)
        assert sorted(got_ep) == sorted(want_ep) and sorted(got_edp) == sorted(want_edp), (world, pp, ep)
