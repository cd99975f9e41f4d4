"""The Prefect artifact anchor against Prefect's real API (a test harness server)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumigrate.audit import AuditLog
from gpumigrate.audit_anchor import anchor_from_url
from gpumigrate.audit_anchor_prefect import PrefectArtifactAnchor, artifact_key
from gpumigrate.errors import IntegrityError
from gpumigrate.state import Migration


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[None]:
    home = tempfile.mkdtemp(prefix="gm-prefect-anchor-")
    saved = {k: os.environ.get(k) for k in ("PREFECT_HOME", "PREFECT_API_URL")}
    os.environ.setdefault("PREFECT_HOME", home)  # only when no other test set Prefect up in this process
    os.environ["PREFECT_API_URL"] = os.environ.get("PREFECT_API_URL") or ""
    from tests.support.prefect import harness

    try:
        with harness():
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)


def test_heads_published_as_artifacts_verify(prefect_api: None, gm_home: Path) -> None:
    m = Migration.create("m-prefect", "x: 1\n")
    m.record("phase.preflight.completed", {})
    anchor = anchor_from_url("prefect")
    assert isinstance(anchor, PrefectArtifactAnchor)
    from prefect import flow

    @flow
    def phase_end(path: str) -> dict[str, object]:  # what the migrate flow calls at the end of a phase
        return AuditLog(path).anchor_to(PrefectArtifactAnchor())

    assert phase_end(str(m.audit.path))["count"] == 2
    m.record("phase.provision.started", {})
    (chain,) = anchor.chains(m.audit.anchor_name)
    assert artifact_key(m.audit.anchor_name, chain).startswith("audit-")
    assert [h["count"] for h in anchor.heads(m.audit.anchor_name, chain)] == [2]
    verified = m.verify_audit(extra_anchors=[anchor])
    assert verified.anchors[-1] == {"anchor": "prefect artifacts", "heads": 1, "latest_count": 2}

    lines = m.audit.path.read_bytes().splitlines(keepends=True)
    m.audit.path.write_bytes(b"".join(lines[:1]))
    with pytest.raises(IntegrityError, match="truncated: the head anchored in prefect artifacts"):
        AuditLog(m.audit.path, anchors=[anchor]).verify()  # the Prefect heads alone catch it
