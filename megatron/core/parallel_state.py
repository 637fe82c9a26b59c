"""Tensor / context / pipeline / data-parallel process groups in Megatron's rank order.

Rank order is tp-cp-dp-pp: tensor-parallel ranks are adjacent (they talk the most), then
context parallel (ranks holding chunks of the same sequences), then data parallel, then
pipeline. ``global = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank``
(with CP 1 this is Megatron's tp-dp-pp order). Gradients and optimizer shards span DP x CP
(`grad_group`): CP ranks hold the same weights but see different tokens.

The result is an explicit `ParallelState` object that core code receives as an argument;
there is no hidden global. With world size 1 and no process group, every group is None and
every collective in `megatron.core` is a no-op.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist


@dataclass
class ParallelState:
    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: Optional[object] = None
    pp_group: Optional[object] = None
    dp_group: Optional[object] = None
    mp_group: Optional[object] = None  # TP x PP: everything that shares one model replica
    embedding_group: Optional[object] = None  # first + last pipeline stage (tied embeddings)
    pp_global_ranks: List[int] = field(default_factory=lambda: [0])
    tp_global_ranks: List[int] = field(default_factory=lambda: [0])
    dp_global_ranks: List[int] = field(default_factory=lambda: [0])
    embedding_global_ranks: List[int] = field(default_factory=list)
    timeout: timedelta = timedelta(minutes=10)
    # Stages with their own (TP, DP) sizes (Aceso): ((tp, dp) per stage); () = one TP x DP for
    # every stage. Then tp/dp_size are this rank's stage's, pp_global_ranks is every rank (plans
    # are per global rank, peers are global ranks), and embedding_group holds every rank of the
    # first and the last stage (tied embeddings are re-split between their TP sizes).
    stage_layouts: tuple = ()
    # Context parallelism (megatron/core/context_parallel.py): cp ranks share every sample of
    # a DP rank, each holding two chunks of each sequence. dpcp_group = DP x CP (None at CP 1).
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Optional[object] = None
    cp_global_ranks: List[int] = field(default_factory=lambda: [0])
    dpcp_group: Optional[object] = None
    # Variable CP (--dynapipe-cp-sizes): size c -> (group, global ranks) of the sub-group of c
    # consecutive CP indices holding this rank, nested inside the CP group (add_nested_cp_groups).
    cp_subgroups: dict = field(default_factory=dict)
    # Expert parallelism (megatron/core/expert_parallel.py): the experts of a stage are split
    # over ep_group; edp_group holds the ranks with the same experts (their gradients' sum).
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Optional[object] = None
    ep_global_ranks: List[int] = field(default_factory=lambda: [0])
    edp_size: int = 1
    edp_rank: int = 0
    edp_group: Optional[object] = None

    @property
    def grad_group(self):
        """Where gradients, loss sums and optimizer shards reduce: DP x CP."""
        return self.dpcp_group if self.cp_size > 1 else self.dp_group

    @property
    def grad_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def grad_rank(self) -> int:
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def plan_rank(self) -> int:
        """Index of this rank's plan in a planner's list: its pipeline rank, or its global rank
        when stages have their own TP/DP sizes (each DP part of a stage has its own peers)."""
        return self.rank if self.stage_layouts else self.pp_rank

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        cp = f", cp {self.cp_rank}/{self.cp_size}" if self.cp_size > 1 else ""
        return (f"rank {self.rank} (tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size}, "
                f"dp {self.dp_rank}/{self.dp_size}{cp})")


def _new_group(ranks: List[int], rank: int, timeout):
    """Every rank must create every group (torch requires it); only members keep it."""
    g = dist.new_group(ranks, timeout=timeout)
    return g if rank in ranks else None


def global_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int, cp_rank: int = 0, cp: int = 1) -> int:
    return pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank


def initialize_model_parallel(tp_size: int = 1, pp_size: int = 1,
                              timeout: Optional[timedelta] = None, cp_size: int = 1) -> ParallelState:
    """Create every group on every rank, in the same order (torch requires it)."""
    if not dist.is_initialized():
        if tp_size * pp_size * cp_size != 1:
            raise RuntimeError("initialize_model_parallel: TP x PP x CP > 1 needs an initialised process group")
        return ParallelState()
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world % (tp_size * pp_size * cp_size) != 0:
        raise RuntimeError(f"world size {world} is not divisible by TP ({tp_size}) x PP ({pp_size}) x CP ({cp_size})")
    dp_size = world // (tp_size * pp_size * cp_size)
    pp_rank, rem = divmod(rank, dp_size * cp_size * tp_size)
    dp_rank, rem = divmod(rem, cp_size * tp_size)
    cp_rank, tp_rank = divmod(rem, tp_size)
    st = ParallelState(world_size=world, rank=rank, tp_size=tp_size, pp_size=pp_size, dp_size=dp_size,
                       tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, cp_size=cp_size, cp_rank=cp_rank,
                       timeout=timeout or timedelta(minutes=10))

    def make(ranks: List[int]):
        return _new_group(ranks, rank, timeout)

    if cp_size > 1:
        return _make_cp_groups(st, make, tp_size, pp_size, dp_size, cp_size)

    for p in range(pp_size):
        for d in range(dp_size):
            ranks = [global_rank(t, d, p, tp_size, dp_size) for t in range(tp_size)]
            g = make(ranks)
            if g is not None:
                st.tp_group, st.tp_global_ranks = g, ranks
    for p in range(pp_size):
        for t in range(tp_size):
            ranks = [global_rank(t, d, p, tp_size, dp_size) for d in range(dp_size)]
            g = make(ranks)
            if g is not None:
                st.dp_group, st.dp_global_ranks = g, ranks
    for d in range(dp_size):
        for t in range(tp_size):
            ranks = [global_rank(t, d, p, tp_size, dp_size) for p in range(pp_size)]
            g = make(ranks)
            if g is not None:
                st.pp_group, st.pp_global_ranks = g, ranks
            emb = sorted({ranks[0], ranks[-1]})
            g = make(emb)
            if g is not None:
                st.embedding_group, st.embedding_global_ranks = g, emb
    for d in range(dp_size):
        ranks = [global_rank(t, d, p, tp_size, dp_size) for p in range(pp_size) for t in range(tp_size)]
        g = make(sorted(ranks))
        if g is not None:
            st.mp_group = g
    if pp_size == 1:
        st.embedding_group, st.embedding_global_ranks = None, []
    return st


def _make_cp_groups(st: ParallelState, make, tp: int, pp: int, dp: int, cp: int) -> ParallelState:
    """The groups of initialize_model_parallel with a context-parallel dimension: TP, DP, PP,
    embedding and model-parallel groups exist once per CP rank; CP and DP x CP groups join."""
    g_of = lambda t, d, p, c: global_rank(t, d, p, tp, dp, c, cp)  # noqa: E731

    def keep(ranks, attr, ranks_attr=None):
        g = make(ranks)
        if g is not None:
            setattr(st, attr, g)
            if ranks_attr:
                setattr(st, ranks_attr, ranks)

    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                keep([g_of(t, d, p, c) for t in range(tp)], "tp_group", "tp_global_ranks")
    for p in range(pp):
        for c in range(cp):
            for t in range(tp):
                keep([g_of(t, d, p, c) for d in range(dp)], "dp_group", "dp_global_ranks")
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                ranks = [g_of(t, d, p, c) for p in range(pp)]
                keep(ranks, "pp_group", "pp_global_ranks")
                keep(sorted({ranks[0], ranks[-1]}), "embedding_group", "embedding_global_ranks")
    for d in range(dp):
        for c in range(cp):
            keep(sorted(g_of(t, d, p, c) for p in range(pp) for t in range(tp)), "mp_group")
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                keep([g_of(t, d, p, c) for c in range(cp)], "cp_group", "cp_global_ranks")
    for p in range(pp):
        for t in range(tp):
            keep([g_of(t, d, p, c) for d in range(dp) for c in range(cp)], "dpcp_group")
    if pp == 1:
        st.embedding_group, st.embedding_global_ranks = None, []
    return st


def add_nested_cp_groups(st: ParallelState, sizes) -> ParallelState:
    """CP sub-groups of every size in `sizes` (each divides the CP size): the CP group of N
    ranks cut into N/c groups of c consecutive CP indices, so CP 1 and CP 2 sit inside each CP 4
    group. Created on every rank in the same order (torch requires it); a micro-batch planned at
    size c runs on the sub-group holding CP index (cp_rank // c) * c (megatron/core/context_parallel.py)."""
    cp, tp, dp, pp = st.cp_size, st.tp_size, st.dp_size, st.pp_size
    timeout = st.timeout
    for c in sorted(set(int(x) for x in sizes)):
        if c < 1 or cp % c:
            raise ValueError(f"--dynapipe-cp-sizes: {c} does not divide --context-parallel-size {cp}")
        if c == cp:
            st.cp_subgroups[c] = (st.cp_group, list(st.cp_global_ranks))
            continue
        for p in range(pp):
            for d in range(dp):
                for t in range(tp):
                    for k in range(cp // c):
                        ranks = [global_rank(t, d, p, tp, dp, i, cp) for i in range(k * c, (k + 1) * c)]
                        g = dist.new_group(ranks, timeout=timeout) if c > 1 and dist.is_initialized() else None
                        if st.rank in ranks:
                            st.cp_subgroups[c] = (g, ranks)
    return st


def stage_rank_offsets(layouts) -> List[int]:
    """First global rank of each stage: stages take contiguous rank ranges, in stage order."""
    out, start = [], 0
    for tp, dp in layouts:
        out.append(start)
        start += tp * dp
    return out


def stage_position(layouts, rank: int):
    """(stage, dp index, tp index) of a global rank; ranks inside a stage are in tp-dp order."""
    for stage, (start, (tp, dp)) in enumerate(zip(stage_rank_offsets(layouts), layouts)):
        if start <= rank < start + tp * dp:
            dp_index, tp_index = divmod(rank - start, tp)
            return stage, dp_index, tp_index
    raise ValueError(f"rank {rank} is outside the {sum(t * d for t, d in layouts)} ranks of stage layout {layouts}")


def initialize_heterogeneous_parallel(layouts, timeout: Optional[timedelta] = None) -> ParallelState:
    """Groups for pipeline stages with their own (TP, DP) sizes: stage s runs on
    ``layouts[s] = (tp, dp)`` ranks. Every rank creates every group, in the same order."""
    layouts = tuple((int(t), int(d)) for t, d in layouts)
    world = sum(t * d for t, d in layouts)
    if not dist.is_initialized() or dist.get_world_size() != world:
        have = dist.get_world_size() if dist.is_initialized() else 1
        raise RuntimeError(f"stage layout {layouts} needs {world} ranks (sum of TP x DP per stage), the job has {have}")
    rank = dist.get_rank()
    stage, dp_rank, tp_rank = stage_position(layouts, rank)
    tp_size, dp_size = layouts[stage]
    st = ParallelState(world_size=world, rank=rank, tp_size=tp_size, pp_size=len(layouts), dp_size=dp_size,
                       tp_rank=tp_rank, pp_rank=stage, dp_rank=dp_rank, timeout=timeout or timedelta(minutes=10),
                       pp_global_ranks=list(range(world)), stage_layouts=layouts)

    def make(ranks: List[int]):
        return _new_group(ranks, rank, timeout)

    offsets = stage_rank_offsets(layouts)
    for s, (tp, dp) in enumerate(layouts):
        for d in range(dp):
            ranks = [offsets[s] + d * tp + t for t in range(tp)]
            g = make(ranks)
            if g is not None:
                st.tp_group, st.tp_global_ranks = g, ranks
        for t in range(tp):
            ranks = [offsets[s] + d * tp + t for d in range(dp)]
            g = make(ranks)
            if g is not None:
                st.dp_group, st.dp_global_ranks = g, ranks
    if len(layouts) > 1:
        first = layouts[0]
        ranks = list(range(first[0] * first[1])) + list(range(offsets[-1], world))
        g = make(ranks)
        if g is not None:
            st.embedding_group, st.embedding_global_ranks = g, ranks
    return st


def job_store():
    """The job's TCPStore (torchrun's rendezvous store): heartbeats and the plan service use it."""
    if not dist.is_initialized():
        raise RuntimeError("the job's store needs torch.distributed to be initialised first")
    return dist.distributed_c10d._get_default_store()
