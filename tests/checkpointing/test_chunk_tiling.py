"""mcore_dist._check_tiling (linear time, corner parity + volume) against an independent oracle:
numpy counting how often each element is written. Exact tilings, overlaps and gaps of many
chunks, in 1 to 3 dimensions; the timing of 100,000 chunks is benchmarks/bench_chunk_tiling.py's."""
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.checkpointing.mcore_dist import McoreDistError, _check_tiling


def _md(shape, boxes):
    chunks = [SimpleNamespace(offsets=tuple(o), sizes=tuple(s)) for o, s in boxes]
    return SimpleNamespace(state_dict_metadata={"w": SimpleNamespace(size=tuple(shape), chunks=chunks)})


def _oracle(shape, boxes) -> bool:
    count = np.zeros(shape, dtype=np.int64)
    for o, s in boxes:
        count[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
    return bool((count == 1).all())


def _grid(shape, cuts):
    """The boxes of a grid cutting each dim at `cuts[d]`."""
    edges = [[0] + sorted(c) + [n] for c, n in zip(cuts, shape)]
    boxes = [((), ())]
    for e in edges:
        boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in zip(e[:-1], e[1:])]
    return boxes


def _accepts(shape, boxes) -> bool:
    try:
        _check_tiling(_md(shape, boxes), "/ck", ["w"])
        return True
    except McoreDistError as e:
        assert "\n" not in str(e) and "'w'" in str(e)
        return False


def test_many_one_column_chunks_tile_exactly():
    boxes = [((0, i), (4, 1)) for i in range(5000)]
    assert _accepts((4, 5000), boxes) and _oracle((4, 5000), boxes)


@pytest.mark.parametrize("seed", range(40))
def test_random_tilings_overlaps_and_gaps_agree_with_the_oracle(seed):
    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(1, 4))
    shape = tuple(int(x) for x in rng.integers(2, 9, ndim))
    cuts = [sorted(set(int(c) for c in rng.integers(1, n, int(rng.integers(0, n))))) for n in shape]
    boxes = _grid(shape, cuts)
    assert _accepts(shape, boxes) and _oracle(shape, boxes)
    kind = seed % 4
    i = int(rng.integers(len(boxes)))
    o, s = boxes[i]
    if kind == 0:    # one chunk twice
        bad = boxes + [boxes[i]]
    elif kind == 1:  # one chunk missing
        bad = boxes[:i] + boxes[i + 1:]
    elif kind == 2:  # one chunk grown by one along a dim where it can grow: overlaps a neighbour
        d = next((d for d in range(ndim) if o[d] + s[d] < shape[d]), None)
        if d is None:
            d = 0
            o = o[:0] + (o[0] - 1,) + o[1:] if o[0] > 0 else o
        bad = boxes[:i] + [(o, s[:d] + (s[d] + 1,) + s[d + 1:])] + boxes[i + 1:]
    else:            # a chunk shrunk and another grown: same element count, one overlap and one gap
        if s[0] < 2:
            pytest.skip("no chunk to shrink")
        j = (i + 1) % len(boxes)
        oj, sj = boxes[j]
        bad = list(boxes)
        bad[i] = (o, (s[0] - 1,) + s[1:])
        bad[j] = (oj, (sj[0] + 1,) + sj[1:]) if oj[0] + sj[0] < shape[0] else ((oj[0] - 1,) + oj[1:],
                                                                               (sj[0] + 1,) + sj[1:])
    if all(0 <= a and a + b <= n for oo, ss in bad for a, b, n in zip(oo, ss, shape)):
        assert _accepts(shape, bad) == _oracle(shape, bad), (shape, bad)


def test_overlap_of_equal_volume_is_refused():
    # Two chunks covering the same half and nothing on the other: volume matches, parity does not.
    assert not _accepts((4,), [((0,), (2,)), ((0,), (2,))])
    assert not _accepts((2, 2), [((0, 0), (2, 1)), ((0, 0), (1, 2)), ((1, 1), (1, 1))])
