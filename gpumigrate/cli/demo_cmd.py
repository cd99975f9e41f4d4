"""``gpumigrate demo``: the whole migration on this machine (see gpumigrate.flows.demo)."""

from __future__ import annotations

import typer

from gpumigrate.cli.output import emit_json


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(
    fault: str | None = typer.Option(
        None,
        "--fault",
        help="Break the target during the ramp to show the automatic rollback (exit 3): "
        "target-errors, target-slow, target-drift or target-crash.",
    ),
    workload: str = typer.Option(
        "inference",
        "--workload",
        help="inference (the tiny inference server under load) or llm (an OpenAI-compatible LLM server moved with "
        "its clients' streams in flight).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result JSON as the last line of stdout."),
    no_live: bool = typer.Option(False, "--no-live", help="Plain lines instead of the live view (logs, CI)."),
) -> None:
    """Two local hosts, the tiny inference server, Envoy, a load generator, then the migrate flow to cutover.

    Prints where the report and the ramp chart are. Exit 0 completed, 3 rolled back, 1 when the --fault asked
    for could not be injected into the target.
    """
    from functools import partial

    from gpumigrate.cli.live import summary, watching
    from gpumigrate.errors import InvalidInputError

    if workload not in ("inference", "llm"):
        raise InvalidInputError(f"--workload {workload!r} is not one of inference, llm")
    if workload == "llm":
        if fault is not None:
            raise InvalidInputError("--fault breaks the inference server's target; it does not apply to --workload llm")
        from gpumigrate.flows.demo_llm import run_llm_demo

        result = run_llm_demo(watch=partial(watching, live=not no_live))
    else:
        from gpumigrate.flows.demo import DemoFaultError, run_demo

        try:
            result = run_demo(fault=fault, watch=partial(watching, live=not no_live))
        except DemoFaultError as exc:  # the migration's own outcome first, then why the demo failed (exit 1)
            summary(exc.result)
            raise
    summary(result)
    if json_out:
        emit_json(result)
    raise typer.Exit(result.exit_code)
