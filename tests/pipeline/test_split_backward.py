"""The split backward in the instruction set: wire format, lowering and validator rules, and
the executor running BackwardInput / BackwardWeight exactly like one BackwardPass."""
import dataclasses

import pytest
import torch
from torch import nn

from megatron.pipeline import instructions as I
from megatron.pipeline.executor import PipelineExecutor
from megatron.pipeline.validator import PlanValidationError, kept_peaks, validate_plans
from megatron.planner.schedule.static import build_static_plans

SHAPES = [((2, 4),)] * 3
ACT = ((4, 2, 8),)


def _plans(schedule, m=3, pp=2, chunks=1):
    return build_static_plans(schedule, m, pp, chunks, [((2, 4),)] * m, ACT)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_split_plans_roundtrip_as_version_5_and_old_plans_keep_their_bytes(schedule):
    for plan in _plans(schedule):
        data = plan.serialize()
        assert int.from_bytes(data[4:6], "little") == 5
        back = I.ExecutionPlan.deserialize(data)
        assert back.instructions == plan.instructions
        assert any(isinstance(x, I.BackwardWeight) for x in back.instructions)
    for plan in _plans("1f1b"):
        assert int.from_bytes(plan.serialize()[4:6], "little") == 2
        with pytest.raises(ValueError, match="cannot carry a split backward"):
            I._encode_plan(_plans("zb-h1")[0], version=4)


def test_old_reader_rejects_split_tags_in_old_versions():
    plan = _plans("zb-h1")[0]
    data = bytearray(plan.serialize())
    data[4:6] = (4).to_bytes(2, "little")  # claims version 4 but carries tag 13/14
    with pytest.raises(ValueError, match="unknown instruction tag"):
        I.ExecutionPlan.deserialize(bytes(data))


def _move(plan, cls, to_index):
    instrs = list(plan.instructions)
    i = next(k for k, x in enumerate(instrs) if isinstance(x, cls))
    instr = instrs.pop(i)
    instrs.insert(to_index, instr)
    return dataclasses.replace(plan, instructions=instrs)


def test_validator_orders_weight_after_input_and_before_the_end():
    plans = _plans("zb-h1")
    first_w = next(k for k, x in enumerate(plans[1].instructions) if isinstance(x, I.BackwardWeight))
    bad = [plans[0], _move(plans[1], I.BackwardWeight, 0)]
    with pytest.raises(PlanValidationError, match="no BackwardInput of it ran before"):
        validate_plans(bad)
    dropped = dataclasses.replace(plans[1], instructions=[x for k, x in enumerate(plans[1].instructions)
                                                          if k != first_w])
    with pytest.raises(PlanValidationError, match="no BackwardWeight before the end of the plan"):
        validate_plans([plans[0], dropped])
    # A weight pass after a whole BackwardPass would accumulate the weight gradients twice.
    whole = [dataclasses.replace(x, instructions=[I.BackwardPass(*dataclasses.astuple(i)) if type(i) is I.BackwardInput
                                                  else i for i in x.instructions]) for x in plans]
    with pytest.raises(PlanValidationError, match="already accumulated"):
        validate_plans(whole)


def test_kept_graphs_are_bounded_and_zb_h1_keeps_1f1b_memory():
    m, pp = 6, 4
    # ZB-H1 (the paper's, torch's) keeps 1F1B's peak, rank 0's, on every rank
    assert kept_peaks(_plans("1f1b", m, pp)) == [4, 3, 2, 1]
    assert kept_peaks(_plans("zb-h1", m, pp)) == [4, 4, 4, 4]
    peaks = kept_peaks(_plans("zb-h2", m, pp))
    assert peaks[0] > 4
    with pytest.raises(PlanValidationError, match="keeps 6 forward graphs"):
        validate_plans(_plans("zb-h2", m, pp), max_kept=[4, 3, 2, 1])


def test_zb_v_places_two_stages_per_rank_in_a_v():
    plans = _plans("zb-v", m=4, pp=2, chunks=2)
    assert [p.assigned_stages for p in plans] == [(0, 3), (1, 2)]


