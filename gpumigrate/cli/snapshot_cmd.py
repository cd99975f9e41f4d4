"""``gpumigrate snapshot``: drive a workload's embedded snapshot agent over its control address.

Each command is one request to the agent (see snapshot/PROTOCOL.md). Keys never travel: pass
``--key-env NAME`` or ``--key-file PATH`` and the agent resolves the key on its own host.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpumigrate.cli.output import console, emit_json
from gpumigrate.errors import InvalidInputError, SnapshotError

if TYPE_CHECKING:
    from gpumigrate.snapshot.client import AgentClient

app = typer.Typer(help="Capture and restore a workload's GPU state through its snapshot agent.", no_args_is_help=True)

AgentOpt = Annotated[str, typer.Option("--agent", help="HOST:PORT of the workload's snapshot agent")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")]
StoreOpt = Annotated[
    str, typer.Option("--store", help="image store URL: file:///path, s3://..., gs://..., stream://host:port")
]
KeyEnvOpt = Annotated[
    str | None, typer.Option("--key-env", help="environment variable (on the agent's host) holding the key")
]
KeyFileOpt = Annotated[str | None, typer.Option("--key-file", help="key file path (on the agent's host)")]


def _client(agent: str) -> AgentClient:
    from gpumigrate.snapshot.client import AgentClient

    return AgentClient(agent)


def _key_ref(key_env: str | None, key_file: str | None) -> dict[str, str]:
    """The key's reference (never the key); neither option means a store without encryption."""
    if key_env is not None and key_file is not None:
        raise InvalidInputError("give exactly one of --key-env NAME or --key-file PATH (the key itself never travels)")
    if key_env is not None:
        return {"env": key_env}
    return {"file": str(key_file)} if key_file is not None else {}


def _policy(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, rule = item.partition("=")
        if not sep or rule not in ("must_match", "may_differ"):
            raise InvalidInputError(
                f"--policy {item!r}: use FACT=must_match or FACT=may_differ (e.g. torch=must_match)"
            )
        out[name] = rule
    return out


def _show(result: Any, as_json: bool, summary: str) -> None:
    if as_json:
        emit_json(result)
    else:
        console.print(summary)


@app.command("info")
def info(agent: AgentOpt, as_json: JsonOpt = False) -> None:
    """Regions, sizes, dtypes, environment facts and the agent's state."""
    res = _client(agent).request_info()
    _show(
        asdict(res),
        as_json,
        f"{len(res.regions)} regions, {res.bytes_total} bytes; frozen={res.frozen} ready={res.ready} "
        f"last image={res.last_image}",
    )


@app.command("precopy")
def precopy(
    agent: AgentOpt,
    store: StoreOpt,
    key_env: KeyEnvOpt = None,
    key_file: KeyFileOpt = None,
    parent: Annotated[
        str | None, typer.Option(help="parent image id (default: the agent's last image in this store)")
    ] = None,
    rounds: Annotated[
        int, typer.Option(min=1, max=50, help="run up to N rounds, stopping once the dirty set converges")
    ] = 1,
    max_downtime_ms: Annotated[
        float, typer.Option(help="stop when the last dirty set ships within this budget")
    ] = 500.0,
    as_json: JsonOpt = False,
) -> None:
    """Live pre-copy round(s): ship only chunks whose on-device fingerprint changed."""
    client = _client(agent)
    ref = _key_ref(key_env, key_file)
    if rounds == 1:
        done = client.request_precopy(store, ref, parent)
        _show(
            asdict(done),
            as_json,
            f"round {done.stats.round}: {done.stats.chunks_dirty}/{done.stats.chunks_total} chunks dirty, "
            f"{done.stats.bytes_dirty} bytes; image {done.image.id}",
        )
        return
    conv = client.precopy_until(store, ref, max_rounds=rounds, max_downtime_ms=max_downtime_ms)
    res = {
        "rounds": [asdict(r) for r in conv.rounds],
        "images": conv.images,
        "reason": conv.reason,
        "predicted_downtime_ms": conv.predicted_downtime_ms,
        "image": conv.images[-1] if conv.images else None,
    }
    _show(res, as_json, f"{len(conv.rounds)} rounds ({conv.reason}); last image {res['image']}")


@app.command("freeze")
def freeze(agent: AgentOpt, as_json: JsonOpt = False) -> None:
    """Stop the workload at its safe point (between requests or steps)."""
    _client(agent).request_freeze()
    _show({"frozen": True}, as_json, "frozen")


@app.command("final")
def final(
    agent: AgentOpt,
    store: StoreOpt,
    key_env: KeyEnvOpt = None,
    key_file: KeyFileOpt = None,
    parent: Annotated[str | None, typer.Option(help="parent image id")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Ship the last dirty set of a frozen workload and commit the image."""
    done = _client(agent).request_final(store, _key_ref(key_env, key_file), parent)
    _show(asdict(done), as_json, f"final image {done.image.id} ({done.stats.bytes_dirty} bytes in the last round)")


@app.command("resume")
def resume(agent: AgentOpt, as_json: JsonOpt = False) -> None:
    """Un-freeze the source (rollback)."""
    _client(agent).request_resume()
    _show({"frozen": False}, as_json, "resumed")


@app.command("restore")
def restore(
    agent: AgentOpt,
    store: StoreOpt,
    image: Annotated[str, typer.Option("--image", help="image id to restore")],
    key_env: KeyEnvOpt = None,
    key_file: KeyFileOpt = None,
    policy: Annotated[
        list[str] | None, typer.Option("--policy", help="FACT=must_match|may_differ (repeatable)")
    ] = None,
    ready: Annotated[
        bool, typer.Option("--ready/--no-ready", help="report ready afterwards (--no-ready: pre-load)")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Verify and load an image into the target workload, then report ready."""
    res = _client(agent).request_restore(store, image, _key_ref(key_env, key_file), policy=_policy(policy), ready=ready)
    _show(
        {**asdict(res), "image": res.image_id},
        as_json,
        f"restored {res.image_id}: {res.chunks_loaded} chunks loaded, {res.chunks_skipped} already there; "
        f"ready={res.ready}",
    )


@app.command("zeroize")
def zeroize(
    agent: AgentOpt,
    migration: Annotated[
        str | None, typer.Option("--migration", help="append the record to this migration's audit log")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Overwrite the source's tracked memory with zeros and verify by reading it back."""
    from gpumigrate.state import Migration

    m = Migration.open(migration) if migration else None  # fails before anything is wiped when the id is unknown
    zeroized = _client(agent).request_zeroize()
    record = zeroized.record()
    if m is not None:  # only what the read-back proved is a zeroize; anything else is recorded as failed
        m.record("source.zeroized" if zeroized.verified else "source.zeroize_unverified", record, actor="cli")
    _show(record, as_json, json.dumps(record))
    if not zeroized.verified:
        raise SnapshotError(f"the agent at {agent} could not verify its zeroize (a read-back found non-zero bytes)")
