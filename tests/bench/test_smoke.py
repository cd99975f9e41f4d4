"""Every benchmark runs: ``python bench/X.py --smoke`` as a user would start it, one case per benchmark.

A smoke run takes seconds to a minute on the CPU and exits non-zero unless what it measured came out right
(bit-identical bytes, the JSON's fields, the parity verdicts); it never judges a timing. What each one runs and
checks is in bench/README.md. Each runs in a clean environment (only PATH and a private HOME and TMPDIR), so a
benchmark that needs anything else says so in its own code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumigrate.infra import netns

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
_netns_ok, _netns_why = netns.available()

# Arguments beyond --smoke: where a benchmark writes (inside the test's folder). "{tmp}" is the test's folder.
WHERE = {
    "e2e": ["--root", "{tmp}/root"],
    "faults": ["--out", "{tmp}/out"],
    "seal": ["--store", "{tmp}/store"],
    "direct": ["--store", "{tmp}/store"],
}
SLOW = {"e2e", "e2e_ranks", "parity", "live_round", "llm_streams", "stop"}  # more than ~30 s on two busy cores
NEEDS_NETNS = {"transfer_link"}  # two network namespaces joined by a shaped link (root)
LIBRARIES = {"benchlib", "e2e_parts", "e2e_workloads", "llm_clients"}  # shared code, not a benchmark
TIMEOUT_S = 600


def _cases() -> list[object]:
    out = []
    for path in sorted(BENCH.glob("*.py")):
        name = path.stem
        if name in LIBRARIES:
            continue
        marks = [pytest.mark.slow] if name in SLOW else []
        if name in NEEDS_NETNS:
            marks += [pytest.mark.netns, pytest.mark.skipif(not _netns_ok, reason=f"network namespaces: {_netns_why}")]
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _cases())
def test_the_benchmark_runs_and_checks_what_it_measured(name: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(tmp_path)}
    argv = [sys.executable, str(BENCH / f"{name}.py"), "--smoke"]
    argv += [a.replace("{tmp}", str(tmp_path)) for a in WHERE.get(name, [])]
    t0 = time.monotonic()
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        raise AssertionError(f"bench/{name}.py --smoke did not exit within {TIMEOUT_S} s; stderr: {tail!r}") from None
    took = time.monotonic() - t0
    assert run.returncode == 0, (
        f"bench/{name}.py --smoke exited {run.returncode} after {took:.0f} s\n"
        f"stderr: {run.stderr[-3000:]}\nstdout: {run.stdout[-2000:]}"
    )
    assert run.stdout.strip(), f"bench/{name}.py --smoke printed no result"


def test_every_benchmark_is_a_case_and_documented() -> None:
    """A new benchmark gets a smoke case by being in bench/, and a section in bench/README.md."""
    names = {p.stem for p in BENCH.glob("*.py")} - LIBRARIES
    readme = (BENCH / "README.md").read_text()
    assert names, "no benchmark found"
    undocumented = sorted(n for n in names if f"`bench/{n}.py`" not in readme)
    assert not undocumented, f"bench/README.md has no section for {undocumented}"
    for name in names:
        text = (BENCH / f"{name}.py").read_text()
        assert '"--smoke"' in text, f"bench/{name}.py has no --smoke mode"
