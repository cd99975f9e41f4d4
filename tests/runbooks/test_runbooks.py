"""Every command in runbooks/*.md exists: gpumigrate commands parse with the CLI's own parser,
prefect commands answer --help, make targets dry-run. A renamed command or option fails here."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import typer

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = sorted((REPO / "runbooks").glob("*.md"))
REQUIRED = {"migrate", "rollback", "audit", "residency-denial", "target-degraded", "scheduled-moves", "prefect-ui"}
_BLOCK = re.compile(r"```sh\n(.*?)```", re.S)


def commands(path: Path) -> list[list[str]]:
    out = []
    for block in _BLOCK.findall(path.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            argv = shlex.split(line, comments=True)  # a trailing "# ..." is a comment, as in sh
            while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):  # VAR=value prefixes
                argv.pop(0)
            out.append(argv)
    return out


ALL = [(p.stem, argv) for p in RUNBOOKS for argv in commands(p)]


def test_every_runbook_exists_and_has_commands() -> None:
    assert {p.stem for p in RUNBOOKS} >= REQUIRED
    for p in RUNBOOKS:
        if p.stem in REQUIRED:
            assert commands(p), f"{p.name} has no ```sh command"


def test_every_command_is_of_this_project() -> None:
    for name, argv in ALL:
        assert argv[0] in ("gpumigrate", "prefect", "make"), f"{name}: {argv[0]!r} is not a command of this project"


def _gpumigrate_root() -> Any:
    from gpumigrate.cli import app

    return typer.main.get_command(app)


def _is_group(cmd: Any) -> bool:
    # Typer vendors its own click: duck-type rather than isinstance(click.Group).
    return hasattr(cmd, "list_commands") and hasattr(cmd, "get_command")


@pytest.mark.parametrize("argv", [a for _, a in ALL if a[0] == "gpumigrate"], ids=lambda a: " ".join(a[1:4]))
def test_gpumigrate_command_parses(argv: list[str]) -> None:
    """Walk the real command tree and let click parse the arguments: unknown commands/options fail."""
    cmd = _gpumigrate_root()
    args = argv[1:]
    path = ["gpumigrate"]
    while _is_group(cmd) and args and not args[0].startswith("-"):
        sub = cmd.get_command(cmd.make_context("gpumigrate", [], resilient_parsing=True), args[0])
        assert sub is not None, f"`{' '.join(path)} {args[0]}` does not exist"
        path.append(args.pop(0))
        cmd = sub
    assert not _is_group(cmd), f"`{' '.join(path)}` needs a subcommand"
    try:
        ctx = cmd.make_context(" ".join(path), list(args), resilient_parsing=False)
    except Exception as exc:  # click's UsageError (vendored by typer): unknown option, missing argument
        pytest.fail(f"`{' '.join(argv)}` does not parse: {exc}")
    assert ctx.command is cmd


def _run_help(argv: list[str]) -> tuple[list[str], int, str]:
    if argv[0] == "make":
        proc = subprocess.run(["make", "-n", *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        return argv, proc.returncode, proc.stderr[-500:]
    words = [w for w in argv[1:] if not w.startswith("-") and "=" not in w and "$" not in w]
    exe = Path(sys.executable).parent / "prefect"
    env = {**os.environ, "PREFECT_API_URL": "", "PREFECT_HOME": str(REPO / ".prefect")}
    proc = subprocess.run([str(exe), *words[:2], "--help"], capture_output=True, text=True, timeout=120, env=env)
    return argv, proc.returncode, proc.stderr[-500:]


def test_prefect_and_make_commands_exist() -> None:
    others = {tuple(a) for _, a in ALL if a[0] in ("prefect", "make")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_run_help, [list(a) for a in others]))
    bad = [(" ".join(a), err) for a, rc, err in results if rc != 0]
    assert not bad, bad
