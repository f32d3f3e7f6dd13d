"""The simulator with replicas that pace their reports as PullLoop.pace does (serve/pull_loop.py).

The plain Simulation reports every ended segment at once, the ideal for the policies. A real
replica reports one before its next periodic report only when it is urgent (work is queued for
the freed slot, or the end is a give-up's abort), and not before `urgent_gap_frac` of the interval
has passed since its last report (config.URGENT_REPORT_GAP_FRAC). experiments/pull-budget/run.py and
experiments/steal-sensitivity/run.py measure what that costs the makespan and saves the router.
"""
from __future__ import annotations

from .simulator import Simulation


class PacedSimulation(Simulation):
    def __init__(self, *args, urgent_gap_frac: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        if not 0.0 <= urgent_gap_frac <= 1.0:
            raise ValueError(f"urgent_gap_frac={urgent_gap_frac!r}: must be in [0, 1]")
        self.urgent_gap_frac = urgent_gap_frac

    def _advance(self, rid: str, until: float) -> None:
        e = self.engines[rid]
        t = self.clock[rid]
        urgent_from = self.last_pull[rid] + self.urgent_gap_frac * self.pull_interval_s
        report_now = False
        while t < until and e.busy:
            f = self.slowdown[rid] = self._slowdown(rid)
            # an end waiting to be reported while work is queued becomes urgent at urgent_from: step
            # no further than that, so it is reported then, not at the interval's end
            stop = min(until, urgent_from) if e.finals and t < urgent_from and self.core.queue else until
            dt = e.advance(limit_s=(stop - t) / f) * f
            self.busy[rid] += dt
            t += dt
            if e.finals and t >= urgent_from and (
                    self.core.queue or any(p.finish_reason == "abort" for p in e.finals)):
                report_now = True
                break
        if e.finals and not e.busy:
            report_now = True  # its last segment ended: an idle replica pulls at once
        self.clock[rid] = t if report_now else max(t, until)
