"""MoE checkpoints in the `torch` format: the file holds every expert (gathered over the EP
group), so a run resumes bit-identically at its own EP size (EP 1 and EP 2) and continues at
another EP size exactly as a straight run at that size would, up to float64 roundoff."""
import glob

import torch

from megatron.config.moe import MoEConfig
from tests.dist_harness import run_distributed
from tests.resume_harness import TOTAL, assert_resume_bit_exact, first_half, second_half, straight

# rate below the spread of the tiny model's sigmoid scores: the bias reroutes some tokens
# without flipping every choice back and forth (which can return it to 0 after two steps)
MOE = dict(num_experts=4, router_score_function="sigmoid", router_enable_expert_bias=True,
           router_bias_update_rate=3e-3, aux_loss_coeff=1e-2, expert_capacity_factor=1.0)


def _kw(ep):
    return dict(layers=2, dropout=0.0, arch=dict(moe=MoEConfig(**MOE, expert_model_parallel_size=ep,
                                                               token_dispatcher_type="alltoall")))


def _saved_state_is_whole(root):
    (path,) = glob.glob(str(root / "iter_*" / "mp_rank_00" / "model_optim_rng.pt"))
    state = torch.load(path, weights_only=True)
    model = state["model"]
    biases = [t for sd in model.values() for k, t in sd.items() if k.endswith("router.expert_bias")]
    # a bias of 0 at the save would make a lost bias invisible to the resume comparison
    assert len(biases) == 2 and all(float(b.abs().sum()) > 0 for b in biases), biases
    experts = [t for sd in model.values() for k, t in sd.items() if k.endswith("experts.weight1")]
    assert len(experts) == 2 and all(t.shape[0] == 4 for t in experts)  # every expert, whatever the EP
    moments = [st["exp_avg"] for st in state["optimizer"]["optimizer"]["state"].values()]
    assert sum(m.shape[0] == 4 and m.ndim == 3 for m in moments) == 4  # weight1 and weight2 of 2 layers


def test_moe_resume_is_bit_exact(tmp_path):
    assert_resume_bit_exact(tmp_path, 2, _kw(1), check_saved=_saved_state_is_whole)


def test_moe_resume_at_ep2_is_bit_exact(tmp_path):
    assert_resume_bit_exact(tmp_path, 2, _kw(2), check_saved=_saved_state_is_whole)


def test_resume_at_another_expert_parallel_size(tmp_path):
    """Saved at EP 2, resumed at EP 1 (and the reverse): the end state equals a straight run."""
    torch.set_default_dtype(torch.float64)
    try:
        for save_ep, load_ep in ((2, 1), (1, 2)):
            root = tmp_path / f"ep{save_ep}to{load_ep}"
            ref = run_distributed(straight, 2, _kw(load_ep))
            run_distributed(first_half, 2, str(root), _kw(save_ep))
            resumed = run_distributed(second_half, 2, str(root), _kw(load_ep))
            for (a, ca), (b, cb) in zip(ref, resumed):
                assert ca == cb and set(a) == set(b)
                for name in a:
                    diff = float((a[name][0] - b[name][0]).abs().max())
                    assert diff <= 1e-12, f"{name}: {diff:.3e} after resuming EP {save_ep} -> {load_ep} ({TOTAL} steps)"
    finally:
        torch.set_default_dtype(torch.float32)
