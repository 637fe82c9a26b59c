"""Full-rank compression for exactness tests.

At rank r >= min(rows, cols) one power step is exact (P spans M's column space, so
P P^T M = M), but `lowrank.worth_compressing` then sends the matrix raw, because the factors
would be larger than it. `lossless()` lifts that size check in the calling process, so the whole
compressed path (marked plans, factor wire shapes, encode/decode, error feedback, the
reducers' collectives) runs and must leave the training exactly as without compression.
`counting()` counts the compressions that really happened, so a test can prove they did."""
from __future__ import annotations

from megatron.compression import lowrank

FULL_RANK = 64  # above every hidden size and token count the tests compress


def lossless() -> None:
    lowrank.worth_compressing = lambda rows, cols, rank, *_: lowrank.effective_rank(rows, cols, rank) >= 1


def counting() -> dict:
    """{'pipeline': messages compressed by compressed backpropagation, 'reducer': low-rank
    reductions (PowerSGD over DP or the embedding group)}, updated as training runs."""
    from megatron.compression import data_parallel
    counts = {"pipeline": 0, "reducer": 0}
    compress, reduce_ = lowrank.compress, data_parallel.PowerSGDReducer.finish_compress

    def counted_compress(*a, **k):
        counts["pipeline"] += 1
        return compress(*a, **k)

    def counted_reduce(self, mats, summed_p):
        counts["reducer"] += len(mats)
        return reduce_(self, mats, summed_p)

    lowrank.compress = counted_compress
    data_parallel.PowerSGDReducer.finish_compress = counted_reduce
    return counts
