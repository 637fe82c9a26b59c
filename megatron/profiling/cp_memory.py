"""What one rank of a context-parallel group keeps for backward, against one process.

For one shape (sequence S, micro-batch b, heads, head size, hidden), every CP size and both
exchanges run on gloo ranks (CPU) and measure, with ``measure_saved`` (autograd's
saved_tensors_hooks, each storage counted once), on each rank:

- ``core``: the attention core, q, k, v [S/N, b, np, hn] in, context out
  (``cp_core_attention``; at CP 1 the one-process path, causal SDPA as
  ParallelAttention.core_attention runs it);
- ``layer``: one GPT TransformerLayer (dropout 0) on the rank's S/N tokens, its attention
  through the CP spec.

Rows carry the maximum over ranks, the ratio to one process, and the memory model's
predictions: ``cp_cost.attention_core_saved_bytes`` for the core, and for the layer the cost
model's rule (one process's layer on S/N tokens, measured here, with nothing exchanged kept).
benchmarks/bench_cp_memory.py prints them; tests/planner/cost/test_cp_memory_model.py checks
the model against them (within 5 % per row).
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator

import torch


def _spec(cp: int, rank: int, comm: str, seq: int, segments=None):
    import torch.distributed as dist

    from megatron.core.context_parallel import all_token_index, chunk_token_index
    from megatron.models.cp_attention import ContextParallelSpec
    return ContextParallelSpec(dist.group.WORLD, cp, rank, list(range(cp)), comm, chunk_token_index(seq, cp, rank),
                               all_token_index(seq, cp), segments)


def _rank(rank: int, world: int, comms, shape: dict, dtype: str, local_of=()) -> Dict[str, Dict[str, int]]:
    import torch.nn.functional as F

    from megatron.config.core import ModelConfig
    from megatron.models.cp_attention import cp_core_attention
    from megatron.models.transformer import TransformerLayer
    from megatron.profiling.saved_memory import measure_saved
    dt = getattr(torch, dtype)
    s, b, heads, hn = shape["seq"], shape["batch"], shape["heads"], shape["head_size"]
    local = s // world
    gen = torch.Generator().manual_seed(rank)
    spec = None

    def qkv():  # non-leaf, as a layer's activations are
        return [torch.randn(local, b, heads, hn, generator=gen, dtype=dt).requires_grad_() * 1 for _ in range(3)]

    def core(q, k, v):
        if spec is not None:
            return cp_core_attention(q, k, v, spec, 0.0, 1, 0)
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(local, b, heads * hn)

    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=heads * hn, num_attention_heads=heads, seq_length=s, hidden_dropout=0.0,
                      attention_dropout=0.0, num_layers=1)
    layer = TransformerLayer(cfg, None, layer_number=0, num_layers_total=1, seed=0, key="cp_memory").to(dt)

    def layer_bytes(tokens):
        def hidden():
            return [torch.randn(tokens, b, heads * hn, generator=gen, dtype=dt).requires_grad_() * 1]
        return measure_saved(lambda x: layer(x, mask=spec), hidden, params=list(layer.parameters())).saved_bytes

    out = {}
    for comm in comms:  # one launch measures every exchange
        spec = _spec(world, rank, comm, s) if world > 1 else None
        # one process on s/n tokens: what the cost model prices a CP n rank's layer as
        got = measure_saved(core, qkv)
        out[comm] = {"core": got.saved_bytes, "core_peak": got.peak_bytes, "layer": layer_bytes(local),
                     **{f"layer_at_{n}": layer_bytes(s // n) for n in local_of}}
    return out


def cp_memory_rows(shape: dict, sizes: Iterable[int] = (1, 2, 4), comms: Iterable[str] = ("all_gather", "p2p"),
                   dtype: str = "float32", timeout_s: float = 300.0) -> Iterator[dict]:
    """One row per (CP size, exchange), as each is measured: max over ranks of the saved
    bytes, and the ratio to CP 1."""
    from megatron.core.launch import run_ranks
    from megatron.planner.cost.cp_cost import attention_core_saved_bytes
    act = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    base = None
    for n in sizes:
        names = ["one_process"] if n == 1 else list(comms)
        local_of = [m for m in sizes if m > 1] if n == 1 else []
        got = run_ranks(_rank, n, names, shape, dtype, local_of, timeout_s=timeout_s, what=f"CP {n} memory")
        for comm in names:
            row = {"cp": n, "comm": comm, **shape, "dtype": dtype,
                   "core_bytes": max(g[comm]["core"] for g in got), "layer_bytes": max(g[comm]["layer"] for g in got),
                   # forward + backward peak of the core: inputs, kept bytes and the exchange's transients
                   "core_peak_bytes": max(g[comm]["core_peak"] for g in got),
                   "core_model_bytes": attention_core_saved_bytes(shape["batch"], shape["seq"], shape["heads"],
                                                                  shape["head_size"], n, act)}
            base = base or dict(row, **got[0][comm])
            # the cost model (cp_cost.ContextParallelCostModel): a CP n rank's layer stores what one
            # process stores for s/n tokens with a flash kernel, nothing exchanged on top
            row["layer_model_bytes"] = base["layer"] if n == 1 else base[f"layer_at_{n}"]
            row["layer_model_error"] = round(row["layer_model_bytes"] / row["layer_bytes"] - 1, 4)
            row["core_ratio"] = round(row["core_bytes"] / base["core_bytes"], 4)
            row["core_peak_ratio"] = round(row["core_peak_bytes"] / base["core_peak_bytes"], 4)
            row["layer_ratio"] = round(row["layer_bytes"] / base["layer_bytes"], 4)
            row["core_model_error"] = round(row["core_model_bytes"] / row["core_bytes"] - 1, 4)
            yield row
