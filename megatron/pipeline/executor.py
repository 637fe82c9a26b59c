"""Runs one rank's `ExecutionPlan`: the only thing that drives forward and backward passes.

The executor does not know which planner wrote the plan. It keeps:
* `slots`: buffer id -> list of tensors (received activations/gradients, outputs to send),
* `records`: (microbatch, stage) -> (inputs, outputs) of a forward, until its backward,
* pending non-blocking sends/receives, completed by the plan's `*Finish` instructions.

The last stage turns per-token losses into `sum(loss * loss_mask) * loss_multiplier`, where the
trainer sets the multiplier to loss_scale / (loss tokens in the whole global batch): whatever
micro-batches the planner made, gradients equal those of one big batch.

Token slices (TeraPipe): an instruction with `token_slice = (sequence, offset, length)` runs
tokens [offset, offset+length) of micro-batch `sequence`. The executor keeps one
`SequenceKVCache` per (sequence, stage) from the first slice's forward to the first slice's
backward; a slice's backward also receives the gradients of its keys/values that later slices
sent back (see megatron/models/sliced_attention.py).

Batch splits (stages with different TP / DP sizes): a message with `batch_slice = (first,
count)` carries rows [first, first+count) of the micro-batch, dimension 1 of [s, b, h] (and
with 4 entries also a token range, dimension 0: sequence parallelism). The executor finds the
block in its buffer with `_local_block()`; a send ships the slice of its buffer,
a receive buffer is allocated whole at its first piece and filled as the pieces finish. A
compressed piece (compress_rank) is encoded once per (micro-batch, stage, rows), whatever the
number of peers it goes to, and decoded to its rows before they are written.

Split backward (zero-bubble schedules): `BackwardInput` runs the autograd engine from the
stage's outputs restricted to the stage's inputs (no parameter gradient is computed or
accumulated, so the weight GEMMs are skipped) and keeps the graph; `BackwardWeight` later runs
the engine again over the kept graph, accumulating the parameter gradients exactly as a
`BackwardPass` would (same graph, same grads, same accumulation hooks: the overlapped DP
reduction sees each parameter's final gradient at its last BackwardWeight). Without recompute
the weight pass starts at the weight side of the graph (gradients the input pass captured at
its boundary nodes, `split_backward.py`): only the weight GEMMs run again. With recompute, on
stage 0 and where a parameter is shared, it walks the kept graph again from the outputs
(segments replayed, RNG restored; TP/SP collectives of the graph run in both walks, on every
TP rank in the same plan order).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from megatron.core import heartbeat
from megatron.pipeline import instructions as I
from megatron.pipeline.p2p import DTYPES, P2PCommunicator
from megatron.pipeline.split_backward import WeightPlan
from megatron.pipeline.weight_store import SavedBoxes, unique_bytes
from megatron.models.sliced_attention import SequenceKVCache

SLICED_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def slice_batch(batch: dict, offset: int, length: int) -> dict:
    """Tokens [offset, offset+length) of a GPT micro-batch, with explicit position ids. Packed
    rows keep the segment ids of the whole prefix [0, offset+length): a query of the slice
    attends to the earlier tokens of its own document, cached keys of earlier slices included."""
    out = {}
    for key, v in batch.items():
        if key in SLICED_KEYS and torch.is_tensor(v):
            out[key] = v[:, offset:offset + length]
        elif key == "segment_ids" and torch.is_tensor(v):
            out[key] = v[:, :offset + length]
        elif key in ("num_real_tokens", "cu_seqlens", "max_seqlen"):
            continue
        else:
            out[key] = v
    if "position_ids" not in out:
        b = batch["tokens"].shape[0]
        out["position_ids"] = torch.arange(offset, offset + length, device=batch["tokens"].device).expand(b, length)
    return out


class PlanExecutionError(RuntimeError):
    pass


@dataclass
class ExecutionStats:
    # [sum of masked per-token losses (unscaled), loss tokens] on the last stage, float64 on the
    # device, summed there so that no micro-batch waits for the host; None on other stages.
    loss_totals: Optional[torch.Tensor] = None
    forward_passes: int = 0
    backward_passes: int = 0
    peak_live_records: int = 0
    # Pipeline bytes this rank put on the wire; grad_bytes_raw is what the gradient messages
    # would have been without compression.
    act_bytes: int = 0
    grad_bytes: int = 0
    grad_bytes_raw: int = 0
    # Deferred weight passes that kept only what they read (weight_store.py), and the bytes
    # the input passes freed from their graphs (saved storages W does not read).
    slim_weight_passes: int = 0
    weight_pass_freed_bytes: int = 0

    @property
    def loss_sum(self) -> float:  # reading it waits for the device
        return float(self.loss_totals[0]) if self.loss_totals is not None else 0.0

    @property
    def loss_tokens(self) -> float:
        return float(self.loss_totals[1]) if self.loss_totals is not None else 0.0


def _run_backward(outputs: List[torch.Tensor], grads: List[Optional[torch.Tensor]]) -> None:
    """Backward that tolerates outputs whose data was freed after sending (Megatron's trick):
    the autograd engine only needs their grad_fn, not their values."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
    if not pairs:
        return
    outs, gs = zip(*pairs)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=outs, grad_tensors=gs, keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


def _input_grads(outputs, grads, inputs) -> list:
    """Gradients w.r.t. `inputs` only, keeping the graph for the weight pass. None where an
    input does not reach the outputs."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
    want = [t for t in inputs if t.requires_grad]
    if not pairs or not want:
        return [None] * len(inputs)
    outs, gs = zip(*pairs)
    got = iter(torch.autograd.Variable._execution_engine.run_backward(
        tensors=outs, grad_tensors=gs, keep_graph=True, create_graph=False, inputs=tuple(want),
        allow_unreachable=True, accumulate_grad=False))
    return [next(got) if t.requires_grad else None for t in inputs]


def _free_data(t: torch.Tensor) -> None:
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


class PipelineExecutor:
    def __init__(self, stages: Dict[int, nn.Module], comm: Optional[P2PCommunicator] = None, *,
                 rank_desc: str = "rank 0", autocast_dtype: Optional[torch.dtype] = None,
                 device: torch.device = torch.device("cpu"), comm_dtype: torch.dtype = torch.float32,
                 free_sent_activations: bool = True, grad_compressor=None):
        self.stages = stages
        self.comm = comm
        self.rank_desc = rank_desc
        self.autocast_dtype = autocast_dtype
        self.device = device
        self.comm_dtype = comm_dtype
        self.free_sent_activations = free_sent_activations
        # Encodes/decodes gradient messages the plan marks with compress_rank (Optimus-CC);
        # created on first use when the trainer did not configure one (no error feedback).
        self.grad_compressor = grad_compressor
        # Token slices: seed of the slice-keyed dropout masks (None = no keyed dropout; the
        # TeraPipe trainer sets it, distinct per data-parallel rank).
        self.dropout_seed: Optional[int] = None
        # A list to receive one Chrome-trace event per instruction of the next run() (measured
        # timeline; on CUDA each compute instruction is synchronised so its span is GPU time).
        self.trace_events: Optional[list] = None
        # BackwardWeight starts at the weight side of the kept graph (megatron/pipeline/
        # split_backward.py) instead of walking the whole graph again; False: always walk it.
        self.split_weight_pass = True

    # -- helpers -------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def run(self, plan: I.ExecutionPlan, microbatches: List[dict], loss_multiplier: float,
            forward_only: bool = False) -> ExecutionStats:
        self.slots: Dict[int, List[torch.Tensor]] = {}
        self.records: Dict[tuple, tuple] = {}
        self.deferred: Dict[tuple, tuple] = {}  # (mb, stage) -> (outputs, grads) kept for BackwardWeight
        self.data: Dict[int, dict] = {}
        self.sends: Dict[tuple, object] = {}
        self.recvs: Dict[tuple, object] = {}
        self.kv_caches: Dict[tuple, SequenceKVCache] = {}
        self.slice_records: Dict[tuple, object] = {}
        self.assembling: Dict[int, int] = {}  # slot -> rows still to arrive (batch-split receives)
        # (microbatch, stage, batch_slice) -> factors of a compressed piece: a piece that goes to
        # several peers (the TP ranks of the previous stage) is encoded once, so they all decode
        # the same gradient and error feedback counts it once.
        self.encoded: Dict[tuple, list] = {}
        self.plan = plan
        # Forwards whose BackwardInput runs the weight plan save into boxes, so that the input
        # pass can free everything the deferred weight pass does not read (weight_store.py).
        self.boxes: Dict[tuple, SavedBoxes] = {}
        self.box_keys = set()
        if self.split_weight_pass and plan.recompute == "none" and not forward_only:
            self.box_keys = {(x.microbatch, x.stage) for x in plan.instructions
                             if isinstance(x, I.BackwardInput) and x.output_buffer_ids}
        self.microbatches = microbatches
        self.loss_multiplier = loss_multiplier
        self.forward_only = forward_only
        self.stats = ExecutionStats()
        for stage_id in plan.assigned_stages:
            self.stages[stage_id].recompute = plan.recompute
        beat = heartbeat.active()
        trace = self.trace_events
        t_start = self._trace_t0 = time.perf_counter()
        for idx, ins in enumerate(plan.instructions):
            if beat is not None:
                beat.note(plan.iteration, ins, I.describe)
            if trace is not None:
                t0 = time.perf_counter()
            try:
                handler = self._HANDLERS[type(ins)]
            except KeyError:
                raise PlanExecutionError(f"{self.rank_desc}: no handler for instruction {ins!r}")
            if forward_only and isinstance(ins, (I.BackwardPass, I.BackwardInput, I.BackwardWeight, I.SendGradStart,
                                                 I.SendGradFinish, I.RecvGradStart, I.RecvGradFinish)):
                continue
            try:
                handler(self, ins)
            except PlanExecutionError:
                raise
            except Exception as e:
                raise PlanExecutionError(
                    f"{self.rank_desc}, iteration {plan.iteration}: instruction {idx} "
                    f"{type(ins).__name__}(microbatch={ins.microbatch}, stage={ins.stage}) failed: {e}") from e
            if trace is not None:
                self._trace(ins, t0 - t_start)
        if beat is not None:  # a stall in the collectives after the schedule still names its iteration
            beat.note(plan.iteration, "after the pipeline schedule (gradient reduction, optimizer step)", str)
        if self.sends or self.recvs:
            raise PlanExecutionError(
                f"{self.rank_desc}, iteration {plan.iteration}: plan ended with unfinished communication "
                f"(sends {sorted(self.sends)}, receives {sorted(self.recvs)})")
        if not forward_only and self.records:
            raise PlanExecutionError(
                f"{self.rank_desc}, iteration {plan.iteration}: forwards without backward: {sorted(self.records)}")
        if not forward_only and self.deferred:
            raise PlanExecutionError(
                f"{self.rank_desc}, iteration {plan.iteration}: BackwardInput without BackwardWeight "
                f"(the optimizer would miss their weight gradients): {sorted(self.deferred)}")
        if not forward_only and self.kv_caches:
            raise PlanExecutionError(
                f"{self.rank_desc}, iteration {plan.iteration}: token slices of (sequence, stage) "
                f"{sorted(self.kv_caches)} never ran the backward of their first slice")
        self.slots = self.records = self.deferred = self.data = self.kv_caches = self.slice_records = \
            self.assembling = {}
        self.encoded = {}
        return self.stats

    def _trace(self, ins, start_s: float) -> None:
        """One Chrome-trace event for an instruction that started `start_s` into the run."""
        compute = isinstance(ins, (I.ForwardPass, I.BackwardPass, I.BackwardInput, I.BackwardWeight))
        if compute and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end_s = time.perf_counter() - self._trace_t0
        kind = "compute" if compute else "comm" if isinstance(ins, I.CommInstruction) else "other"
        short = {I.ForwardPass: "F", I.BackwardPass: "B", I.BackwardInput: "B",
                 I.BackwardWeight: "W"}.get(type(ins), type(ins).__name__)
        self.trace_events.append({"name": f"{short}{ins.microbatch}", "cat": kind, "ph": "X",
                                  "tid": 0 if compute else 1, "ts": start_s * 1e6, "dur": (end_s - start_s) * 1e6,
                                  "args": {"stage": ins.stage, "microbatch": ins.microbatch, "type": type(ins).__name__,
                                           "peer": getattr(ins, "peer", -1)}})

    # -- instruction handlers ------------------------------------------------------------
    def _load_input(self, ins: I.LoadInput):
        if ins.microbatch not in self.data:
            if ins.token_slice:
                seq, offset, length = ins.token_slice
                batch = slice_batch(self.microbatches[seq], offset, length)
            else:
                batch = self.microbatches[ins.microbatch]
            if self.device.type == "cuda" and torch.is_tensor(batch.get("segment_ids")) and not ins.token_slice \
                    and batch["segment_ids"].device.type == "cpu" and "cu_seqlens" not in batch:
                # Packed rows: segment boundaries from the host copy, so no forward reads them
                # back from the GPU.
                from megatron.models.packed_attention import host_segments
                batch = dict(batch)
                batch["cu_seqlens"], batch["max_seqlen"] = host_segments(batch["segment_ids"])
            self.data[ins.microbatch] = {k: self._to_device(v) for k, v in batch.items()}

    def _to_device(self, v):
        """Host tensors reach the GPU from pinned memory without blocking the host."""
        if not torch.is_tensor(v) or v.device == self.device:
            return v
        if self.device.type == "cuda" and v.device.type == "cpu" and not v.is_pinned():
            v = v.pin_memory()
        return v.to(self.device, non_blocking=True)

    def _forward(self, ins: I.ForwardPass):
        stage = self.stages[ins.stage]
        batch = self.data[ins.microbatch]
        inputs = []
        for bid in ins.buffer_ids:
            for t in self.slots[bid]:
                t = t.detach()
                if t.is_floating_point() and not self.forward_only:
                    t.requires_grad_(True)
                inputs.append(t)
        grad_ctx = torch.no_grad() if self.forward_only else contextlib.nullcontext()
        cache = None
        if ins.token_slice:
            seq, offset, length = ins.token_slice
            cache = self.kv_caches.get((seq, ins.stage))
            if cache is None:
                salt = None
                if self.dropout_seed is not None:
                    salt = (self.dropout_seed * 1_000_003 + self.plan.iteration * 10_007 + seq) % (1 << 31)
                cache = self.kv_caches[(seq, ins.stage)] = SequenceKVCache(seq, ins.stage, salt)
            cache.begin(offset, length)
        key = (ins.microbatch, ins.stage)
        boxes = SavedBoxes(f"{self.rank_desc}, micro-batch {ins.microbatch}, stage {ins.stage}") \
            if key in self.box_keys and cache is None else None
        with grad_ctx, self._autocast(), (boxes.hooks() if boxes is not None else contextlib.nullcontext()):
            outputs = stage(batch, inputs, kv_cache=cache) if cache is not None else stage(batch, inputs)
        if boxes is not None:
            self.boxes[key] = boxes
        if cache is not None:
            record = cache.end()
            if not self.forward_only:
                self.slice_records[(ins.microbatch, ins.stage)] = (cache, record)
        self.stats.forward_passes += 1
        if getattr(stage, "post_process", False) and not ins.output_buffer_ids:
            losses = outputs[0]
            mask = batch["loss_mask"].to(losses.dtype)
            loss_sum = (losses.to(torch.promote_types(losses.dtype, torch.float32)) * mask).sum()
            pair = torch.stack([loss_sum.detach(), mask.sum()]).double()
            acc = self.stats.loss_totals
            self.stats.loss_totals = pair if acc is None else acc + pair
            outputs = [loss_sum * self.loss_multiplier]
        elif ins.output_buffer_ids:
            outputs = [o if o.dtype == self.comm_dtype else o.to(self.comm_dtype) for o in outputs]
            self._write_slots(ins.output_buffer_ids, outputs)
        if not self.forward_only:
            self.records[(ins.microbatch, ins.stage)] = (inputs, outputs)
            self.stats.peak_live_records = max(self.stats.peak_live_records, len(self.records) + len(self.deferred))

    def _write_slots(self, buffer_ids, tensors):
        if len(buffer_ids) == len(tensors):
            for bid, t in zip(buffer_ids, tensors):
                self.slots[bid] = [t]
        elif len(buffer_ids) == 1:
            self.slots[buffer_ids[0]] = list(tensors)
        else:
            raise PlanExecutionError(f"{self.rank_desc}: {len(tensors)} tensors do not fit buffers {buffer_ids}")

    def _backward(self, ins: I.BackwardPass):
        key = (ins.microbatch, ins.stage)
        if key not in self.records:
            raise PlanExecutionError(f"{self.rank_desc}: backward of microbatch {ins.microbatch} stage "
                                     f"{ins.stage} without its forward")
        inputs, outputs = self.records.pop(key)
        if ins.buffer_ids:
            grads = [g for bid in ins.buffer_ids for g in self.slots[bid]]
        else:
            grads = [torch.ones_like(outputs[0])]
        if len(grads) != len(outputs):
            raise PlanExecutionError(f"{self.rank_desc}: stage {ins.stage} has {len(outputs)} outputs but "
                                     f"{len(grads)} gradients arrived")
        sliced = self.slice_records.pop(key, None)
        if sliced is not None:
            cache, record = sliced
            kv, kv_grads = cache.output_grads(record)
            _run_backward(list(outputs) + kv, list(grads) + kv_grads)
            cache.accumulate(record)
            if cache.finished:
                del self.kv_caches[(cache.sequence, cache.stage)]
        else:
            _run_backward(outputs, grads)
        self.stats.backward_passes += 1
        if ins.output_buffer_ids:
            in_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
            in_grads = [g if g.dtype == self.comm_dtype else g.to(self.comm_dtype) for g in in_grads]
            self._write_slots(ins.output_buffer_ids, in_grads)

    def _backward_input(self, ins: I.BackwardInput):
        key = (ins.microbatch, ins.stage)
        if key not in self.records:
            raise PlanExecutionError(f"{self.rank_desc}: BackwardInput of microbatch {ins.microbatch} stage "
                                     f"{ins.stage} without its forward")
        if key in self.slice_records:
            raise PlanExecutionError(f"{self.rank_desc}: a split backward cannot run token slices "
                                     f"(microbatch {ins.microbatch}, stage {ins.stage}); use BackwardPass")
        inputs, outputs = self.records.pop(key)
        grads = ([g for bid in ins.buffer_ids for g in self.slots[bid]] if ins.buffer_ids
                 else [torch.ones_like(outputs[0])])
        if len(grads) != len(outputs):
            raise PlanExecutionError(f"{self.rank_desc}: stage {ins.stage} has {len(outputs)} outputs but "
                                     f"{len(grads)} gradients arrived")
        weights = None
        if ins.output_buffer_ids and self.plan.recompute == "none" and self.split_weight_pass:
            stage = self.stages[ins.stage]
            weights = WeightPlan.build(outputs, inputs, [p for p in stage.parameters() if p.requires_grad])
        if ins.output_buffer_ids:
            try:
                in_grads = _input_grads(outputs, grads, inputs)
            finally:
                if weights is not None:
                    weights.remove_hooks()
            in_grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, in_grads)]
            in_grads = [g if g.dtype == self.comm_dtype else g.to(self.comm_dtype) for g in in_grads]
            self._write_slots(ins.output_buffer_ids, in_grads)
        boxes = self.boxes.pop(key, None)
        if weights is not None and boxes is not None and weights.complete():
            # W reads only its nodes' saved tensors and the captured gradients: free the rest.
            before = unique_bytes(boxes.tensors())
            boxes.release(weights.nodes)
            grads = None
            self.stats.slim_weight_passes += 1
            self.stats.weight_pass_freed_bytes += before - unique_bytes(boxes.tensors())
        # The received gradient tensors stay referenced here, not through their slot, which
        # the plan may free and reuse before the weight pass.
        self.deferred[key] = (outputs, grads, weights)
        self.stats.peak_live_records = max(self.stats.peak_live_records, len(self.records) + len(self.deferred))

    def _backward_weight(self, ins: I.BackwardWeight):
        key = (ins.microbatch, ins.stage)
        if key not in self.deferred:
            raise PlanExecutionError(f"{self.rank_desc}: BackwardWeight of microbatch {ins.microbatch} stage "
                                     f"{ins.stage} before its BackwardInput")
        outputs, grads, weights = self.deferred.pop(key)
        if weights is None or not weights.run():
            _run_backward(outputs, grads)
        self.stats.backward_passes += 1

    def _free(self, ins: I.FreeBuffer):
        for bid in ins.buffer_ids:
            self.slots.pop(bid, None)

    def _tensors(self, ins):
        return [t for bid in ins.buffer_ids for t in self.slots[bid]]

    def _key(self, kind: str, ins) -> tuple:
        # Pieces of one batch-split message go to / come from several peers.
        if ins.batch_slice:
            return kind, ins.microbatch, ins.stage, ins.peer, tuple(ins.batch_slice)
        return kind, ins.microbatch, ins.stage

    def _local_block(self, ins) -> tuple:
        """(tokens, rows): where the message's block sits in this rank's [s, b, h] buffer."""
        first, count = ins.batch_slice[:2]
        b = self.plan.microbatch_shapes[ins.microbatch][0][0]
        index, parts = self.plan.batch_split[:2]
        start = first - index * (b // parts)
        rows = slice(start, start + count)
        if len(ins.batch_slice) < 4:
            return slice(None), rows
        first_tok, tokens = ins.batch_slice[2:]
        if len(self.plan.batch_split) == 4:  # this rank holds one block of the sequence
            first_tok -= self.plan.batch_split[2] * ins.buffer_shapes[0][0]
        return slice(first_tok, first_tok + tokens), rows

    @staticmethod
    def _piece_shapes(ins) -> list:
        """Shapes of what one batch-split message carries (its block of each buffer)."""
        sl = ins.batch_slice
        return [((sl[3] if len(sl) == 4 else x[0]), sl[1]) + tuple(x[2:]) for x in ins.buffer_shapes]

    def _send_start(self, ins, kind: str):
        what = f"{type(ins).__name__}(microbatch={ins.microbatch}, stage={ins.stage}) to pipeline rank {ins.peer}"
        tensors = self._tensors(ins)
        # The receiver allocates from the plan's shapes, so a send that disagrees with them would
        # corrupt or hang the receive: refuse it here, naming the instruction.
        actual = [tuple(t.shape) for t in tensors]
        planned = [tuple(x) for x in ins.buffer_shapes]
        if actual != planned:
            raise PlanExecutionError(f"{self.rank_desc}: {what}: the tensors to send have shapes {actual} but the plan "
                               f"says {planned}; the planner's shapes do not match the model")
        if ins.batch_slice:
            toks, rows = self._local_block(ins)
            tensors = [t[toks, rows] for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if kind == "grad":
            self.stats.grad_bytes_raw += nbytes
            if ins.compress_rank:
                offset = ins.token_slice[1] if ins.token_slice else 0  # LEP keys slices by position
                if ins.batch_slice:  # one encoding per row piece, whatever the number of its peers
                    key = (ins.microbatch, ins.stage, tuple(ins.batch_slice))
                    if key not in self.encoded:
                        self.encoded[key] = self._compressor().encode(ins.stage, tensors, ins.compress_rank, offset,
                                                                      piece=tuple(ins.batch_slice))
                    tensors = self.encoded[key]
                else:
                    tensors = self._compressor().encode(ins.stage, tensors, ins.compress_rank, offset)
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.stats.grad_bytes += nbytes
        else:
            self.stats.act_bytes += nbytes
        self.sends[self._key(kind, ins)] = self.comm.isend(tensors, ins.peer, what)

    def _compressor(self):
        if self.grad_compressor is None:
            from megatron.compression.pipeline import PipelineGradCompressor
            self.grad_compressor = PipelineGradCompressor(lazy_error_propagation=False)
        return self.grad_compressor

    def _send_finish(self, ins, kind: str):
        handle = self.sends.pop(self._key(kind, ins))
        if handle.peer != ins.peer:
            raise PlanExecutionError(f"{self.rank_desc}: {type(ins).__name__}(microbatch={ins.microbatch}) "
                                     f"names pipeline rank {ins.peer} but its Start sent to {handle.peer}")
        self.comm.wait(handle)
        if ins.batch_slice and any(k[:3] == (kind, ins.microbatch, ins.stage) for k in self.sends):
            return  # other pieces of this output are still going out: keep its data
        if ins.batch_slice:
            for k in [k for k in self.encoded if k[:2] == (ins.microbatch, ins.stage)]:
                del self.encoded[k]
        if kind == "act" and self.free_sent_activations:
            record = self.records.get((ins.microbatch, ins.stage))
            stage = self.stages.get(ins.stage)
            if record is not None and stage is not None:
                inputs, outputs = record
                for i in getattr(stage, "deallocatable_outputs", (0,)):
                    o = outputs[i]
                    if o.grad_fn is not None and all(o is not x for x in inputs):
                        _free_data(o)

    def _recv_start(self, ins, kind: str):
        what = f"{type(ins).__name__}(microbatch={ins.microbatch}, stage={ins.stage}) from pipeline rank {ins.peer}"
        if ins.batch_slice:
            if ins.buffer_ids[0] not in self.assembling:  # first piece: the whole buffer
                for bid, shape in zip(ins.buffer_ids, ins.buffer_shapes):
                    self.slots[bid] = [torch.empty(tuple(shape), dtype=DTYPES[self.plan.dtype], device=self.device)]
                    self.assembling[bid] = shape[0] * shape[1]
            shapes = self._piece_shapes(ins)
            if ins.compress_rank:
                from megatron.compression.pipeline import wire_dtypes, wire_shapes
                handle = self.comm.irecv(wire_shapes(shapes, ins.compress_rank, self.plan.dtype),
                                         wire_dtypes(shapes, ins.compress_rank, self.plan.dtype), ins.peer, what)
            else:
                handle = self.comm.irecv(shapes, self.plan.dtype, ins.peer, what)
        elif ins.compress_rank:
            from megatron.compression.pipeline import wire_dtypes, wire_shapes
            handle = self.comm.irecv(wire_shapes(ins.buffer_shapes, ins.compress_rank, self.plan.dtype),
                                     wire_dtypes(ins.buffer_shapes, ins.compress_rank, self.plan.dtype), ins.peer, what)
        else:
            handle = self.comm.irecv(ins.buffer_shapes, self.plan.dtype, ins.peer, what)
        self.recvs[self._key(kind, ins)] = (handle, ins.buffer_ids, ins)

    def _recv_finish(self, ins, kind: str):
        handle, buffer_ids, start = self.recvs.pop(self._key(kind, ins))
        tensors = self.comm.wait(handle)
        if start.batch_slice:
            toks, rows = self._local_block(start)
            if start.compress_rank:
                from megatron.compression.pipeline import PipelineGradCompressor
                tensors = PipelineGradCompressor.decode(self._piece_shapes(start), start.compress_rank, tensors,
                                                        DTYPES[self.plan.dtype])
            for bid, t in zip(buffer_ids, tensors):
                self.slots[bid][0][toks, rows] = t
                self.assembling[bid] -= t.shape[0] * t.shape[1]
                if not self.assembling[bid]:
                    del self.assembling[bid]
            return
        if start.compress_rank:
            from megatron.compression.pipeline import PipelineGradCompressor
            tensors = PipelineGradCompressor.decode(start.buffer_shapes, start.compress_rank, tensors,
                                                    DTYPES[self.plan.dtype])
        for bid, t in zip(buffer_ids, tensors):
            self.slots[bid] = [t]

    _HANDLERS: Dict[type, Callable] = {
        I.LoadInput: _load_input,
        I.ForwardPass: _forward,
        I.BackwardPass: _backward,
        I.BackwardInput: _backward_input,
        I.BackwardWeight: _backward_weight,
        I.FreeBuffer: _free,
        I.SendActivationStart: lambda self, ins: self._send_start(ins, "act"),
        I.SendActivationFinish: lambda self, ins: self._send_finish(ins, "act"),
        I.SendGradStart: lambda self, ins: self._send_start(ins, "grad"),
        I.SendGradFinish: lambda self, ins: self._send_finish(ins, "grad"),
        I.RecvActivationStart: lambda self, ins: self._recv_start(ins, "act"),
        I.RecvActivationFinish: lambda self, ins: self._recv_finish(ins, "act"),
        I.RecvGradStart: lambda self, ins: self._recv_start(ins, "grad"),
        I.RecvGradFinish: lambda self, ins: self._recv_finish(ins, "grad"),
    }
