"""Aceso's resource primitives on a search state (mixed into ``search.Searcher``): each returns
the states one primitive reaches with stage ``b`` as its target — op movement to a neighbour
stage, DP/TP growth of ``b`` with GPUs from a stage twice its size, the reverse, a TP<->DP swap
inside ``b``, and a doubled or halved micro-batch. Legality is the searcher's ``legal``."""
from __future__ import annotations

from typing import List, Tuple

State = Tuple[int, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]  # mbs, bounds, tps, dps


class Primitives:
    def stage_moves(self, st: State, b: int) -> List[State]:
        """Every primitive with stage ``b`` as the target (the final polish's neighbourhood)."""
        out = self._move(st, b) + self._grow(st, b, "dp") + self._grow(st, b, "tp") + \
            self._shrink(st, b, "dp") + self._shrink(st, b, "tp") + self._swap(st, b)
        if b == 0:
            out += self._mbs(st, 2) + self._mbs(st, 0.5)
        return [x for x in out if x != st and self.legal(x)]

    def _move(self, st: State, b: int) -> List[State]:
        mbs, bounds, tps, dps = st
        S = len(tps)
        out = []
        size = bounds[b + 1] - bounds[b]
        steps = (1, 2, size // 4) if self.granularity == "layer" else (1, 3, size // 8, size // 4)
        for k in sorted({max(1, k) for k in steps}):
            if size - k < 1:
                continue
            if b > 0:  # give the first k units to the previous stage
                nb = list(bounds)
                nb[b] += k
                out.append((mbs, tuple(nb), tps, dps))
            if b < S - 1:  # give the last k units to the next stage
                nb = list(bounds)
                nb[b + 1] -= k
                out.append((mbs, tuple(nb), tps, dps))
        return out

    def _grow(self, st: State, b: int, dim: str) -> List[State]:
        mbs, bounds, tps, dps = st
        gb = tps[b] * dps[b]
        out = []
        # the donor gives half of its GPUs; donors ordered by how idle they are
        donors = [d for d in range(len(tps)) if d != b and tps[d] * dps[d] == 2 * gb]
        for d in donors:
            for ddim in ("dp", "tp"):
                nt, nd = list(tps), list(dps)
                if dim == "dp":
                    nd[b] *= 2
                else:
                    nt[b] *= 2
                if ddim == "dp":
                    if nd[d] % 2:
                        continue
                    nd[d] //= 2
                else:
                    if nt[d] % 2:
                        continue
                    nt[d] //= 2
                out.append((mbs, bounds, tuple(nt), tuple(nd)))
                # a stage that doubles its DP may need a larger micro-batch
                if dim == "dp" and mbs % nd[b]:
                    out.append((mbs * 2, bounds, tuple(nt), tuple(nd)))
        return out

    def _shrink(self, st: State, b: int, dim: str) -> List[State]:
        mbs, bounds, tps, dps = st
        gb = tps[b] * dps[b]
        if gb < 2:
            return []
        out = []
        for c in range(len(tps)):
            if c == b or 2 * tps[c] * dps[c] != gb:
                continue
            for cdim in ("dp", "tp"):
                nt, nd = list(tps), list(dps)
                if dim == "dp":
                    if nd[b] % 2:
                        continue
                    nd[b] //= 2
                else:
                    if nt[b] % 2:
                        continue
                    nt[b] //= 2
                if cdim == "dp":
                    nd[c] *= 2
                else:
                    nt[c] *= 2
                out.append((mbs, bounds, tuple(nt), tuple(nd)))
        return out

    def _swap(self, st: State, b: int) -> List[State]:
        mbs, bounds, tps, dps = st
        out = []
        if dps[b] % 2 == 0:
            nt, nd = list(tps), list(dps)
            nt[b] *= 2
            nd[b] //= 2
            out.append((mbs, bounds, tuple(nt), tuple(nd)))
        if tps[b] % 2 == 0:
            nt, nd = list(tps), list(dps)
            nt[b] //= 2
            nd[b] *= 2
            out.append((mbs, bounds, tuple(nt), tuple(nd)))
        return out

    def _mbs(self, st: State, factor: float) -> List[State]:
        mbs, bounds, tps, dps = st
        m = int(mbs * factor)
        return [(m, bounds, tps, dps)] if m >= 1 and m * 1.0 == mbs * factor else []
