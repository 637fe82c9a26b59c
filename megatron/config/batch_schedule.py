"""Megatron-LM's growing global batch: `--rampup-batch-size START INCR SAMPLES` (core_v0.9.0's
RampupBatchsizeNumMicroBatchesCalculator) and `--step-batch-size-schedule "T:B T:B ..."`
(its successor at core_v0.19.0; thresholds in tokens, converted to samples with the sequence
length, with K/M/B/T suffixes). Both give the global batch as a function of consumed samples;
the learning-rate schedule then advances by samples, as Megatron's does."""
from __future__ import annotations

from typing import List, Optional, Tuple

from megatron.config.errors import ConfigError

_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def parse_step_schedule(text: str, seq_length: int) -> List[Tuple[int, int]]:
    """'0:16 2.4B:320' -> [(0, 16), (samples at 2.4e9 tokens, 320)], thresholds ascending."""
    out = []
    for part in text.split():
        try:
            t, b = part.split(":")
            scale = _SUFFIX.get(t[-1:].upper(), 1.0)
            tokens = float(t[:-1] if t[-1:].upper() in _SUFFIX else t) * scale
            out.append((int(tokens // seq_length), int(b)))
        except ValueError:
            raise ConfigError(f"--step-batch-size-schedule {text!r}: expected 'TOKENS:BATCH ...' (e.g. "
                              f"'0:16 2.4B:320'), got {part!r}") from None
    if not out or out[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(out, out[1:])):
        raise ConfigError(f"--step-batch-size-schedule {text!r}: thresholds must start at 0 and increase")
    return out


class BatchSchedule:
    """Global batch size after `consumed` samples."""

    def __init__(self, final: int, rampup: Optional[Tuple[int, int, int]] = None,
                 steps: Optional[List[Tuple[int, int]]] = None):
        self.final, self.rampup, self.steps = final, rampup, steps
        if rampup is not None:
            start, incr, samples = rampup
            if start <= 0 or incr <= 0 or samples < 0:
                raise ConfigError(f"--rampup-batch-size {start} {incr} {samples}: start and increment must be positive "
                                  "and the ramp-up samples non-negative")
            if final < start or (final - start) % incr:
                raise ConfigError(f"--rampup-batch-size {start} {incr} {samples}: --global-batch-size ({final}) minus "
                                  f"the start must be a non-negative multiple of the increment")
            self.per_increment = samples / max((final - start) // incr, 1)

    def sizes(self) -> List[int]:
        if self.rampup is not None:
            start, incr, _ = self.rampup
            return list(range(start, self.final + 1, incr))
        return sorted({b for _, b in self.steps})

    def at(self, consumed: int) -> int:
        if self.rampup is not None:
            start, incr, samples = self.rampup
            if consumed > samples or start == self.final:
                return self.final
            return start + int(consumed / self.per_increment) * incr
        return [b for t, b in self.steps if t <= consumed][-1]

    def iterations_for(self, train_samples: int) -> int:
        """Megatron's update_train_iters: ramp-up iterations while consumed <= ramp-up samples,
        then whole global batches (a partial last batch is dropped)."""
        if self.rampup is None:  # step schedule: whole batches until the samples are used
            n = consumed = 0
            while consumed + self.at(consumed) <= train_samples:
                consumed += self.at(consumed)
                n += 1
            return n
        n = consumed = 0
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.at(consumed)
            n += 1
        if train_samples > consumed:
            n += (train_samples - consumed) // self.final
        return n


def check_divisible(schedule: BatchSchedule, micro_times_dp: int, flag: str) -> None:
    bad = [b for b in schedule.sizes() if b % micro_times_dp]
    if bad:
        raise ConfigError(f"{flag}: global batch sizes {bad[:4]} are not multiples of --micro-batch-size x "
                          f"data-parallel size ({micro_times_dp}); pick sizes that are (Megatron-LM asserts the same)")
