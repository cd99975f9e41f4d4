"""The ``gpumigrate`` command line.

The CLI is the application layer: it sits above every subpackage and imports them lazily inside
commands, so ``gpumigrate --help`` stays fast and a missing optional piece fails one command only.
Every :class:`~gpumigrate.errors.GpumigrateError` becomes its documented exit code and a one-line
message; anything else becomes exit 1 with a message (the traceback only with GPUMIGRATE_DEBUG=1).
"""

from __future__ import annotations

import errno
import os
import sys

import typer

from gpumigrate.cli import (
    cost_cmd,
    demo_cmd,
    frontdoor_cmd,
    gc_cmd,
    hosts_cmd,
    image_cmd,
    migration_cmd,
    parity_cmd,
    plan_cmd,
    snapshot_cmd,
    traffic_cmd,
)
from gpumigrate.cli.output import fail
from gpumigrate.errors import EXIT_FAILURE, EXIT_INVALID, GpumigrateError
from gpumigrate.flows import prefect_env
from gpumigrate.settings import Identity, set_identity_resolver

app = typer.Typer(
    name="gpumigrate",
    help="Move running GPU workloads between hosts and clouds with no downtime.\n\n"
    "Exit codes: 0 completed, 2 invalid input or denied by policy (nothing moved), "
    "3 rolled back (the source still serves), 1 any other failure.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(plan_cmd.app, name="plan")
migration_cmd.register(app)
app.add_typer(hosts_cmd.app, name="hosts")
demo_cmd.register(app)
app.add_typer(image_cmd.app, name="image")
app.add_typer(parity_cmd.app, name="parity")
cost_cmd.register(app)
app.add_typer(traffic_cmd.app, name="traffic")
app.add_typer(frontdoor_cmd.app, name="frontdoor")
app.add_typer(snapshot_cmd.app, name="snapshot")
gc_cmd.register(app)


# OSErrors that mean "this path cannot be used" (too long, a file where a folder must be, not allowed...)
_PATH_ERRORS = {
    errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EACCES, errno.EROFS, errno.ENOENT, errno.EEXIST,
}  # fmt: skip


def _authenticated_identity() -> Identity | None:
    """The actor of this command's audit records (gpumigrate/AUDIT.md), looked up on the first record."""
    from gpumigrate.infra.identity import resolve_identity

    return resolve_identity()


def main(argv: list[str] | None = None) -> None:
    # Prefect's settings are read when it is first imported (lazily, by the commands that run flows):
    # project-local PREFECT_HOME, no analytics, and its console quiet (the CLI prints its own progress).
    prefect_env.configure(quiet_console=True)
    set_identity_resolver(_authenticated_identity)
    try:
        app(args=argv, standalone_mode=True)
    except GpumigrateError as exc:
        fail(str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted")
        sys.exit(130)
    except OSError as exc:
        if exc.errno not in _PATH_ERRORS or os.environ.get("GPUMIGRATE_DEBUG"):
            _unexpected(exc)
        # A path a user gave (an argument, GPUMIGRATE_HOME, a key file) that the system cannot use.
        fail(f"cannot use {exc.filename!s}: {exc.strerror}")
        sys.exit(EXIT_INVALID)
    except SystemExit:
        raise
    except ValueError as exc:
        if "embedded null byte" not in str(exc):
            _unexpected(exc)
        fail("a path or name holds a NUL character (\\x00): no file can have that name")  # os.fspath refused it
        sys.exit(EXIT_INVALID)
    except Exception as exc:  # the last line of defence: no traceback for users
        _unexpected(exc)


def _unexpected(exc: Exception) -> None:
    if os.environ.get("GPUMIGRATE_DEBUG"):
        raise exc
    fail(f"unexpected {type(exc).__name__}: {exc} (set GPUMIGRATE_DEBUG=1 for the traceback)")
    sys.exit(EXIT_FAILURE)
