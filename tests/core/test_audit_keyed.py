"""Keyed, anchored audit logs (gpumigrate/AUDIT.md): the re-chain attack, truncation, downgrade, keys, anchors.

The attacks are scripts that know the format (AUDIT.md is public) and can write everything under
``$GPUMIGRATE_HOME``, but hold neither the audit key nor the anchor directory, unless a test says so.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpumigrate.audit import AuditLog
from gpumigrate.audit_anchor import LocalFileAnchor
from gpumigrate.errors import IntegrityError, InvalidInputError
from gpumigrate.state import Migration

# Drops every residency.deny record, makes every actor "mallory", re-chains the log and writes the new head
# into state.json. MODE "keep" leaves the MAC fields as they were, "strip" rewrites the log as format 1
# (no MACs: a downgrade), "key" recomputes every MAC with the audit key (an insider who holds the key).
REWRITE = textwrap.dedent(
    """
    import hashlib, hmac, json, os, sys
    folder, mode = sys.argv[1], sys.argv[2]
    canon = lambda o: json.dumps(o, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    path = os.path.join(folder, "audit.jsonl")
    records = [json.loads(x) for x in open(path, "rb").read().splitlines()]
    if mode != "key-actors":
        records = [r for r in records if r["event"] != "residency.deny"]
    key = bytes.fromhex(open(os.environ["GPUMIGRATE_AUDIT_KEY_FILE"]).read().strip()) if mode.startswith("key") else None
    prev, out = "0" * 64, []
    for seq, r in enumerate(records):
        r["actor"] = "mallory"
        if "identity" in r:
            r["identity"] = {"name": "mallory", "auth": "none"}
        if mode == "strip":
            r = {k: v for k, v in r.items() if k in ("seq", "ts", "actor", "event", "data", "prev")}
        r["seq"], r["prev"] = seq, prev
        if mode.startswith("key"):
            body = {k: v for k, v in r.items() if k != "mac"}
            r["mac"] = hmac.new(key, b"gpumigrate-audit-record-v2\\n" + canon(body), hashlib.sha256).hexdigest()
        line = canon(r)
        out.append(line)
        prev = hashlib.sha256(line).hexdigest()
    open(path, "wb").write(b"".join(x + b"\\n" for x in out))
    state_path = os.path.join(folder, "state.json")
    state = json.load(open(state_path))
    state["audit_head"] = {"count": len(out), "tail": prev}
    json.dump(state, open(state_path, "w"))
    """
)


@pytest.fixture
def denied(gm_home: Path, monkeypatch: pytest.MonkeyPatch) -> Migration:
    monkeypatch.setenv("GPUMIGRATE_OPERATOR", "alice")
    m = Migration.create("m-denied", "workload: x\n")
    m.record("phase.preflight.started")
    m.record("residency.deny", {"point": "store", "region": "us-east-1", "allowed": ["EU"]})
    m.record("phase.preflight.failed", {"error": "denied by data-residency"})
    m.record("rollback.requested", {"reason": "operator"})
    return m


def _audit(cli_cmd: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli_cmd, "audit", *args], capture_output=True, text=True, env=dict(os.environ), timeout=120)


def _attack(m: Migration, mode: str) -> None:
    subprocess.run([sys.executable, "-c", REWRITE, str(m.dir), mode], check=True, timeout=60)
    assert "alice" not in m.audit.path.read_text()


def test_records_carry_actor_identity_and_mac(denied: Migration, cli_cmd: list[str]) -> None:
    first = denied.audit.records()[0]
    assert first["actor"] == "alice" and first["identity"] == {"name": "alice", "auth": "none"}
    assert len(first["mac"]) == 64 and first["v"] == 2 and first["log"] == "migrations/m-denied/audit.jsonl"
    ok = _audit(cli_cmd, "m-denied", "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout.splitlines()[-1])
    assert report["chain_verified"] and report["keyed"] and report["records"] == 5
    assert report["anchors"][0]["latest_count"] == 5 and not report["warnings"]
    assert report["started_by"] == "alice (none)"


@pytest.mark.parametrize("mode", ["keep", "key"])
def test_rechained_log_fails_verification(denied: Migration, cli_cmd: list[str], mode: str) -> None:
    """The attack of issue 17: drop the denial, change actors, re-chain, update state.json's head."""
    _attack(denied, mode)
    bad = _audit(cli_cmd, "m-denied", "--json")
    assert bad.returncode == 1, bad.stderr
    doc = json.loads(bad.stdout.splitlines()[-1])
    assert doc["chain_verified"] is False
    if mode == "keep":  # without the key: the first altered record fails its MAC
        assert "#0 (migration.created) fails its MAC" in doc["error"]
    else:  # with the key but not the anchor: the log no longer matches the heads anchored outside
        assert "truncated: the head anchored in" in doc["error"] and "counts 5 records, the log has 4" in doc["error"]
    assert "Traceback" not in bad.stderr


def test_rewrite_by_a_key_holder_is_named(denied: Migration) -> None:
    """Actors changed and every MAC recomputed with the key: the anchored heads still name the first record."""
    _attack(denied, "key-actors")
    with pytest.raises(IntegrityError, match="record #0 of .* differs from the head anchored in .*rewritten"):
        denied.verify_audit()


def test_downgrade_to_unkeyed_log_fails(denied: Migration, cli_cmd: list[str]) -> None:
    _attack(denied, "strip")
    refused = _audit(cli_cmd, "m-denied")
    assert refused.returncode == 1 and "format 1 (unkeyed)" in refused.stderr, refused.stderr
    legacy = _audit(cli_cmd, "m-denied", "--accept-legacy")
    assert legacy.returncode == 1 and "replaced by an unkeyed one" in legacy.stderr, legacy.stderr


def test_truncated_log_fails_verification(denied: Migration, cli_cmd: list[str]) -> None:
    lines = denied.audit.path.read_bytes().splitlines(keepends=True)
    denied.audit.path.write_bytes(b"".join(lines[:-2]))
    import hashlib

    state = denied.read()
    state["audit_head"] = {"count": len(lines) - 2, "tail": hashlib.sha256(lines[-3].rstrip(b"\n")).hexdigest()}
    (denied.dir / "state.json").write_text(json.dumps(state))
    bad = _audit(cli_cmd, "m-denied")
    assert bad.returncode == 1
    assert "truncated" in bad.stderr and "counts 5 records, the log has 3 (first missing record: #3)" in bad.stderr


def test_append_refuses_a_corrupted_log(denied: Migration) -> None:
    lines = denied.audit.path.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b"us-east-1", b"eu-west-1")
    damaged = b"".join(lines)
    denied.audit.path.write_bytes(damaged)
    with pytest.raises(IntegrityError, match="#2 .*MAC"):
        denied.record("traffic.stage", {"weight": 5})
    assert denied.audit.path.read_bytes() == damaged  # nothing chained onto it


