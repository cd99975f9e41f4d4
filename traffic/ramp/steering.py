"""The ramp's hold on the traffic split: it writes each stage's weights and waits until every Envoy applied
them, renews the traffic lease, reads Envoy's stats, hears a rollback asked for (the migration's request) or
written by someone else, and sends everything back to the source. The stage loop (controller.py) steers
only through it.

The lease is renewed from the controller's own loop (here, while it sleeps and writes), never from a helper
thread: a controller that hangs stops renewing, and the control plane takes the split back by itself
(:class:`~gpumigrate.traffic.xds.LeaseWatch`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpumigrate.errors import TrafficError
from gpumigrate.traffic.envoy import EnvoyAdmin
from gpumigrate.traffic.ramp.judgement import RolledBack, rolled_back_outside
from gpumigrate.traffic.ramp.settings import RampSettings
from gpumigrate.traffic.state import DesiredState, StateStore, rollback_to_source, split
from gpumigrate.traffic.stats import StatsSnapshot, merge, parse_stats


class Steering:
    """One ramp's writes and reads of the split. ``weight``: the percent on the target as this ramp last
    wrote it (or found it, resumed); ``now()``: seconds since :meth:`begin`."""

    def __init__(
        self,
        store: StateStore,
        admins: list[EnvoyAdmin],
        settings: RampSettings,
        *,
        nodes: list[str],
        source: str,
        target: str,
        rollback_signal: Callable[[], Any] | None,
        lease_holder: str,
    ) -> None:
        self.store, self.admins, self.settings, self.nodes = store, admins, settings, nodes
        self.source, self.target = source, target
        self.rollback_signal = rollback_signal
        self.lease_holder = lease_holder
        self.weight = 0.0
        self._t0 = 0.0
        self._failover = True
        self._lease_seq = 0
        self._renewed_at = -1e9

    def begin(self) -> DesiredState:
        """Start the ramp's clock and take up the split as it stands (a resumed ramp finds weight on the target)."""
        self._t0 = time.monotonic()
        state = self.store.read()
        self.weight = state.weights.get(self.target, 0.0)
        self._failover = state.failover
        return state

    def now(self) -> float:
        return time.monotonic() - self._t0

    def snapshot(self) -> StatsSnapshot:
        ups = [self.source, self.target]
        return merge(
            [parse_stats(a.stats(ups), ups, ts=time.monotonic(), failover=self._failover) for a in self.admins]
        )

    def renew(self) -> None:
        """Renew the traffic lease when half an interval has passed since the last renewal. Called from
        the controller's own loop (never a helper thread), so a hung controller stops renewing too."""
        now = time.monotonic()
        if now - self._renewed_at < self.settings.interval_s / 2:
            return
        self._lease_seq += 1
        try:
            self.store.renew_lease(
                self.lease_holder,
                interval_s=self.settings.interval_s,
                length_s=self.settings.lease_s,
                seq=self._lease_seq,
            )
            self._renewed_at = now
        except OSError:  # unrenewed, the lease lapses and the control plane returns traffic: the safe side
            pass

    def apply(self, weight: float) -> None:
        self.renew()
        try:
            state = self.store.set_weights(split(self.source, self.target, weight))
        except TrafficError as exc:  # someone rolled back from outside between two intervals
            self.check_signals()  # the migration's own rollback request (it moves traffic first) reads as manual
            raise RolledBack(str(exc), "external", None) from None
        self.weight = weight
        if self.nodes:
            self.store.wait_applied(state.version, self.nodes, timeout_s=self.settings.apply_timeout_s, tick=self.renew)

    def check_signals(self) -> None:
        if self.rollback_signal is not None:
            sig = self.rollback_signal()
            if sig:
                why = sig.get("reason") if isinstance(sig, dict) else None
                asked = sig.get("ts") if isinstance(sig, dict) else None
                # The request's own timestamp (Migration.request_rollback writes one) gives request → action.
                since = (
                    time.monotonic() - max(0.0, time.time() - float(asked)) if isinstance(asked, int | float) else None
                )
                raise RolledBack(f"manual rollback: {why or 'requested'}", "manual", since)
        state = self.store.read()
        if state.rolled_back:
            raise RolledBack(
                f"rolled back from outside: {state.rolled_back.get('reason')}", *rolled_back_outside(state)
            )

    def sleep_to(self, deadline: float) -> None:
        while True:
            self.renew()
            left = deadline - self.now()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    def return_to_source(self, reason: str, decided: float) -> tuple[float, float | None]:
        """Write 100% source in one state version and wait for every Envoy's ACK: (written at, epoch seconds;
        seconds from ``decided`` until applied, None when the control plane did not confirm it)."""
        rollback_to_source(self.store.dir, reason, actor="gpumigrate-ramp")
        rolled_at = time.time()
        applied: float | None = None
        try:
            state = self.store.read()
            if self.nodes:
                self.store.wait_applied(state.version, self.nodes, timeout_s=self.settings.apply_timeout_s)
            applied = round(time.monotonic() - decided, 3)
        except TrafficError:
            applied = None  # written; Envoy picks it up when the control plane is back
        self.weight = 0.0
        return rolled_at, applied
