"""The ramp controller: stages from the plan, analysis every interval, rollback on the first failed gate.

    baseline (0%) → stage 1 (1%) → … → stage n (100%): completed
                         └─ fail gate / rollback signal / external rollback → 100% source, rolled_back

A stage passes when its hold has elapsed and the latest analysis passes. Inconclusive analyses
hold the stage; after ``max_inconclusive`` of them past the hold, ``inconclusive_policy`` decides
(default ``rollback``: a canary nobody could judge is not promoted). A fail counts toward
``failures_to_rollback`` consecutive fails, then the controller writes 100% source in one state
version (= one RDS update) and waits for Envoy's ACK. Re-running against a state that already
sends traffic to the target resumes at the first stage at or above the current weight.

While it runs, the controller renews the traffic lease (``lease.json``) from its own loop; if it
dies or hangs for ``lease_intervals`` intervals (``lease_min_s`` at least), the control plane sends everything back to the
source by itself (:class:`~gpumigrate.traffic.xds.LeaseWatch`). A sampler thread reads the client
listener's counters several times a second, so every ramp's result carries what clients saw
(requests, failures, p99, downtime: :class:`~gpumigrate.traffic.stats.ClientFigures`).

    settings.py    RampSettings (from the plan's traffic section)
    controller.py  RampController: the stage loop
    steering.py    its hold on the split: the weights, the traffic lease, Envoy's stats, rollback signals
    judgement.py   the window each interval is judged over; when a stage passes or the ramp ends
    records.py     Sample, StageRecord, RampResult; ramp.json, the live progress (PROGRESS_FILE)
    figures.py     what clients saw, sampled from every Envoy on a thread of its own
"""

from gpumigrate.traffic.ramp.controller import RampController
from gpumigrate.traffic.ramp.records import PROGRESS_FILE, RampResult, Sample, StageRecord
from gpumigrate.traffic.ramp.settings import RampSettings

__all__ = ["PROGRESS_FILE", "RampController", "RampResult", "RampSettings", "Sample", "StageRecord"]
