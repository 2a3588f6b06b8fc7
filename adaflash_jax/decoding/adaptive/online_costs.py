"""Step costs corrected by the decoder's own timings.

The calibration (`costs`) times each kind of step in isolation, once per setting. Real
decoding costs more in ways it cannot see: a switch from AR steps to drafting projects the
feature ring into the drafter's context and pays a host round trip, and the machine may be
busier than when it calibrated (a noisy calibration is kept on disk for later processes).
At concurrency 8 a drafted step measured ≈ 2× an AR step in decoding while its calibration
said 1.3×, so the decoder kept probing at a loss.

So the host times every program run it launches (`runner`; the server's engine times each
step, `serving.slot_engine`) and compares it with what the calibration predicts for the
steps it ran. What it learns is split in two factors, because only one of them decides
whether to draft: AR steps cost f × calibrated and drafted steps f × r × calibrated, where

- `f`, the machine's speed, is common to every kind of step (a busy core slows AR and
  drafted steps alike) and moves quickly;
- `r`, the drafted steps' cost relative to AR steps (switches, catch-up, shapes the
  calibration timed apart), moves slowly.

Scales learned per kind of run go stale for the kind not being run: after a slow spell
seen only by AR runs, AR steps stayed priced high for as long as the decoder drafted (at
concurrency 8 it then drafted every step at 0.8× AR, never running the AR step that would
have corrected it). The two factors are tracked in log space by a Kalman filter: an AR
run measures log f, a drafted run log f + log r, each with noise that shrinks with its
steps, and between runs f may drift more than r. So a slow spell raises both prices
(the choice between them is unchanged), a drafted run right after AR runs teaches r,
and during a long stretch of drafted runs the filter's growing doubt about f makes them
keep f current rather than move r. Both factors persist for the process per engine
setting (`scales_for`), as the acceptance estimate does.
"""

from __future__ import annotations

import jax
import numpy as np

from adaflash_jax.decoding.verify_plan import StepCosts

PRIOR_SD = 0.3  # the calibration's own error, in log units (about ±30%)
DRIFT_SD = (0.3, 0.01)  # how far the speed and the relative cost may move between runs (log):
# AR runs on two shared cores measured 56-120 ms a step from one run to the next, while the
# relative cost is a property of the compiled shapes
STEP_SD = 0.3  # one step's timing noise (log); a run of n steps measures with STEP_SD / √n
SCALE_RANGE = (0.25, 4.0)  # each factor stays here: a stall must not switch a mode off for good
_AR, _DRAFTED = np.array([1.0, 0.0]), np.array([1.0, 1.0])  # what each kind of run measures


class CostScales:
    """The machine's speed and the drafted steps' relative cost, learned from program-run
    timings against `base` (the calibration, StepCosts of host numbers)."""

    def __init__(self, base: StepCosts):
        self.base = base
        self.mean = np.zeros(2)  # log f, log r
        self.cov = np.eye(2) * PRIOR_SD ** 2
        self._pending_s = 0.0  # AR time of runs with no step, counted with the next AR run

    def observe(self, kind: str, seconds: float, steps: float, predicted_s: float) -> None:
        """One program run of `kind` ("ar", "catch_up", "probe" or "spec") took `seconds` for `steps`
        steps; predicted_s: what `base` predicts for a run's drafted steps (AR steps are
        priced here, steps × base.ar_s; a catch-up or a shadow probe counts as AR time: a
        run with no step, such as the runner's lone catch-up, is counted with the next AR run)."""
        if kind in ("ar", "catch_up", "probe") and steps < 1:
            self._pending_s += seconds
            return
        if kind == "spec":
            h, predicted = _DRAFTED, predicted_s
        elif kind in ("ar", "catch_up", "probe"):
            h, predicted = _AR, steps * float(self.base.ar_s)
            seconds, self._pending_s = seconds + self._pending_s, 0.0
        else:
            raise ValueError(f"unknown program {kind!r}")
        if predicted <= 0 or seconds <= 0 or steps < 1:
            return
        self.cov = self.cov + np.diag(np.square(DRIFT_SD))
        gain = self.cov @ h / (h @ self.cov @ h + STEP_SD ** 2 / steps)
        self.mean = self.mean + gain * (np.log(seconds / predicted) - h @ self.mean)
        self.cov = self.cov - np.outer(gain, h @ self.cov)
        self.mean = np.clip(self.mean, *np.log(SCALE_RANGE))

    def scales(self) -> tuple[float, float]:
        """(AR scale, drafted scale): f and f × r."""
        speed, relative = np.exp(self.mean)
        return float(speed), float(speed * relative)

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
