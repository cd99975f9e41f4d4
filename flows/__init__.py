"""gpumigrate.flows — Prefect flows (migrate, rollback, cost-move, host actions), the demo, the runbooks' CLI backend.

Importing this package is cheap (no Prefect). Entry points:

- ``gpumigrate.flows.run.run_migration_cli(plan_path, *, migration_id, resume) -> MigrationResult``
- ``gpumigrate.flows.run.rollback_cli(migration_id, *, reason) -> dict`` (with ``exit_code``)
- ``gpumigrate.flows.migrate.migrate_flow`` / ``rollback.rollback_flow`` / ``cost_move.cost_move_flow`` /
  ``host_actions.host_action_flow``: the flows behind the deployments in ``prefect.yaml``
- ``gpumigrate.flows.demo.run_demo(*, fault=None, live=True) -> MigrationResult``

See flows/README.md and flows/MULTIHOST.md.
"""
