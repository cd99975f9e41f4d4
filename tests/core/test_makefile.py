"""`make setup` as this machine class runs it: pip's per-package warning about an extra index that lacks the package
("Location '...' is ignored", about 240 lines, issue 35 finding 9) is dropped, and a failed install still fails."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = (REPO / "Makefile").read_text()
WARNING = "WARNING: Location 'file:///opt/pypi-more/simple/six/' is ignored: it is neither a file nor a directory."


def _quiet_pip() -> str:
    found = re.search(r"^QUIET_PIP := (.+)$", MAKEFILE, re.M)
    assert found, "the Makefile defines QUIET_PIP"
    return found.group(1).replace("$$", "$")  # as make hands it to the shell


def _run(status: int) -> subprocess.CompletedProcess[str]:
    pip = f"printf '%s\\n' \"{WARNING}\" 'ERROR: the real news' >&2; exit {status}"
    return subprocess.run(["bash", "-c", f"( {pip} ) {_quiet_pip()}"], capture_output=True, text=True, timeout=30)


def test_every_pip_install_of_setup_drops_the_ignored_location_warnings() -> None:
    installs = [line for line in MAKEFILE.splitlines() if "pip install" in line]
    assert installs and all(line.rstrip().endswith("$(QUIET_PIP)") for line in installs), installs
    assert re.search(r"^SHELL\s*:= /bin/bash$", MAKEFILE, re.M)  # PIPESTATUS


def test_the_filter_keeps_other_output_and_pips_exit_status() -> None:
    ok, failed = _run(0), _run(1)
    assert ok.returncode == 0 and failed.returncode != 0
    for out in (ok, failed):
        assert "is ignored" not in out.stdout + out.stderr and "ERROR: the real news" in out.stdout + out.stderr
