"""Hostile input through the CLI: every case exits 0 or 2, never with a traceback, never hanging.

Hundreds of cases run in-process through ``gpumigrate.cli.main`` (output captured, a per-case alarm);
a handful run as real subprocesses (argv bytes that are not UTF-8, the first crash report's plan).
Values: rich markup, control characters, NUL, very long strings, unicode, path traversal, shell
metacharacters, YAML tricks, URLs of every store kind. Inputs: every string field of every example
plan, migration ids, option values, environment values.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CASE_TIMEOUT_S = 20
FINGERPRINT = "sha256:" + "ab" * 32

HOSTILE = [
    "[/bold]", "[bold red]x[/]", "[/prefix]", "[link=file:///etc/passwd]click[/link]", "[", "]", "x\\", "[/]",
    "a\x00b", "\x00", "\x1b[31mred\x1b[0m\x1b]0;title\x07", "line\r\nnext", "\x7f\x9b\x85", "\u202eevil.yaml",
    "x" * 20_000, "ünïcödé 日本語 🙂 e\u0301", "../../../../etc/passwd", "/etc/shadow", "~root/x", "",
    " ", "$(touch /tmp/gm-pwned)", "`id`", "; rm -rf / #", "a | cat && echo", "'\"", "{name}", "{0}{{", "%s%n",
    "yes", "null", "~", "!!python/object/apply:os.system ['id']", "*alias", "&anchor x", "- a", "{a: b}",
    "1e400", "-0", "0x1f", "2001:db8::1", f"stream://127.0.0.1:9?fingerprint={FINGERPRINT}",
    f"stream://[::1]:9?fingerprint={FINGERPRINT}[/x]", "s3://bucket/[/x]", "s3://B_A_D/..", "gs://b/../..",
    "gs://[x]", "file:///../../etc", "file://", "file:///tmp/a\x00b", "http://[::1", "http://a:99999",
    "http://u:p@[/x]:80", "https://127.0.0.1:1/[/path]?q=[/x]",
]  # fmt: skip

# YAML documents that are tricks in themselves, fed whole as a plan.
YAML_TRICKS = [
    "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b]\n"
    "d: &d [*c, *c, *c, *c, *c, *c]\ne: [*d, *d, *d, *d, *d, *d, *d]\n",
    "[" * 5000 + "]" * 5000,
    "{" * 5000 + "}" * 5000,
    "!!python/object/apply:os.system ['id']\n",
    "workload: !!binary AAAA\n",
    "version: 1\nversion: 2\n",
    "\ufeffversion: 1\n",
    "key: \x07\n",
    "- \t- a\n",
    "a: b: c\n",
    "? [a, b]\n: c\n",
    "",
    "%YAML 9.9\n---\na: 1\n",
]  # fmt: skip


class CaseTimeout(BaseException):
    """Raised by the per-case alarm; a BaseException so that no ``except Exception`` can swallow it."""


@dataclass
class Outcome:
    code: int
    out: str


def _alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout()


def run_cli(argv: list[str]) -> Outcome:
    """``gpumigrate argv`` in this process, output captured; an escaping exception is the test's failure."""
    from gpumigrate.cli import main

    buf = io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT_S)
    code: Any = 0
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            main(argv)
    except SystemExit as exc:
        code = exc.code
    except CaseTimeout:
        pytest.fail(f"gpumigrate {argv!r:.300} hung for {CASE_TIMEOUT_S} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return Outcome(0 if code is None else code if isinstance(code, int) else 1, buf.getvalue())


def assert_handled(outcome: Outcome, what: str, allowed: tuple[int, ...] = (0, 2)) -> None:
    assert outcome.code in allowed, f"{what}: exit {outcome.code}\n{outcome.out[-2000:]}"
    assert "Traceback" not in outcome.out and "unexpected " not in outcome.out, f"{what}:\n{outcome.out[-2000:]}"


@pytest.fixture(autouse=True)
def _quiet_env(gm_home: Path, no_cloud_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUMIGRATE_DEBUG", raising=False)
    monkeypatch.setenv("GPUMIGRATE_IDENTITY", "none")
    monkeypatch.setenv("COLUMNS", "200")


# ----------------------------------------------------------------------------- plans
def _string_paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _string_paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _string_paths(v, (*path, i))
    elif isinstance(node, str):
        yield path


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for part in path[:-1]:
        doc = doc[part]
    doc[path[-1]] = value


def _plan_cases() -> list[tuple[str, tuple[Any, ...], str]]:
    cases = []
    values = itertools.cycle(HOSTILE)
    for plan in EXAMPLES:
        doc = yaml.safe_load(plan.read_text())
        for path in _string_paths(doc):
            for _ in range(5):  # every field meets five hostile values; every value meets many fields
                cases.append((plan.name, path, next(values)))
    return cases


PLAN_CASES = _plan_cases()


@pytest.mark.parametrize("chunk", range(4))
def test_every_string_field_of_every_example_plan(chunk: int, tmp_path: Path) -> None:
    for i, (name, path, value) in enumerate(PLAN_CASES):
        if i % 4 != chunk:
            continue
        doc = yaml.safe_load((REPO / "examples" / name).read_text())
        _set(doc, path, value)
        plan = tmp_path / name  # beside its golden inputs' relative path, like the original
        plan.write_text(yaml.safe_dump(doc, allow_unicode=True))
        command = ["plan", "show", str(plan)] if i % 3 == 0 else ["plan", "validate", str(plan), "--json"]
        assert_handled(run_cli(command), f"{name} {'.'.join(map(str, path))} = {value!r:.80}")


def test_plan_count_covers_every_field() -> None:
    fields = {(name, path) for name, path, _ in PLAN_CASES}
    assert len(fields) >= 60 and len(PLAN_CASES) >= 5 * len(fields)


@pytest.mark.parametrize("index", range(len(YAML_TRICKS)))
def test_yaml_tricks(index: int, tmp_path: Path) -> None:
    plan = tmp_path / "trick.yaml"
    plan.write_text(YAML_TRICKS[index])
    for command in (["plan", "validate", str(plan)], ["plan", "show", str(plan)], ["cost", str(plan)]):
        assert_handled(run_cli(command), f"{command[:2]} of trick {index}")


# ----------------------------------------------------------------------------- ids, options, URLs
def test_migration_ids_and_options() -> None:
    for value in HOSTILE:
        for command in (["status", value], ["audit", value, "--json"], ["audit", "--log", value],
                        ["audit", "--log", "policy", "--anchor", value], ["rollback", value, "--reason", value],
                        ["retire", value]):  # fmt: skip
            assert_handled(run_cli(command), f"{command[0]} {value!r:.80}")


@pytest.fixture
def echo(json_http: Callable[[Any], str]) -> str:
    """Answers every method and path alike, so that a hostile value the CLI accepts reaches a passing check."""
    return json_http(lambda method, path, headers, body: (200, {"a": "x"}))


def test_parity_check_urls_paths_and_fields(tmp_path: Path, echo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # --out values land here
    golden = tmp_path / "g.jsonl"
    golden.write_text('{"id": "a", "text": "x"}\n')
    ok = ["--source", echo, "--target", echo, "--inputs", str(golden)]
    for value in HOSTILE:
        # A well-formed URL of a service that is down is no bad input: the documented answer is exit 1.
        reachable = _well_formed(value) and value.split("/")[2] != "127.0.0.1:1"
        for args in (
            ["--source", value, "--target", echo, "--inputs", str(golden), "--path", "/x", "--field", "a:exact"],
            ["--source", echo, "--target", value, "--inputs", str(golden), "--path", "/x", "--field", "a:exact"],
        ):  # fmt: skip
            allowed = (0, 2) if reachable or not _well_formed(value) else (1,)
            assert_handled(run_cli(["parity", "check", *args, "--no-environment", "--fast"]), f"{args}", allowed)
        for args in (
            [*ok, "--path", value, "--field", "a:exact"],
            [*ok, "--path", "/x", "--field", value],
            [*ok, "--path", "/x", "--field", "a:exact", "--method", value],
            ["--source", echo, "--target", echo, "--inputs", value, "--path", "/x", "--field", "a:exact"],
            [*ok, "--path", "/x", "--field", "a:exact", "--out", value, "--atol", "-1"],
            [*ok, "--path", "/x", "--field", "a:exact", "--out",
             value[:200] if not value.startswith(("/", "~", "file")) and ".." not in value else "out"],
        ):  # fmt: skip
            assert_handled(run_cli(["parity", "check", *args, "--no-environment", "--fast"]), f"{args} {value!r:.80}")


def _well_formed(url: str) -> bool:
    from gpumigrate.errors import InvalidInputError
    from gpumigrate.parity.urls import check_url

    try:
        check_url(url, "x")
    except InvalidInputError:
        return False
    return True


def test_store_urls() -> None:
    for value in HOSTILE:
        if value.startswith(("s3://", "gs://")):
            continue  # a bucket's location is asked of the cloud: not a local check
        assert_handled(run_cli(["image", "region", value]), f"image region {value!r:.80}")


# ----------------------------------------------------------------------------- environment
ENV_NAMES = ("GPUMIGRATE_HOME", "GPUMIGRATE_OPERATOR", "PREFECT_API_URL", "GPUMIGRATE_AUDIT_ANCHORS",
             "GPUMIGRATE_AUDIT_KEY", "GPUMIGRATE_AUDIT_KEY_FILE", "GPUMIGRATE_IDENTITY", "XDG_CONFIG_HOME",
             "GPUMIGRATE_CONTROL_KEY_FILE")  # fmt: skip


@pytest.mark.parametrize("name", ENV_NAMES)
def test_environment_values(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # a relative GPUMIGRATE_HOME lands here, never in the checkout
    for value in HOSTILE[::3]:  # a third of the values, every kind represented, for nine variables
        if "\x00" in value:
            continue  # the OS cannot put a NUL into an environment variable
        monkeypatch.setenv(name, value)
        for command in (["plan", "validate", str(REPO / "examples" / "local-demo.yaml")], ["status", "nope"],
                        ["audit", "--log", "policy"]):  # fmt: skip
            allowed = (0, 2) if command[0] != "audit" else (0, 1, 2)  # a policy log whose key changed: 1
            assert_handled(run_cli(command), f"{name}={value!r:.80} {command[0]}", allowed)


# ----------------------------------------------------------------------------- console output itself
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text())
def test_any_message_prints_as_given(message: str) -> None:
    from gpumigrate.cli.output import console, fail
    from gpumigrate.terminal import clean

    with console.capture() as cap:
        fail(message)
    printed = cap.get()
    assert printed.startswith("error: ")
    assert clean(message).replace("\n", "") in printed.replace("\n", "")


# ----------------------------------------------------------------------------- real processes
def test_a_handful_through_real_processes(cli_cmd: list[str], tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "examples" / "local-demo.yaml").read_text())
    doc["transfer"]["store"] = f"stream://127.0.0.1:9100?fingerprint={FINGERPRINT}"  # the first crash report
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(doc))
    env = {k: v for k, v in os.environ.items() if k != "GPUMIGRATE_DEBUG"}
    cases: list[list[Any]] = [
        ["plan", "validate", str(plan)],
        ["status", "[/bold]"],
        ["audit", os.fsencode("m-\udcff")],  # argv bytes that are not UTF-8
        ["plan", "validate", os.fsencode(str(tmp_path / "pl\udcfean.yaml"))],
        ["parity", "check", "--source", "http://[::1", "--target", "x", "--inputs", "\u202e"],
    ]
    for args in cases:
        proc = subprocess.run([*map(os.fsencode, cli_cmd), *map(os.fsencode, args)], capture_output=True, env=env,
                              timeout=120)  # fmt: skip
        err = proc.stderr.decode(errors="replace")
        assert proc.returncode in (0, 2), (args, err)
        assert "Traceback" not in err, (args, err)
