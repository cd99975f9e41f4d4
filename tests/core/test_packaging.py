"""Packaging and architecture: the wheel installs and runs; imports flow one way."""

from __future__ import annotations

import ast
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("flows", "snapshot", "transfer", "parity", "traffic", "infra", "workloads")
SIBLINGS = ("snapshot", "transfer", "parity", "traffic", "infra")


@pytest.mark.slow
def test_wheel_installs_into_fresh_venv_and_runs(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("gpumigrate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for sub in SUBPACKAGES:
        assert f"gpumigrate/{sub}/__init__.py" in names, f"{sub}/ is not mapped into the wheel"
    assert "gpumigrate/cli/__init__.py" in names
    # the huff plane coder is compiled into the wheel (setup.py); without it images pack with zstd planes
    assert any(n.startswith("gpumigrate/transfer/_huffplane") and n.endswith(".so") for n in names), names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    # Dependencies come from the dev venv through a path entry (processed .pth files there are not,
    # so the editable install of the checkout stays invisible): what runs is the wheel's own code.
    site = Path(
        subprocess.check_output(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import gpumigrate.transfer.planehuff as h, gpumigrate; assert h.AVAILABLE, 'no huff coder'; print(gpumigrate.__file__)",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    help_out = subprocess.run(
        [
            str(
                venv / "bin" / "gpumigrate",
            ),
            "--help",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert help_out.returncode == 0, help_out.stderr
    assert "migrate" in help_out.stdout + help_out.stderr


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_core_imports_no_subpackage() -> None:
    for path in (REPO / "gpumigrate").glob("*.py"):
        for mod in _imports(path):
            for sub in SUBPACKAGES:
                assert not mod.startswith(f"gpumigrate.{sub}"), f"core module {path.name} imports {mod}"


@pytest.mark.parametrize("folder", SIBLINGS)
def test_siblings_do_not_import_each_other(folder: str) -> None:
    others = [s for s in (*SIBLINGS, "flows", "workloads") if s != folder]
    for path in (REPO / folder).rglob("*.py"):
        for mod in _imports(path):
            for other in others:
                assert not mod.startswith(f"gpumigrate.{other}"), f"{folder}/{path.name} imports {mod}"


def test_flows_never_import_the_cli() -> None:
    for path in (REPO / "flows").rglob("*.py"):
        for mod in _imports(path):
            assert not mod.startswith("gpumigrate.cli"), f"flows/{path.relative_to(REPO / 'flows')} imports {mod}"


def test_no_import_circle_in_the_flows() -> None:
    """Every import among flows' modules (function-level ones too) runs one way."""
    modules = {
        "gpumigrate.flows." + ".".join(p.relative_to(REPO / "flows").with_suffix("").parts): p
        for p in (REPO / "flows").rglob("*.py")
        if p.name != "__init__.py"
    }

    def imported(path: Path) -> set[str]:  # `from package import module` names the module too
        found = _imports(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        return found

    graph = {name: {m for m in imported(path) if m in modules and m != name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import circle: " + " -> ".join([*trail[trail.index(name) :], name]))
        if name in done:
            return
        for nxt in sorted(graph[name]):
            visit(nxt, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