class _Stage(nn.Module):
    """A tiny stage: tokens -> embedding on stage 0, a linear + tanh, loss on the last."""

    def __init__(self, first, last):
        super().__init__()
        self.pre_process, self.post_process = first, last
        torch.manual_seed(7 + first * 2 + last)
        self.emb = nn.Embedding(11, 8) if first else None
        self.lin = nn.Linear(8, 8)

    def forward(self, batch, inputs):
        x = self.emb(batch["tokens"]).transpose(0, 1) if self.pre_process else inputs[0]
        y = torch.tanh(self.lin(x))
        if self.post_process:
            return [(y ** 2).sum(-1).transpose(0, 1)]
        return [y]


@pytest.mark.parametrize("limit", [2, 6])
def test_executor_split_backward_equals_whole_backward_bitwise(limit):
    """Two stages on one rank (no communication): a split plan gives a whole-backward plan's
    gradients bit for bit, whether each W follows its I at once (limit 2: both stages of one micro-batch) or is deferred."""
    from megatron.pipeline.lowering import ComputeOp, lower_to_plans
    from megatron.planner.schedule.zero_bubble import greedy_zb_orders
    torch.manual_seed(0)
    mbs = [{"tokens": torch.randint(0, 11, (2, 4)), "loss_mask": torch.ones(2, 4)} for _ in range(3)]
    results = []
    for split in (False, True):
        stages = {0: _Stage(True, False), 1: _Stage(False, True)}
        if split:
            orders = greedy_zb_orders(3, [0, 0], [limit])
            assert any(op.kind == "W" for op in orders[0])
        else:
            orders = [[ComputeOp("F", mb, s) for mb in range(3) for s in (0, 1)]
                      + [ComputeOp("B", mb, s) for mb in range(3) for s in (1, 0)]]
        plans = lower_to_plans(orders, [0, 0], SHAPES, lambda mb, s: ACT)
        stats = PipelineExecutor(stages).run(plans[0], mbs, loss_multiplier=0.5)
        assert stats.backward_passes == 6
        # stage 1's input passes free what their weight passes do not read (weight_store.py)
        assert stats.slim_weight_passes == (3 if split else 0)
        assert (stats.weight_pass_freed_bytes > 0) == split
        results.append({f"{s}.{n}": p.grad.clone() for s, st in stages.items() for n, p in st.named_parameters()})
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_weight_pass_starts_at_the_boundaries_and_matches_the_whole_backward_bitwise():
    from megatron.pipeline.split_backward import WeightPlan
    torch.manual_seed(3)
    net = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(4, 8)

    def run(split):
        net.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_(True)
        loss = (net(inp) ** 2).sum()
        if not split:
            loss.backward()
            return inp.grad, [p.grad.clone() for p in net.parameters()]
        plan = WeightPlan.build([loss], [inp], list(net.parameters()))
        assert plan is not None and len(plan.boundaries) == 3  # the norm and the two linears
        (gx,) = torch.autograd.grad(loss, inp, retain_graph=True)
        plan.remove_hooks()
        assert all(p.grad is None for p in net.parameters())  # the input pass leaves weights alone
        assert plan.run()
        return gx, [p.grad.clone() for p in net.parameters()]
    (gx0, g0), (gx1, g1) = run(False), run(True)
    assert torch.equal(gx0, gx1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_weight_pass_keeps_the_whole_walk_for_foreign_leaves_and_inputless_stages():
    from megatron.pipeline.split_backward import WeightPlan
    lin, foreign = nn.Linear(4, 4), nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    assert WeightPlan.build([(lin(x) @ foreign).sum()], [x], list(lin.parameters())) is None
    assert WeightPlan.build([lin(x.detach()).sum()], [x.detach()], list(lin.parameters())) is None


def _freed_output_rank(rank, world):
    """Stages 0, 1 on rank 0 and 2 on rank 1, split backward: stage 1's output (a tanh result,
    which autograd saves for tanh's backward) is sent, then emptied (free_sent_activations)."""
    import torch.distributed as dist

    from megatron.pipeline.lowering import lower_to_plans
    from megatron.pipeline.p2p import P2PCommunicator
    from megatron.planner.schedule.zero_bubble import greedy_zb_orders
    torch.manual_seed(0)
    mbs = [{"tokens": torch.randint(0, 11, (2, 4)), "loss_mask": torch.ones(2, 4)} for _ in range(3)]
    where = [0, 0, 1]
    plans = lower_to_plans(greedy_zb_orders(3, where, [4, 4]), where, SHAPES, lambda mb, s: ACT)
    stages = {s: _Stage(s == 0, s == 2) for s in range(3) if where[s] == rank}
    ex = PipelineExecutor(stages, P2PCommunicator([0, 1], rank, group=dist.group.WORLD))
    stats = ex.run(plans[rank], mbs, loss_multiplier=0.5)
    return stats.slim_weight_passes, {f"{s}.{n}": p.grad.clone() for s, st in stages.items()
                                      for n, p in st.named_parameters()}


def test_weight_store_survives_emptying_a_sent_output_that_autograd_saved():
    from tests.dist_harness import run_distributed
    got = run_distributed(_freed_output_rank, 2, timeout_s=60)
    assert got[0][0] == 3  # stage 1's input passes ran the weight store
    grads = {**got[0][1], **got[1][1]}
    torch.manual_seed(0)
    mbs = [{"tokens": torch.randint(0, 11, (2, 4)), "loss_mask": torch.ones(2, 4)} for _ in range(3)]
    stages = {s: _Stage(s == 0, s == 2) for s in range(3)}
    for mb in mbs:  # the reference: one whole backward per micro-batch, one process
        x = stages[0](mb, [])[0]
        x = stages[1](mb, [x])[0]
        loss = (stages[2](mb, [x])[0] * mb["loss_mask"]).sum() * 0.5
        loss.backward()
    for s, st in stages.items():
        for n, p in st.named_parameters():
            assert torch.allclose(grads[f"{s}.{n}"], p.grad, rtol=1e-6, atol=1e-7), f"{s}.{n}"


class _BiasTanh(torch.autograd.Function):
    """A fused-kernel-like Function: computes the bias gradient whether or not it is needed."""

    @staticmethod
    def forward(ctx, bias, x):
        ctx.save_for_backward(bias, x)
        return torch.tanh(x + bias)

    @staticmethod
    def backward(ctx, g):
        bias, x = ctx.saved_tensors
        gx = g * (1 - torch.tanh(x + bias) ** 2)
        return gx.reshape(-1, gx.shape[-1]).sum(0), gx


def test_custom_function_bias_gradient_comes_from_the_input_pass_and_its_state_is_freed():
    from megatron.pipeline.split_backward import WeightPlan
    from megatron.pipeline.weight_store import SavedBoxes
    torch.manual_seed(5)
    lin1, lin2 = nn.Linear(8, 16, bias=False), nn.Linear(16, 8)
    bias = nn.Parameter(torch.randn(16))
    params = [lin1.weight, bias, lin2.weight, lin2.bias]
    x = torch.randn(6, 8)

    def run(split):
        for p in params:
            p.grad = None
        inp = x.clone().requires_grad_(True)
        boxes = SavedBoxes()
        with boxes.hooks():
            pre = lin1(inp)
            loss = (lin2(_BiasTanh.apply(bias, pre)) ** 2).sum()
        if not split:
            loss.backward()
            return inp.grad, [p.grad.clone() for p in params], None
        plan = WeightPlan.build([loss], [inp], params)
        assert plan is not None and len(plan.eager) == 1
        (gx,) = torch.autograd.grad(loss, inp, retain_graph=True)
        plan.remove_hooks()
        assert plan.complete() and all(p.grad is None for p in params)
        boxes.release(plan.nodes)
        kept = {t.untyped_storage().data_ptr() for t in boxes.tensors()}
        assert pre.untyped_storage().data_ptr() not in kept  # the Function's input: freed
        assert plan.run()
        return gx, [p.grad.clone() for p in params], kept
    (gx0, g0, _), (gx1, g1, _) = run(False), run(True)
    assert torch.equal(gx0, gx1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