def test_append_refuses_a_truncated_log(denied: Migration) -> None:
    lines = denied.audit.path.read_bytes().splitlines(keepends=True)
    denied.audit.path.write_bytes(b"".join(lines[:-1]))
    with pytest.raises(IntegrityError, match="truncated"):
        denied.record("traffic.stage", {"weight": 5})


def test_anchor_tampering_is_detected(denied: Migration) -> None:
    anchor = denied.audit.anchors[0]
    assert isinstance(anchor, LocalFileAnchor)
    (chain,) = anchor.chains(denied.audit.anchor_name)
    path = next(anchor.dir.rglob(f"{chain}.jsonl"))
    heads = path.read_text().splitlines()
    forged = json.loads(heads[-1])
    forged["count"] = 2
    path.write_text("\n".join([*heads[:-1], json.dumps(forged)]) + "\n")
    with pytest.raises(IntegrityError, match="anchor was tampered with"):
        denied.verify_audit()


def test_record_copied_from_another_log_is_refused(gm_home: Path) -> None:
    a, b = Migration.create("m-a", "x: 1\n"), Migration.create("m-b", "x: 1\n")
    b.audit.path.write_bytes(a.audit.path.read_bytes())
    with pytest.raises(IntegrityError, match="belongs to the log 'migrations/m-a/audit.jsonl'"):
        b.verify_audit()


def test_recreated_log_verifies_with_a_warning(gm_home: Path) -> None:
    import shutil

    first = Migration.create("m-again", "x: 1\n")
    first.record("traffic.stage", {"weight": 1})
    shutil.rmtree(first.dir)
    again = Migration.create("m-again", "x: 2\n")
    verified = again.verify_audit()
    assert verified.count == 1
    assert any("1 other chain(s)" in w for w in verified.warnings), verified.warnings


