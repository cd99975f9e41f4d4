"""gpumigrate: move running GPU workloads between hosts and clouds with no downtime.

The public core API, readable in one screen:

- :func:`load_plan` / :class:`Plan`: the validated migration plan.
- :class:`Migration`: one migration's state record and audit log.
- :class:`MigrationResult`: the JSON contract of ``migrate`` and ``demo``.
- :mod:`gpumigrate.errors`: one exception hierarchy, each error with its CLI exit code.
- :mod:`gpumigrate.interfaces`: the Protocols providers, snapshot backends, stores and gates implement.
"""

from gpumigrate.errors import GpumigrateError
from gpumigrate.plan import Plan, load_plan
from gpumigrate.result import MigrationResult
from gpumigrate.state import Migration

__version__ = "0.1.0"
__all__ = ["GpumigrateError", "Migration", "MigrationResult", "Plan", "__version__", "load_plan"]
