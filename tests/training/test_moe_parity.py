"""Mixture of experts: every expert-parallel layout equals the single-process run (float64, the
parity method of tests/parity_utils.py): losses (aux and z-loss included, they change the
gradients), grad norms, step-1 gradients and the parameters after the steps.

Tiny model: 2 layers, 4 experts, top-2, 2 iterations of 4 micro-batches. Expert weights are
gathered from the EP ranks of the first expert-data-parallel replica (global expert order),
everything else from DP rank 0 as in the dense tests.
"""
import pytest

from megatron.config.moe import MoEConfig
from megatron.models.moe.layer import moe_layers
from tests.dist_harness import run_distributed
from tests.parity_utils import _global_name, assert_parity, make_trainer, shards, tiny_config, train_and_record

pytestmark = pytest.mark.parity

BASE = dict(num_experts=4, router_topk=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
VARIANTS = {
    # dropless, softmax after top-k, aux loss and z-loss
    "dropless": dict(),
    # capacity 1.0 drops tokens (probs policy), per rank before the exchange
    "capacity": dict(expert_capacity_factor=1.0),
    # capacity, position policy, padded to capacity
    "capacity_pad": dict(expert_capacity_factor=1.0, token_drop_policy="position", pad_expert_input_to_capacity=True),
    # DeepSeek-V3 style: sigmoid scores, expert bias, sequence aux loss, shared expert, MoE every other layer
    "deepseek": dict(router_score_function="sigmoid", router_enable_expert_bias=True,
                     router_load_balancing_type="seq_aux_loss", shared_expert_intermediate_size=48,
                     router_bias_update_rate=1e-2, layer_freq=[0, 1]),
}


def moe_shards(trainer, what: str) -> dict:
    """`shards` with the experts taken from every EP rank of the first expert-DP replica."""
    ps = trainer.ps
    expert_names = {_global_name(stage, n) for stage in trainer.stages.values()
                    for n, p in stage.named_parameters() if getattr(p, "expert_parallel", False)}
    out = {k: v for k, v in shards(trainer, what).items() if k not in expert_names}
    if ps.edp_rank == 0:
        for stage in trainer.stages.values():
            for name, p in stage.named_parameters():
                if getattr(p, "expert_parallel", False):
                    t = p.detach() if what == "param" else p.grad.detach()
                    out[_global_name(stage, name)] = (t.clone(), 0, ps.ep_rank)
    return out


def run_moe(rank, world, variant, ep=1, dispatcher="alltoall", grouped=False, layers=2, **layout):
    moe = MoEConfig(**{**BASE, **VARIANTS[variant]}, expert_model_parallel_size=ep,
                    token_dispatcher_type=dispatcher, grouped_gemm=grouped)
    cfg = tiny_config(world=world, layers=layers, iters=2, arch=dict(moe=moe, **layout.pop("arch", {})), **layout)
    trainer = make_trainer(cfg)
    out = train_and_record(trainer, world, get=lambda what: moe_shards(trainer, what))
    out["expert_bias"] = {m.layer_number: m.router.expert_bias.clone() for m in moe_layers(trainer.modules)
                          if m.router.expert_bias is not None}
    return out


_REFS = {}


def reference(variant):
    if variant not in _REFS:
        _REFS[variant] = run_distributed(run_moe, 1, variant)
    return _REFS[variant]


LAYOUTS = {
    "ep2_alltoall": (2, dict(ep=2)),
    "ep4_alltoall": (4, dict(ep=4)),
    "ep2_allgather": (2, dict(ep=2, dispatcher="allgather")),
    "ep4_allgather": (4, dict(ep=4, dispatcher="allgather")),
    "ep2_dp2": (4, dict(ep=2)),  # EDP 2: expert gradients summed over the expert-data-parallel group
    "ep2_pp2": (4, dict(ep=2, pp=2)),
    "ep2_pp2_gpipe": (4, dict(ep=2, pp=2, schedule="gpipe")),
    # split backward: the input pass runs the all-to-all backward, the weight pass the expert GEMMs
    "ep2_pp2_zbh1": (4, dict(ep=2, pp=2, schedule="zb-h1")),
    "ep2_pp2_zbh2": (4, dict(ep=2, pp=2, schedule="zb-h2")),
    "dp2": (2, dict()),
    "ep2_full_recompute": (2, dict(ep=2, recompute="full")),  # the all-to-alls run again in the backward
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("variant", ["dropless", "capacity"])
def test_expert_parallel_matches_single_process(variant, layout):
    world, kwargs = LAYOUTS[layout]
    assert_parity(reference(variant), run_distributed(run_moe, world, variant, **kwargs))


@pytest.mark.parametrize("variant,world,kwargs", [
    ("capacity_pad", 2, dict(ep=2)),
    ("capacity_pad", 4, dict(ep=4, dispatcher="allgather")),
    ("deepseek", 2, dict(ep=2)),
    ("deepseek", 4, dict(ep=2, pp=2)),
])
def test_routing_variants_match_single_process(variant, world, kwargs):
    ref = reference(variant)
    got = run_distributed(run_moe, world, variant, **kwargs)
    assert_parity(ref, got)
    if variant == "deepseek":  # the bias moved, identically (counts summed over the whole stage)
        bias_ref = ref[0]["expert_bias"]
        assert bias_ref and all(float(b.abs().sum()) > 0 for b in bias_ref.values())
        seen = set()
        for o in got:
            for layer, b in o["expert_bias"].items():
                assert b.equal(bias_ref[layer]), f"layer {layer}: expert bias {b.tolist()} != {bias_ref[layer]}"
                seen.add(layer)
        assert seen == set(bias_ref)


def test_tensor_parallel_with_sequence_parallel():
    """TP 2 + SP (each TP rank routes its own half of the sequence, the router's and experts'
    gradients summed over TP), and EP 2 folded onto the same two ranks. Dropless: capacity is
    per rank's tokens, which TP halves, so dropping differs from one process by design."""
    ref = reference("dropless")
    sp = dict(arch=dict(sequence_parallel=True))
    assert_parity(ref, run_distributed(run_moe, 2, "dropless", tp=2, **sp))
    assert_parity(ref, run_distributed(run_moe, 2, "dropless", tp=2, ep=2, **sp))


def test_interleaved_schedule_with_expert_parallelism():
    """EP 2 x PP 2 with two model chunks per pipeline rank (the interleaved 1F1B schedule)."""
    ref = run_distributed(run_moe, 1, "capacity", layers=4)
    assert_parity(ref, run_distributed(run_moe, 4, "capacity", layers=4, ep=2, pp=2, vpp_layers=1))


def test_zero_bubble_v_schedule_with_expert_parallelism():
    """EP 2 x PP 2 with zb-v (two stages per pipeline rank in a V, split backward)."""
    ref = run_distributed(run_moe, 1, "capacity", layers=4)
    assert_parity(ref, run_distributed(run_moe, 4, "capacity", layers=4, ep=2, pp=2, schedule="zb-v"))


def _run_distopt(rank, world, variant, **layout):
    from megatron.core import distributed_optimizer as D
    import tests.parity_utils as U
    make = U.make_trainer

    def with_distopt(cfg):
        cfg.training.use_distributed_optimizer = True
        t = make(cfg)
        assert isinstance(t.optimizer, D.DistributedOptimizer)
        return t
    globals()["make_trainer"] = with_distopt
    try:
        return run_moe(rank, world, variant, **layout)
    finally:
        globals()["make_trainer"] = make


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_distributed_optimizer_with_expert_parallelism(world, ep):
    """The distributed optimizer shards the experts over the expert-data-parallel group (EDP 1
    at 2 ranks, EDP 2 at 4) and the dense parameters over DP."""
    # (gradients stay unreduced in .grad: the optimizer reduce-scatters them into its shards, so
    # the losses, grad norms and parameters after each step are what is compared)
    assert_parity(reference("capacity"), run_distributed(_run_distopt, world, "capacity", ep=ep), compare_grads=False)
