"""Golden-input files: the shipped one loads; bad ones are exit-2 errors naming the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumigrate.errors import EXIT_INVALID, InvalidInputError
from gpumigrate.parity.output import check_url, load_golden, redact_url
from gpumigrate.plan import load_plan, resolve_relative


def test_the_demo_plans_golden_file_loads(repo: Path) -> None:
    plan_path = repo / "examples" / "local-demo.yaml"
    plan = load_plan(plan_path)
    assert plan.parity.golden_inputs
    cases = load_golden(resolve_relative(plan_path, plan.parity.golden_inputs))
    assert len(cases) >= 5
    assert all("prompt" in c.request and "id" not in c.request for c in cases)


def test_comments_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    f = tmp_path / "g.jsonl"
    f.write_text('# golden set\n\n{"id": 1, "prompt": "a", "max_new_tokens": 2}\n{"id": "b", "prompt": "b"}\n')
    cases = load_golden(f)
    assert [c.id for c in cases] == ["1", "b"]
    assert cases[0].request == {"prompt": "a", "max_new_tokens": 2}


def test_any_question_shape_loads(tmp_path: Path) -> None:
    """Golden cases are the workload's own questions: nothing in them is specific to one server."""
    f = tmp_path / "g.jsonl"
    f.write_text('{"id": "e1", "sentences": ["a", "b"], "normalize": true}\n{"id": "e2", "max_new_tokens": 9000}\n')
    assert [c.request for c in load_golden(f)] == [
        {"sentences": ["a", "b"], "normalize": True},
        {"max_new_tokens": 9000},
    ]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "line 2: duplicate id"),
        ('{"prompt": "x"}\n', "line 1: 'id' must be"),
        ('{"id": "a"}\n', "nothing to send"),
        ("[1, 2]\n", "must be a JSON object"),
        ("{broken\n", "not valid JSON"),
        ("\n# only comments\n", "no cases"),
    ],
)
def test_bad_golden_files_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "g.jsonl"
    f.write_text(text)
    with pytest.raises(InvalidInputError, match=needle) as info:
        load_golden(f)
    assert info.value.exit_code == EXIT_INVALID


def test_urls_are_checked_and_redacted() -> None:
    assert check_url("http://127.0.0.1:8000/", "source") == "http://127.0.0.1:8000"
    with pytest.raises(InvalidInputError, match="target URL"):
        check_url("127.0.0.1:8000", "target")
    assert redact_url("https://alice:pw@example.com:8443/v1?token=x") == "https://example.com:8443/v1"


def test_a_url_with_a_bad_port_is_bad_input_without_leaking_credentials() -> None:
    with pytest.raises(InvalidInputError) as info:
        check_url("http://bob:pw@127.0.0.1:99999", "target")
    assert "pw" not in str(info.value) and info.value.exit_code == EXIT_INVALID
