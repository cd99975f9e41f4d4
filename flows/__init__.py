"""gpumigrate.flows — the migration as Prefect flows: one module per phase, their undo, the demo.

Importing this package is cheap (no Prefect). Entry points:

- ``gpumigrate.flows.context.RunContext.create(plan_path, *, migration_id, resume)`` then
  ``gpumigrate.flows.run.run_migration(migration_id) -> MigrationResult``
- ``gpumigrate.flows.migrate.migrate_flow`` / ``rollback.rollback_flow`` / ``cost_move.cost_move_flow`` /
  ``host_actions.host_action_flow``: the flows behind the deployments in ``prefect.yaml``
- ``gpumigrate.flows.phases.<phase>.run(ctx)``: each phase as a plain function; ``flows.undo`` its undo
- ``gpumigrate.flows.demo.run_demo(*, fault=None, watch=None) -> MigrationResult``

See flows/README.md and flows/MULTIHOST.md.
"""
