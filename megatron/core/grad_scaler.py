"""Dynamic loss scaling for fp16 (Megatron's DynamicGradScaler semantics).

On overflow the step is skipped; after `hysteresis` overflows the scale halves (never below
min_scale). After `growth_interval` clean steps in a row it doubles.
"""
from __future__ import annotations


class DynamicGradScaler:
    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 static: bool = False):
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.static = static
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if self.static:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self):
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, sd):
        self.scale = sd["scale"]
        self._growth_tracker = sd["growth_tracker"]
        self._hysteresis_tracker = sd["hysteresis_tracker"]
