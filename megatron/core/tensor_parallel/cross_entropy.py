"""Cross-entropy over vocabulary-parallel logits without gathering the vocabulary.

Forward: all-reduce MAX of the logits, pick the target logit on the rank that owns it,
all-reduce SUM of the target logit and of sum(exp); loss = log(sum exp) - target.
Backward: softmax - one_hot, computed locally.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
        tp = group_size(group)
        per = logits.shape[-1]
        start = group_rank(group) * per
        if vocab_size is not None and start + per > vocab_size:
            # Padding columns exist only to make the vocabulary divisible; they must not take
            # probability mass, or the loss would depend on the TP degree.
            logits = logits.clone()
            logits[..., max(vocab_size - start, 0):] = float("-inf")
        logits_max = logits.max(dim=-1)[0]
        if tp > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + per)
        local_t = (target - start).masked_fill(outside, 0)
        pred = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if tp > 1:
            both = torch.stack([pred, sum_exp])
            dist.all_reduce(both, group=group)
            pred, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - pred
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, outside = ctx.saved_tensors
        # Out of place: a split backward (zero-bubble schedules) walks this graph twice, so the
        # saved softmax must survive the first walk. One temporary, as before.
        g = softmax.scatter_add(-1, local_t.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
        return g.mul_(grad.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab_size=None) -> torch.Tensor:
    """Per-token loss (fp32) of shape target.shape; columns >= vocab_size are padding."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)
