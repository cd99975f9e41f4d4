"""The Great Expectations suite over the rules' frame (the preflight smoke test's judge).

GX 1.x in memory: one ephemeral context, one pandas data source, one dataframe asset and one suite,
created on first use and reused: importing GX is slow, validating a small frame is not (``bench/parity.py``
measures both: ``gx_cold_s``, ``gx_suite_warm``).
The suite does not depend on atol/rtol: the tolerance is already folded into the ``excess`` column by
:mod:`gpumigrate.parity.rules`, so one suite serves every plan. Analytics are switched off before
the import.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import pandas as pd

from gpumigrate.parity.rules import CHECKS

_lock = threading.Lock()
_state: dict[str, Any] = {}

# Only the key and verdict columns go to GX: raw values are for readable reasons, not for the suite.
GX_COLUMNS = ("case", "field", "position", *dict.fromkeys(c.column for c in CHECKS))


@dataclass
class GXOutcome:
    success: bool
    failed_expectations: list[str]
    result_json: dict[str, Any]


def _import_gx() -> Any:
    os.environ["GX_ANALYTICS_ENABLED"] = "false"  # must be set before the first import
    import great_expectations as gx

    return gx


def _build() -> dict[str, Any]:
    gx = _import_gx()
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    try:
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
    except Exception:  # cosmetic only: progress bars on stderr do no harm
        pass
    source = context.data_sources.add_pandas("gpumigrate-parity")
    asset = source.add_dataframe_asset("outputs")
    batch_definition = asset.add_batch_definition_whole_dataframe("whole")
    suite = gx.ExpectationSuite(name="gpumigrate-output-parity")
    suite.add_expectation(gxe.ExpectTableRowCountToBeBetween(min_value=1))
    for check in CHECKS:
        # Column expectations skip nulls by default: the not-null expectation makes a null fail.
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column=check.column))
        if check.kind == "true":
            suite.add_expectation(gxe.ExpectColumnValuesToBeInSet(column=check.column, value_set=[True]))
        else:
            suite.add_expectation(gxe.ExpectColumnValuesToBeBetween(column=check.column, max_value=0))
    suite = context.suites.add(suite)
    return {"context": context, "batch_definition": batch_definition, "suite": suite}


def _objects() -> dict[str, Any]:
    with _lock:
        if not _state:
            _state.update(_build())
        return _state


def validate_frame(frame: pd.DataFrame) -> GXOutcome:
    """Validate the rules' frame with the GX suite. Thread-safe; the GX objects are built once."""
    objs = _objects()
    data = frame[list(GX_COLUMNS)].copy()
    with _lock:  # GX's ephemeral context is not documented as thread-safe
        batch = objs["batch_definition"].get_batch(batch_parameters={"dataframe": data})
        result = batch.validate(objs["suite"])
    failed = []
    for r in result.results:
        if not r.success:
            kwargs = r.expectation_config.kwargs
            column = kwargs.get("column")
            count = (r.result or {}).get("unexpected_count")
            label = r.expectation_config.type + (f"({column})" if column else "")
            failed.append(f"{label}: {count} unexpected rows" if count is not None else label)
    return GXOutcome(success=bool(result.success), failed_expectations=failed, result_json=result.to_json_dict())
