"""Packaging and architecture: the wheel installs and runs; imports flow one way."""

from __future__ import annotations

import ast
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("flows", "snapshot", "transfer", "parity", "traffic", "infra", "workloads", "agent")
SIBLINGS = ("snapshot", "transfer", "parity", "traffic", "infra")
# The public SDK (agent/) sits above snapshot and transfer, inside a user's process: it may import
# them and the core, never the orchestrator's side; and only user programs import it.
AGENT_MAY_NOT_IMPORT = ("flows", "traffic", "infra", "parity", "workloads", "cli")
# User programs: the reference workloads, the examples, the tests, and benchmarks that stand in for a user's
# process with the SDK in it (bench/live_round.py is a source's rounds in one process).
AGENT_IMPORTERS = ("workloads", "examples", "tests", "bench")
# What importing the SDK into a user's process must not cost.
HEAVY = ("prefect", "great_expectations", "boto3", "botocore", "google", "envoy")


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
    assert any(n.startswith("gpumigrate/transfer/format/_huffplane") and n.endswith(".so") for n in names), names

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
            "import gpumigrate.transfer.format.planehuff as h, gpumigrate; assert h.AVAILABLE, 'no huff coder'; print(gpumigrate.__file__)",
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


def test_every_package_folder_is_installed() -> None:
    """Every folder with an ``__init__.py`` under a mapped folder is in pyproject's ``packages`` list: a subpackage
    left out of it is missing from the wheel (and from a fresh install), though the checkout imports it."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    for name, folder in config["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            package = ".".join([name, *init.parent.relative_to(REPO / folder).parts])
            assert package in listed, f"{init.parent} is not in [tool.setuptools] packages"


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
    others = [s for s in (*SIBLINGS, "flows", "workloads", "agent") if s != folder]
    for path in (REPO / folder).rglob("*.py"):
        for mod in _imports(path):
            for other in others:
                assert not mod.startswith(f"gpumigrate.{other}"), f"{folder}/{path.name} imports {mod}"


def test_flows_never_import_the_cli() -> None:
    for path in (REPO / "flows").rglob("*.py"):
        for mod in _imports(path):
            assert not mod.startswith("gpumigrate.cli"), f"flows/{path.relative_to(REPO / 'flows')} imports {mod}"


# The folders whose modules import each other one way only (snapshot/ and transfer/ join once reshaped: issue 30).
NO_CIRCLES = ("flows", "parity", "traffic", "infra", "workloads")


@pytest.mark.parametrize("folder", NO_CIRCLES)
def test_no_import_circle_inside_a_folder(folder: str) -> None:
    """Every import among a folder's modules (function-level and TYPE_CHECKING ones too) runs one way."""
    modules = {
        f"gpumigrate.{folder}." + ".".join(p.relative_to(REPO / folder).with_suffix("").parts): p
        for p in (REPO / folder).rglob("*.py")
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


def test_the_sdk_imports_only_core_snapshot_and_transfer() -> None:
    for path in (REPO / "agent").rglob("*.py"):
        for mod in _imports(path):
            for other in AGENT_MAY_NOT_IMPORT:
                assert not mod.startswith(f"gpumigrate.{other}"), f"agent/{path.name} imports {mod}"


def test_only_user_programs_import_the_sdk() -> None:
    skip = ("agent", "build", "dist")  # the SDK itself, and build outputs (copies of the tree)
    folders = [p for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in skip]
    for folder in folders:
        if folder.name in AGENT_IMPORTERS:
            continue
        for path in folder.rglob("*.py"):
            for mod in _imports(path):
                assert not mod.startswith("gpumigrate.agent"), f"{path.relative_to(REPO)} imports {mod}"


@pytest.mark.parametrize("module", ["gpumigrate.agent", "gpumigrate.agent.lightning"])
def test_importing_the_sdk_costs_no_orchestrator_dependency(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"heavy = sorted({{m for m in sys.modules if m.split('.')[0] in {HEAVY!r}}})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"


def test_the_fast_tier_names_only_test_files_that_exist() -> None:
    """`make test-fast` fails before running anything when a file it names moved: every path must exist."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("FAST_TESTS"))
    paths = line.split(":=", 1)[1].split()
    assert paths, "FAST_TESTS names no test"
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"Makefile FAST_TESTS names paths that do not exist: {missing}"
