"""A MoE run (EP 1, DP 2) saved half-way and resumed ends bit-identical to the straight run:
experts, router and the expert-bias buffer (which steers routing) are in the checkpoint.
(EP > 1 refuses --save/--load for now: tests/cli/test_arguments_moe.py.)"""
import glob

import torch

from megatron.config.moe import MoEConfig
from tests.resume_harness import assert_resume_bit_exact


def _saved_bias_is_nonzero(root):
    (path,) = glob.glob(str(root / "iter_*" / "mp_rank_00" / "model_optim_rng.pt"))
    model = torch.load(path, weights_only=True)["model"]
    biases = [t for sd in model.values() for k, t in sd.items() if k.endswith("router.expert_bias")]
    # a bias of 0 at the save would make a lost bias invisible to the resume comparison
    assert len(biases) == 2 and all(float(b.abs().sum()) > 0 for b in biases), biases


def test_moe_resume_is_bit_exact(tmp_path):
    # rate below the spread of the tiny model's sigmoid scores: the bias reroutes some tokens
    # without flipping every choice back and forth (which can return it to 0 after two steps)
    moe = MoEConfig(num_experts=4, router_score_function="sigmoid", router_enable_expert_bias=True,
                    router_bias_update_rate=3e-3, aux_loss_coeff=1e-2, expert_capacity_factor=1.0)
    assert_resume_bit_exact(tmp_path, 2, dict(layers=2, dropout=0.0, arch=dict(moe=moe)),
                            check_saved=_saved_bias_is_nonzero)
