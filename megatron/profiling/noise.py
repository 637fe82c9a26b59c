"""What every profiler does about a noisy host: repeat, measure the spread, re-measure, refuse.

A profiled table is only as good as its quietest cell. On a shared CPU other processes (and a
torch thread pool larger than the cores left to it) only ever *add* time, so one shape can read
204-487 ms beside its ~1 ms neighbours, and a fit on such cells (TeraPipe's context term, the
host calibration) is garbage that looks like a number. The rules, shared by DynaPipe's
`profile_model`, TeraPipe's `terapipe_latency`, Aceso's `profile` and `calibrate`:

* **repeat**: every cell is timed `repeats` times after warm-up; the cell keeps the statistic
  its profiler uses (median or min) and its **spread**, ``(median - min) / min`` (the min taken
  as at least 0.1 ms): how far a typical sample sits above the fastest one. A quiet host gives a few percent;
  a contended one
  gives tens or hundreds of percent.
* **re-measure, then refuse**: a cell whose spread is past `max_spread` (default
  `MAX_SPREAD`) is measured again, up to `remeasure` more rounds, keeping the quietest round;
  a cell that stays past it is *noisy*, and the profiler writes nothing and exits 1, naming the
  cells (pass a larger ``--max-spread`` to accept them).
* **neighbours**: a cell more than `NEIGHBOUR_RATIO` times the median of its finite neighbours
  on the grid is implausible (layer times grow smoothly with the shape); it is warned about with
  its numbers.
* **threads**: one rank of a CPU job runs with ``cores // ranks`` threads (initialize.py), one
  per rank when ranks share the cores; a profiler pins itself likewise (`pin_threads`), since a
  pool larger than the free cores spins against the other ranks and against other jobs.
* **progress**: each cell's log line carries ``[k/total, ETA s]`` (`Progress`).

Timings come from `clock()` (``time.perf_counter``); tests replace it to inject noise.

A host too busy for any of that is told so in seconds, not after minutes of cells: `probe`
times a fixed ~1 ms kernel for about 2 s and reports the share of a core this process got
(CPU time over wall time) and the fraction of samples that ran undisturbed (within 10 % of
the fastest). Short cells keep their minimum over interleaved rounds (`interleaved`): one
round visits every cell once, so a load change hits all cells alike instead of one row of
the table, and a cell's minimum is trusted when the minima of its even and odd rounds agree.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

MAX_SPREAD = 0.5  # (median - min) / min above which a cell is re-measured, then refused
REMEASURE = 2  # extra rounds for a noisy cell
NEIGHBOUR_RATIO = 20.0  # a cell this many times its neighbours' median is implausible
MAX_FIT_ERROR = 0.15  # rms relative error of a calibration fit above which it is not stored
SPREAD_FLOOR_MS = 0.1  # spreads are relative to at least this (timer and interpreter jitter)


def clock() -> float:
    """Seconds, monotonic; the one timer of the profilers (tests patch `noise.clock`)."""
    return time.perf_counter()


def cpu_clock() -> float:
    """CPU seconds of this process (tests patch `noise.cpu_clock` with `clock`)."""
    return time.process_time()


def spread(samples: Sequence[float]) -> float:
    """(median - min) / min of samples in ms: 0 when every repeat agrees. The denominator is at
    least `SPREAD_FLOOR_MS`: an operator of 20 us jitters by tens of percent on an idle host
    (Python's own overhead), which says nothing about the host."""
    lo = min(samples)
    med = statistics.median(samples)
    return max(med - lo, 0.0) / max(lo, SPREAD_FLOOR_MS)


STATISTICS = {"median": statistics.median, "min": min}


@dataclass
class Timing:
    """One cell: `values` are the kept statistic per timed quantity (e.g. forward, backward),
    `spread` is that of their sum, `rounds` how many rounds were measured."""
    values: Tuple[float, ...]
    spread: float
    rounds: int = 1
    noisy: bool = False
    samples: List[Tuple[float, ...]] = field(default_factory=list, repr=False)

    @property
    def total(self) -> float:
        return float(sum(self.values))


def repeat(sample: Callable[[int], Sequence[float]], warmup: int, repeats: int, *, statistic: str = "median",
           max_spread: float = MAX_SPREAD, remeasure: int = REMEASURE,
           agree: Callable[[bool], bool] = lambda x: x) -> Timing:
    """Time a cell: `sample(i)` runs iteration i of a round and returns its durations (one or
    more quantities). Past `max_spread`, up to `remeasure` more rounds; the quietest round wins.
    `agree(flag)` makes every rank of a collective measurement take the same decision."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}/{warmup}")
    stat = STATISTICS[statistic]
    best = None
    for rnd in range(1, remeasure + 2):
        rows = []
        for i in range(warmup + repeats):
            got = tuple(float(x) for x in sample(i))
            if i >= warmup:
                rows.append(got)
        cols = list(zip(*rows))
        t = Timing(tuple(stat(c) for c in cols), spread([sum(r) for r in rows]), rnd, samples=rows)
        if best is None or t.spread < best.spread:
            best = Timing(t.values, t.spread, rnd, samples=rows)
        best.rounds = rnd
        if not agree(best.spread > max_spread):
            return best
    best.noisy = True
    return best


def timed(fn: Callable[[], object], warmup: int, repeats: int, **kw) -> Timing:
    """`repeat` for one callable whose wall time (ms) is the quantity."""
    def sample(_):
        t0 = clock()
        fn()
        return ((clock() - t0) * 1e3,)
    return repeat(sample, warmup, repeats, **kw)


class NoiseLog:
    """The cells of one profile that stayed noisy, and the summary the profilers print."""

    def __init__(self, max_spread: float = MAX_SPREAD):
        self.max_spread = max_spread
        self.cells: List[Tuple[str, Timing]] = []
        self.remeasured = 0
        self.spreads: List[float] = []

    def add(self, name: str, t: Timing) -> Timing:
        self.spreads.append(t.spread)
        self.remeasured += t.rounds > 1
        if t.noisy:
            self.cells.append((name, t))
        return t

    def summary(self) -> str:
        if not self.spreads:
            return "no cells timed"
        s = np.asarray(self.spreads)
        return (f"{len(s)} cells, spread (median-min)/min: median {np.median(s):.0%}, worst {s.max():.0%}; "
                f"{self.remeasured} re-measured, {len(self.cells)} still past --max-spread {self.max_spread:g}")

    def refusal(self, tool: str) -> Optional[str]:
        """The one-paragraph refusal when cells stayed noisy (None when all are quiet)."""
        if not self.cells:
            return None
        worst = sorted(self.cells, key=lambda c: -c[1].spread)[:3]
        shown = "; ".join(f"{n}: spread {t.spread:.0%} (min {min(sum(r) for r in t.samples):.3g} ms, "
                          f"median {statistics.median(sum(r) for r in t.samples):.3g} ms)" for n, t in worst)
        return (f"{tool}: error: {len(self.cells)} of {len(self.spreads)} cells stayed noisier than --max-spread "
                f"{self.max_spread:g} after re-measuring ({shown}); the host is busy or oversubscribed, nothing "
                f"written. Re-run when it is idle (with OMP_NUM_THREADS=1 when ranks share the cores), or pass a "
                f"larger --max-spread to keep these timings.")


def implausible(grid, ratio: float = NEIGHBOUR_RATIO) -> List[Tuple[tuple, float, float]]:
    """[(index, value, neighbours' median)] of the cells more than `ratio` times the median of
    their finite axis-neighbours (a busy host's spike in an otherwise smooth table)."""
    a = np.asarray(grid, dtype=np.float64)
    out = []
    for idx in np.ndindex(*a.shape):
        v = a[idx]
        if not np.isfinite(v):
            continue
        nb = []
        for ax in range(a.ndim):
            for d in (-1, 1):
                j = list(idx)
                j[ax] += d
                if 0 <= j[ax] < a.shape[ax] and np.isfinite(a[tuple(j)]):
                    nb.append(float(a[tuple(j)]))
        if nb:
            m = float(np.median(nb))
            if m > 0 and v > ratio * m:
                out.append((idx, float(v), m))
    return out


def implausible_lines(grid, axes: Sequence[Sequence], names: Sequence[str], what: str,
                      ratio: float = NEIGHBOUR_RATIO) -> List[str]:
    """Warning lines (with the numbers) for `implausible(grid)`; `axes` label the indices."""
    lines = []
    for idx, v, m in implausible(grid, ratio):
        at = ", ".join(f"{n}={ax[i]:g}" for n, ax, i in zip(names, axes, idx))
        lines.append(f"WARNING: {what} at {at} is {v:.3g} ms, {v / m:.0f}x its neighbours (median {m:.3g} ms): "
                     f"timing noise from a busy host; re-profile when it is idle")
    return lines


def host_load_line(cores: Optional[int] = None, load: Optional[float] = None) -> Optional[str]:
    """A warning when the 1-minute load average already exceeds the cores (None otherwise, or
    where the platform has no load average)."""
    cores = cores or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    if load <= cores:
        return None
    return (f"WARNING: load average {load:.1f} on {cores} cores: other processes are running, so timings will "
            f"be noisy (cells past --max-spread are re-measured, then refused)")


def threads_for(ranks: int = 1, cores: Optional[int] = None) -> int:
    """Threads one rank of a CPU job uses, as the trainer sets them (initialize.py): the
    OMP_NUM_THREADS the user gave, else the cores divided among the ranks sharing them."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (cores or os.cpu_count() or 1) // max(1, ranks))


@contextlib.contextmanager
def pin_threads(n: int) -> Iterator[int]:
    """torch's intra-op threads set to `n` for the block, restored after."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


class Progress:
    """``[k/total, ETA s]`` for the k-th of `total` cells (ETA from the mean cell so far)."""

    def __init__(self, total: int, clock_fn: Callable[[], float] = None):
        self.total, self.k = max(1, int(total)), 0
        self._clock = clock_fn or time.monotonic
        self.t0 = self._clock()

    def next(self) -> str:
        self.k += 1
        done = self.k - 1
        if done == 0:
            return f"[{self.k}/{self.total}]"
        eta = (self._clock() - self.t0) / done * (self.total - done)
        return f"[{self.k}/{self.total}, ETA {eta:.0f}s]"

    def elapsed(self) -> float:
        return self._clock() - self.t0


# ---------------------------------------------------------------------------- host probe
MIN_CLEAN = 0.02  # below this fraction of undisturbed probe samples, min-of-k needs > 230 repeats
MIN_SHARE = 0.6  # a multi-rank calibration run needs most of a core per rank


@dataclass
class HostNoise:
    """What `probe` measured: `share` of a core this process got (CPU / wall time), `clean`
    fraction of samples within 10 % of the fastest, `load` the 1-minute load average (None where
    the platform has none), over `samples` samples in `seconds`."""
    share: float
    clean: float
    samples: int
    seconds: float
    load: Optional[float] = None

    def repeats_for(self, confidence: float = 0.99) -> int:
        """Repeats a cell needs so that at least one is undisturbed with `confidence`."""
        if self.clean >= 1.0:
            return 1
        if self.clean <= 0.0:
            return 10 ** 6
        return int(np.ceil(np.log(1 - confidence) / np.log(1 - self.clean)))

    def describe(self) -> str:
        load = "" if self.load is None else f", load average {self.load:.1f} on {os.cpu_count() or 1} cores"
        return (f"{self.clean:.0%} of {self.samples} probe samples undisturbed, {self.share:.0%} of a core "
                f"for this process{load}")


def _probe_kernel():
    """~1 ms of single-threaded work that touches no allocator after the first call."""
    import torch
    a = torch.ones(96, 96)
    out = torch.empty(96, 96)

    def run():
        for _ in range(8):
            torch.mm(a, a, out=out)
    return run


def probe(seconds: float = 2.0, max_samples: int = 400, kernel: Optional[Callable[[], object]] = None) -> HostNoise:
    """Measure the host for about `seconds` (see the module docstring)."""
    run = kernel or _probe_kernel()
    run()  # warm-up
    walls, t_start, c_start = [], clock(), cpu_clock()
    while len(walls) < max_samples and (clock() - t_start < seconds or len(walls) < 10):
        t0 = clock()
        run()
        walls.append(clock() - t0)
    wall, cpu = clock() - t_start, cpu_clock() - c_start
    lo = min(walls)
    clean = sum(w <= 1.1 * lo for w in walls) / len(walls)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return HostNoise(min(1.0, cpu / wall) if wall > 0 else 1.0, clean, len(walls), wall, load)


@dataclass
class Cell:
    """One cell of an interleaved measurement: its samples in round order."""
    name: str
    samples: List[float] = field(default_factory=list)

    @property
    def value(self) -> float:
        return min(self.samples)

    @property
    def disagreement(self) -> float:
        """|min(even rounds) - min(odd rounds)| / min: 0 when the minimum reproduces."""
        if len(self.samples) < 2:
            return float("inf")
        a, b = min(self.samples[0::2]), min(self.samples[1::2])
        return abs(a - b) / max(min(a, b), SPREAD_FLOOR_MS)


def interleaved(names: Sequence[str], sample: Callable[[int], float], rounds: int, *, max_disagreement: float,
                extra_rounds: int = 0, deadline: Optional[float] = None, min_rounds: int = 2,
                on_round: Callable[[int, int], None] = lambda r, n: None,
                cells: Optional[List[Cell]] = None) -> List[Cell]:
    """Time every cell once per round, `rounds` rounds (after one warm-up round), then up to
    `extra_rounds` more rounds of only the cells whose minimum does not reproduce
    (`Cell.disagreement` past `max_disagreement`). `sample(i)` times cell i once (ms). Rounds
    stop early once `deadline` (a `clock()` value) would be passed, after `min_rounds`. Pass the
    `cells` of an earlier call to add rounds to them (no warm-up then)."""
    if cells is None:
        cells = [Cell(n) for n in names]
        for i in range(len(cells)):
            sample(i)  # warm-up round
    t_round = None
    for r in range(rounds + extra_rounds):
        todo = list(range(len(cells))) if r < rounds else \
            [i for i, c in enumerate(cells) if c.disagreement > max_disagreement]
        if not todo:
            break
        if deadline is not None and r >= min_rounds and t_round is not None and clock() + t_round > deadline:
            break
        t0 = clock()
        for i in todo:
            cells[i].samples.append(float(sample(i)))
        if r < rounds:
            t_round = clock() - t0
        on_round(r + 1, rounds)
    return cells

