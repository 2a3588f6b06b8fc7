"""Step costs corrected by the decoder's own timings.

The calibration (`costs`) times each kind of step in isolation, once per setting. Real
decoding costs more in ways it cannot see: a switch from AR steps to drafting projects the
feature ring into the drafter's context and pays a host round trip, and the machine may be
busier than when it calibrated (a noisy calibration is kept on disk for later processes).
At concurrency 8 a drafted step measured ≈ 2× an AR step in decoding while its calibration
said 1.3×, so the decoder kept probing at a loss.

So the host times every program run it launches (`runner`; the server's engine times each
step, `serving.slot_engine`) and compares it with what the costs in force predicted for
the steps it ran: `CostScales` keeps, per kind of run (AR steps, with a lone ring catch-up
counted as AR time, and drafted runs, their catch-up included), discounted sums of
measured and predicted seconds, and scales the calibrated AR cost and every drafted
shape's cost by their ratio. A few steps' worth of pseudo-observations at the calibrated
costs, which fade as runs come in, keep the first runs close to it. The scales persist for
the process per engine setting (`scales_for`), as the acceptance estimate does.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from adaflash_jax.decoding.verify_plan import StepCosts

DECAY = 0.8  # weight of the earlier runs per program run
PRIOR_STEPS = 4.0  # calibrated steps the scales start from
SCALE_RANGE = (0.25, 4.0)  # a scale is clipped here: a stall must not switch a mode off for good


@dataclasses.dataclass
class _Ratio:
    """Discounted sums of measured and predicted seconds, both starting at `prior` seconds
    (pseudo-observations at the calibrated cost, which fade as runs come in)."""

    measured: float
    predicted: float

    def add(self, measured: float, predicted: float) -> None:
        self.measured = DECAY * self.measured + measured
        self.predicted = DECAY * self.predicted + predicted

    def scale(self) -> float:
        return float(np.clip(self.measured / max(self.predicted, 1e-12), *SCALE_RANGE))


class CostScales:
    """Scales of the calibrated AR and drafted step costs learned from program-run timings,
    against `base` (the calibration, StepCosts of host numbers)."""

    def __init__(self, base: StepCosts):
        self.base = base
        ar_prior = PRIOR_STEPS * float(base.ar_s)
        drafted_prior = PRIOR_STEPS * (float(np.min(base.verify_s)) + float(base.draft_s))
        self.ar, self.drafted = _Ratio(ar_prior, ar_prior), _Ratio(drafted_prior, drafted_prior)

    def observe(self, kind: str, seconds: float, steps: float, predicted_s: float) -> None:
        """One program run of `kind` ("ar", "catch_up" or "spec") took `seconds` for `steps`
        steps; predicted_s: what `base` predicts for a run's drafted steps (AR steps are
        priced here, steps × base.ar_s)."""
        if kind == "spec":
            self.drafted.add(seconds, predicted_s)
        elif kind in ("ar", "catch_up"):
            self.ar.add(seconds, steps * float(self.base.ar_s))
        else:
            raise ValueError(f"unknown program {kind!r}")

    def scales(self) -> tuple[float, float]:
        """(AR scale, drafted scale)."""
        return self.ar.scale(), self.drafted.scale()

    def apply(self, like: StepCosts) -> StepCosts:
        """The base costs scaled, placed as `like` (the costs in force) is."""
        ar, drafted = self.scales()
        scaled = StepCosts(np.asarray(self.base.verify_s) * drafted, np.asarray(self.base.draft_s) * drafted,
                           np.asarray(self.base.ar_s) * ar)
        return jax.tree.map(lambda new, old: jax.device_put(np.asarray(new, old.dtype), old.sharding), scaled, like)


_BY_SETTING: dict = {}


def scales_for(setting, costs: StepCosts) -> CostScales:
    """The process's scales for an engine setting (hashable) calibrated at `costs`: created
    empty the first time, and again when the calibration changed."""
    base = StepCosts(*(np.asarray(jax.device_get(x), np.float64) for x in costs))
    key = (setting, tuple(np.concatenate([np.ravel(x) for x in base]).tolist()))
    if key not in _BY_SETTING:
        _BY_SETTING[key] = CostScales(base)
    return _BY_SETTING[key]