def test_unanchored_tail_is_reported(denied: Migration) -> None:
    """A crash between the write and the anchor leaves records after the last head: shown, not hidden."""
    log = AuditLog(denied.audit.path, anchors=[LocalFileAnchor(denied.dir.parent.parent.parent / "elsewhere")])
    with pytest.raises(IntegrityError, match="no anchor holds a head"):
        log.verify()


# ----------------------------------------------------------------------------- legacy (format 1) logs
def _legacy_log(path: Path, events: list[str]) -> None:
    import hashlib

    prev, out = "0" * 64, []
    for seq, event in enumerate(events):
        rec = {"seq": seq, "ts": 1.0 + seq, "actor": "bob", "event": event, "data": {}, "prev": prev}
        line = json.dumps(rec, sort_keys=True, separators=(",", ":")).encode()
        out.append(line + b"\n")
        prev = hashlib.sha256(line).hexdigest()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(out))


def test_legacy_log_is_refused_unless_accepted_then_sealed(gm_home: Path) -> None:
    log = AuditLog(gm_home / "old" / "audit.jsonl")
    _legacy_log(log.path, ["migration.created", "residency.deny", "phase.preflight.failed"])
    with pytest.raises(IntegrityError, match="--accept-legacy"):
        log.verify()
    accepted = log.verify(accept_legacy=True)
    assert accepted.legacy_records == 3 and accepted.chain is None and "format 1" in accepted.warnings[0]
    log.append("rollback.requested", {"reason": "finish an old migration"})  # appends still work (rollback)
    sealed = log.verify(accept_legacy=True)
    assert (sealed.count, sealed.legacy_records) == (4, 3) and sealed.chain
    # The keyed record seals the prefix: rewriting a legacy record now breaks the chain.
    lines = log.path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b"residency.deny", b"residency.allo")
    log.path.write_bytes(b"".join(lines))
    with pytest.raises(IntegrityError, match="#2"):
        log.verify(accept_legacy=True)


# ----------------------------------------------------------------------------- the key
def test_default_key_is_created_outside_the_state_root(
    gm_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUMIGRATE_AUDIT_KEY_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    Migration.create("m-key", "x: 1\n")
    key = tmp_path / "config" / "gpumigrate" / "audit.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(bytes.fromhex(key.read_text().strip())) == 32
    key.chmod(0o644)
    with pytest.raises(InvalidInputError, match="readable by others"):
        Migration.open("m-key").record("x")


def test_key_inside_the_state_root_is_refused(gm_home: Path, cli_cmd: list[str]) -> None:
    inside = gm_home / "audit.key"
    inside.write_text("ab" * 32)
    inside.chmod(0o600)
    env = {**os.environ, "GPUMIGRATE_AUDIT_KEY_FILE": str(inside)}
    out = subprocess.run(
        [*cli_cmd, "plan", "validate", "examples/local-demo.yaml"], capture_output=True, text=True, env=env,
        cwd=Path(__file__).resolve().parents[2], timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "inside the state root" in out.stderr and "Traceback" not in out.stderr


def test_anchor_inside_the_state_root_is_refused(gm_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMIGRATE_AUDIT_ANCHORS", (gm_home / "anchors").as_uri())
    with pytest.raises(InvalidInputError, match="inside the state root"):
        Migration.create("m-anchor", "x: 1\n")


def test_another_key_is_named(denied: Migration, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other.key"
    other.write_text("cd" * 32)
    other.chmod(0o600)
    monkeypatch.setenv("GPUMIGRATE_AUDIT_KEY_FILE", str(other))
    with pytest.raises(IntegrityError, match="was keyed with audit key '[0-9a-f]{12}', not with the configured key"):
        denied.verify_audit()


# ----------------------------------------------------------------------------- logs outside migrations
def test_policy_log_is_keyed_and_anchored(gm_home: Path, cli_cmd: list[str], repo: Path) -> None:
    env = dict(os.environ)
    ok = subprocess.run([*cli_cmd, "plan", "validate", "examples/local-demo.yaml"], cwd=repo, env=env,
                        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    report = subprocess.run([*cli_cmd, "audit", "--log", "policy", "--json"], env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert report.returncode == 0, report.stderr
    doc = json.loads(report.stdout.splitlines()[-1])
    assert doc["keyed"] and doc["records"] >= 1 and doc["log"] == "audit/policy.jsonl"
    assert doc["anchors"][0]["latest_count"] == doc["records"]
    bad = subprocess.run([*cli_cmd, "audit"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--log" in bad.stderr
