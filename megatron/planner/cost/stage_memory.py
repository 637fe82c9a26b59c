"""Activation memory of the pieces of a first and a last pipeline stage that are not layers:
pre-process (word + position embedding, dropout) and post-process (final norm, output head,
vocabulary-parallel cross entropy), per micro-batch, in MB.

Where the cost-model file has the columns (``preprocess`` / ``postprocess`` with ``stored_mb``
and ``peak_mb``; `megatron.profiling` measures them) those are used. The published A100 tables
have no such columns, so the terms come from the model shape, by the formulas below. They
count what this project's code keeps and allocates (`GPTEmbedding`, `GPTStage`'s head and
`vocab_parallel_cross_entropy`), per token, with ``a`` the activation element size, ``h`` the
hidden size, ``v`` the padded vocabulary over TP, ``a16 = a`` for 16-bit activations (the head
casts its logits to fp32, a copy) and 0 for fp32 (the cast is a no-op):

* pre stored: token ids (8 bytes) + position ids (8, upper bound) + the dropout mask (h x a);
* pre peak: the embedding weight's dense gradient (v x h x a, once) + 4 x h x a per token
  (3 when the micro-batch has one sample: the [b, s, h] -> [s, b, h] transpose is then no copy);
* post stored: the fp32 softmax (4 v) + the final norm's input and output (2 h a) + 17 bytes
  (int64 local targets, a bool mask, fp32 norm statistics);
* post peak: stored's 2 h a + 17, plus the largest of: the forward's logits, fp32 copy,
  shifted logits and exponentials ((12 + a16) v); the loss backward's softmax and its
  gradient (8 v); the head's backward: the logits gradient (4 + a16) v and the weight's
  dense gradient (v x h x a, once).

`tests/planner/cost/test_stage_memory.py` checks the formulas against the profiled CPU columns
(a = 4) within a few percent; a 16-bit run on a GPU would confirm the a16 terms.
"""
from __future__ import annotations

import warnings

import numpy as np

from megatron.planner.cost.cost_model import CostModel

MB = 1e6
_warned = set()


def _grid_memory(cm: CostModel, component: str, tp: int, rc: str, mbs, seq):
    """(stored, peak) MB from the file's columns, or None when it has none."""
    prof = cm.profile(tp, rc) if cm.has(tp, rc) else None
    grid = prof.components.get(component) if prof is not None else None
    if grid is None or "stored_mb" not in grid.values or "peak_mb" not in grid.values:
        return None
    q = grid(mbs, seq)
    return q["stored_mb"], q["peak_mb"]


def _shape(cm: CostModel, tp: int):
    h, vocab = cm.model.get("hidden_size"), cm.model.get("padded_vocab_size")
    if not vocab and cm.model.get("vocab_size"):  # Megatron's padding: a multiple of 128 x TP
        vocab = -(-int(cm.model["vocab_size"]) // (128 * tp)) * 128 * tp
    if not h or not vocab:
        if cm.name not in _warned:
            _warned.add(cm.name)
            warnings.warn(f"cost model {cm.name!r} has neither pre/post-process memory columns nor "
                          f"model.hidden_size and model.vocab_size: embedding, head and loss memory "
                          f"are not charged (add model.vocab_size to the file)", stacklevel=3)
        return None
    return float(h), float(vocab) / tp


def pre_formula(mbs, seq, h: float, v: float, a: float):
    """(stored, peak) bytes of the embedding by the formula in the module docstring."""
    mbs = np.asarray(mbs, float)
    tokens = mbs * np.asarray(seq, float)
    copies = np.where(mbs > 1, 4.0, 3.0)  # [b, s, h] -> [s, b, h] is a copy only when b > 1
    return tokens * (16.0 + h * a), v * h * a + tokens * (16.0 + copies * h * a)


def post_formula(mbs, seq, h: float, v: float, a: float):
    """(stored, peak) bytes of final norm + head + loss by the formula in the module docstring."""
    tokens = np.asarray(mbs, float) * np.asarray(seq, float)


    a16 = a if a < 4 else 0.0
    base = tokens * (2.0 * h * a + 17.0)
    work = np.maximum(np.maximum(tokens * v * (12.0 + a16), tokens * v * 8.0), v * h * a + tokens * v * (4.0 + a16))
    return base + tokens * 4.0 * v, base + work


def _memory(which, cm: CostModel, tp: int, rc: str, mbs, seq, activation_bytes: int):
    got = _grid_memory(cm, "preprocess" if which == "pre" else "postprocess", tp, rc, mbs, seq)
    if got is not None:
        return got
    shape = _shape(cm, tp)
    if shape is None:
        zero = np.asarray(mbs, float) * np.asarray(seq, float) * 0.0
        return zero, zero
    stored, peak = (pre_formula if which == "pre" else post_formula)(mbs, seq, *shape, float(activation_bytes))
    return stored / MB, peak / MB


def preprocess_memory(cm: CostModel, tp: int, rc: str, mbs, seq, activation_bytes: int):
    """(stored, peak) MB of the embedding for micro-batches of `mbs` x `seq` tokens."""
    return _memory("pre", cm, tp, rc, mbs, seq, activation_bytes)


def postprocess_memory(cm: CostModel, tp: int, rc: str, mbs, seq, activation_bytes: int):
    """(stored, peak) MB of final norm + output head + loss on `mbs` x `seq` tokens."""
    return _memory("post", cm, tp, rc, mbs, seq, activation_bytes)


def encoder_end_memory(cm: CostModel, mbs, seq, activation_bytes: int):
    """(stored, peak) MB of T5's encoder-final norm on the last encoder stage: it keeps its
    input and fp32 mean and inverse deviation per token; while it runs its output is live too.
    Analytic for every table (the profiles do not run it)."""
    tokens = np.asarray(mbs, float) * np.asarray(seq, float)
    h, a = float(cm.model.get("hidden_size") or 0), float(activation_bytes)
    stored = tokens * (h * a + 8.0)
    return stored / MB, (stored + tokens * h * a) / MB


def tied_head_grad_mb(cm: CostModel, tp: int, activation_bytes: int) -> float:
    """MB of the output head's weight gradient, [V/tp, h]. On a stage that also embeds with
    the same (tied) weight, autograd holds it from the head's backward until the embedding's
    backward adds its own, at the very end of the stage's backward; then both and their sum
    are live (measured: a T5 decoder stage or a one-stage GPT peaks at 3 such gradients at
    small shapes). 0 when the shape is unknown."""
    shape = _shape(cm, tp)
    return 0.0 if shape is None else shape[0] * shape[1] * float(activation_bytes) / MB


def with_tied_head(parts, pre_index, grad_mb: float):
    """`parts` of a stage that embeds and runs the tied head: every piece before the head runs
    its backward with the head's weight gradient held (+1), the embeddings with their own
    dense gradient and the sum besides (+2)."""
    out = []
    for i, (st, pk) in enumerate(parts[:-1]):
        out.append((st, pk + (2.0 if i in pre_index else 1.0) * grad_mb))
    return out + [parts[-1]]


def compose(parts):
    """Stored and peak of pieces run in order on one stage ([(stored, peak)], forward order).

    While a piece runs, everything before it keeps its stored memory; the backward visits
    the pieces in reverse, when everything after has been freed. So the stage peaks at the
    largest `stored of the pieces before + peak of the piece`."""
    st, pk = 0.0, None
    for s, p in parts:
        here = st + p
        pk = here if pk is None else np.maximum(pk, here)
        st = st + s
    return st, pk
