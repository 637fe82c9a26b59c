"""MoE checkpoints in `--ckpt-format torch_dist`: every expert weight and its Adam moments are
stored whole ([num_experts, ...], gathered over the EP group) under their global name, with the
router's aux-loss-free `expert_bias` (a buffer), so a run resumes bit-identically at its own EP
size and continues at another EP (or PP) size as a straight run at that size would, up to
float64 roundoff."""
import glob
import os

import torch

from megatron.checkpointing import dist_format
from tests.checkpointing.test_moe_resume import _kw
from tests.dist_harness import run_distributed
from tests.resume_harness import TOTAL, assert_resume_bit_exact, first_half, second_half, straight


def _dist(ep, **kw):
    return dict(_kw(ep), fmt="torch_dist", **kw)


def _saved_state_is_whole(root):
    (it_dir,) = glob.glob(os.path.join(str(root), "iter_*"))
    index = dist_format.read_index(it_dir)  # (checked against the manifest first)
    experts = {k: shape for k, (shape, _) in index.items() if ".experts.weight" in k and not k.endswith(".step")}
    # weight1 / weight2 and both Adam moments of 2 MoE layers, each with all 4 experts
    assert len(experts) == 12 and all(s[0] == 4 for s in experts.values()), experts
    biases = [k for k in index if k.endswith("router.expert_bias")]
    assert len(biases) == 2, sorted(index)
    sd = {k: torch.empty(index[k][0], dtype=index[k][1]) for k in biases}
    from megatron.checkpointing import dist_reader
    dist_reader.read_tensors(dist_reader.read_metadata(it_dir), it_dir, sd)
    # a bias of 0 at the save would make a lost bias invisible to the resume comparison
    assert all(float(b.abs().sum()) > 0 for b in sd.values()), sd


def test_moe_dist_resume_at_ep2_is_bit_exact(tmp_path):
    assert_resume_bit_exact(tmp_path, 2, _dist(2), check_saved=_saved_state_is_whole)


def _resume_elsewhere(tmp_path, save_world, save_kw, load_world, load_kw, tol=1e-12):
    torch.set_default_dtype(torch.float64)
    try:
        ref = run_distributed(straight, load_world, load_kw)
        run_distributed(first_half, save_world, str(tmp_path), save_kw)
        resumed = run_distributed(second_half, load_world, str(tmp_path), load_kw)
    finally:
        torch.set_default_dtype(torch.float32)
    for (a, ca), (b, cb) in zip(ref, resumed):
        assert ca == cb and set(a) == set(b)
        for name in a:
            diff = float((a[name][0] - b[name][0]).abs().max())
            assert diff <= tol, f"{name}: {diff:.3e} after resuming {save_kw} -> {load_kw} ({TOTAL} steps)"


def test_moe_dist_resume_at_another_expert_parallel_size(tmp_path):
    """Saved at EP 2, resumed at EP 1 (and the reverse): the end state equals a straight run."""
    for save_ep, load_ep in ((2, 1), (1, 2)):
        _resume_elsewhere(tmp_path / f"ep{save_ep}to{load_ep}", 2, _dist(save_ep), 2, _dist(load_ep))


def test_moe_dist_resume_at_another_pipeline_size(tmp_path):
    """Saved at PP 1 x EP 2 on 2 ranks, resumed at PP 2 x EP 2 on 4 (layers by global index)."""
    _resume_elsewhere(tmp_path, 2, _dist(2), 4, _dist(2, pp=2))


def test_moe_dist_resume_with_distributed_optimizer(tmp_path):
    """EP 2 on 4 ranks (expert-DP 2) with --use-distributed-optimizer: the experts' moments are
    sharded over the expert-DP group, gathered whole at the save; the resume is bit-identical."""
    assert_resume_bit_exact(tmp_path, 4, _dist(2, dist_opt=True), check_saved=_saved_state_is_whole)
