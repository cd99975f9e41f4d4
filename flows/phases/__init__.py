"""The eight phases of a migration, one module each, in the order they run.

``preflight`` → ``provision`` → ``snapshot`` → ``transfer`` → ``restore`` → ``parity`` → ``ramp`` →
``finalize``. Each module's ``run(ctx) -> dict`` calls the sibling libraries directly and returns the
small result kept in the state record; facts later phases need go to ``ctx.update`` (the runtime).
No Prefect here: the flow (``flows/migrate.py``), the CLI and the tests call them alike. Their undo
is ``flows/undo.py``.
"""
