"""gpumigrate.parity: proof that the target answers like the source before user traffic reaches it.

Public API (imported lazily: importing this package costs nothing; Great Expectations is imported
only when a GX check runs):

- :func:`check_environment(source_info, target_info, policy) -> EnvironmentReport`; its
  ``raise_if_forbidden()`` raises :class:`EnvironmentParityError` (a policy denial, exit 2).
- :func:`fetch_info(url)`, :func:`run_probe(command)`: environment facts from a service or a host.
- :func:`run_output_parity(source_url, target_url, inputs_path, *, atol, rtol, out_dir) -> OutputParityResult`:
  the golden set against both services directly, judged by the GX suite, reports in ``out_dir``.
- :class:`ToleranceComparator`: the fast :class:`~gpumigrate.interfaces.OutputComparator` for live probes
  (same rules, no GX); :class:`GXComparator`: the same through GX.
- :func:`build_requests(cases, request)`, :func:`comparator_for(request, *, atol, rtol)`: the plan's
  ``parity.request`` as the queries and the comparator the smoke test and the ramp's live probes share.
- :func:`compare_losses(source, target, *, atol, rtol, out_dir)`, :func:`training_parity(..., policy)`:
  training parity (the next steps' losses), reported like output parity.
"""

from __future__ import annotations

from gpumigrate.lazy import lazy_exports

_EXPORTS = {
    "check_environment": "environment",
    "EnvironmentReport": "environment",
    "EnvironmentParityError": "environment",
    "DEFAULT_POLICY": "environment",
    "fetch_info": "environment",
    "run_probe": "environment",
    "run_output_parity": "output",
    "compare_outputs": "output",
    "load_golden": "golden",
    "OutputParityResult": "result",
    "ToleranceComparator": "comparator",
    "GXComparator": "comparator",
    "Rules": "rules",
    "build_requests": "request",
    "comparator_for": "request",
    "rules_for": "request",
    "compare_losses": "training",
    "training_parity": "training",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
