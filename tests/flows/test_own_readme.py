"""Every `gpumigrate` command of the README's "Migrate your own service", "Migrate your own LLM server" and "Migrate a
training job" sections
parses with the CLI's own parser, and every file they name exists: a renamed command, option or example fails
here. (The commands run end to end in test_own_byo.py and test_own_training.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("## Migrate your own service", "## Migrate your own LLM server", "## Migrate a training job")
_BLOCK = re.compile(r"```sh\n(.*?)```", re.S)


def _section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end > 0 else len(text)]


def _commands() -> list[list[str]]:
    """Each `gpumigrate ...` of the sections' sh blocks, split at `&&`, `;`, `|` and a trailing `&`."""
    out: list[list[str]] = []
    for title in SECTIONS:
        for block in _BLOCK.findall(_section(title)):
            for line in block.splitlines():
                words = shlex.split(line, comments=True)
                part: list[str] = []
                for word in [*words, "&&"]:
                    if word in ("&&", ";", "|", "&", "||"):
                        if part and part[0] == "gpumigrate":
                            out.append(part)
                        part = []
                    else:
                        part.append(word)
    return out


COMMANDS = _commands()


def test_the_sections_have_their_commands() -> None:
    names = {" ".join(argv[1:3]) for argv in COMMANDS}
    assert {"frontdoor up", "image keygen"} <= names
    assert sum(1 for argv in COMMANDS if argv[1] == "migrate") == 3  # a service, an LLM server, a training job


def test_the_files_they_name_exist() -> None:
    for title in SECTIONS:
        for link in re.findall(r"\]\(([^)#]+)\)", _section(title)):
            if not link.startswith("http"):
                assert (REPO / link).exists(), f"{title}: {link} does not exist"
        for path in re.findall(r"\b(examples/[\w./-]+\.(?:ya?ml|py))\b", _section(title)):
            assert (REPO / path).is_file(), f"{title}: {path} does not exist"


def _is_group(cmd: Any) -> bool:
    return hasattr(cmd, "list_commands") and hasattr(cmd, "get_command")


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[1:3]))
def test_each_command_parses(argv: list[str]) -> None:
    from gpumigrate.cli import app

    cmd = typer.main.get_command(app)
    args, path = argv[1:], ["gpumigrate"]
    while _is_group(cmd) and args and not args[0].startswith("-"):
        sub = cmd.get_command(cmd.make_context("gpumigrate", [], resilient_parsing=True), args[0])
        assert sub is not None, f"`{' '.join(path)} {args[0]}` does not exist"
        path.append(args.pop(0))
        cmd = sub
    assert not _is_group(cmd), f"`{' '.join(path)}` needs a subcommand"
    try:
        cmd.make_context(" ".join(path), list(args), resilient_parsing=False)
    except Exception as exc:  # click's UsageError: an unknown option, a missing argument
        pytest.fail(f"`{' '.join(argv)}` does not parse: {exc}")


def test_the_sections_say_what_a_new_user_had_to_guess() -> None:
    """Issue 35, findings 7 and 9: what the README used or needed without saying it."""
    own, training = _section("## Migrate your own service"), _section("## Migrate a training job")
    assert "`{plan_dir}` (the\nfolder that holds the plan file)" in own  # the example's cwd used it unexplained
    assert "--health-path" in own  # what the front door checks, and how to change it on a running door
    assert "run_in_threadpool" in own and "`async` handler" in own  # safe points held out of the event loop
    assert "awaits its restore" in own and "They must differ" in own  # the launch contract's two paths
    assert "side effect" in training and "parity.training.steps" in training  # the parity steps run on the source
