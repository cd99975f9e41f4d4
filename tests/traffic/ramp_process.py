"""A ramp controller in its own process, for tests that kill it mid-ramp.

Run: ``python ramp_process.py STATE_DIR ADMIN_URL NODE INTERVAL_S LEASE_INTERVALS WEIGHT``. It takes
the baseline, moves ``WEIGHT`` percent to the target and holds that stage for an hour, renewing the
traffic lease (``LEASE_INTERVALS`` intervals long, no floor), until it is killed.
"""

from __future__ import annotations

import sys

from gpumigrate.traffic.analysis import GateSettings
from gpumigrate.traffic.ramp import RampController, RampSettings


def main() -> None:
    state_dir, admin, node, interval, intervals, weight = sys.argv[1:7]
    settings = RampSettings(
        stages=((float(weight), 3600.0),),
        interval_s=float(interval),
        baseline_intervals=1,
        gates=GateSettings(min_requests=1, p99_slack_ms=1000),
        inconclusive_policy="hold",
        lease_intervals=int(intervals),
        lease_min_s=0.0,
    )
    RampController(state_dir, [admin], settings, nodes=[node], lease_holder="test ramp").run()


if __name__ == "__main__":
    main()
