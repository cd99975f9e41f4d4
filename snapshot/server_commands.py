"""The workload's side of the control protocol: each command's arguments checked, then the engine asked.

The commands that touch an image take a store URL and a key *reference* (never a key): the engine's
writer and reader factories, wired by the public SDK (``gpumigrate.agent``), open the image and resolve
the key in the workload's own process. ``precopy_to``/``final_to`` open a writer and run one capture round
into it (``confirmed``: a final round's verdict, where it returned before its confirmation ended),
``restore_from`` opens a reader and loads it (``ready``: a target loaded unready reports ready), ``lend_to`` moves tracked bytes into a target's
landing, ``compose_world`` writes rank 0's world image (``worldimage.py``). A bad argument is refused
with a message naming what is allowed, before anything is touched (PROTOCOL.md names every command).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from gpumigrate import agent_keys
from gpumigrate.bounds import OPTION_KEYS, TransferBounds
from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import ImageWriter
from gpumigrate.snapshot.client import parse_address
from gpumigrate.snapshot.engine import Phases, SnapshotEngine
from gpumigrate.snapshot.fill import Run, runs_arg
from gpumigrate.snapshot.gchold import gc_held, release_later
from gpumigrate.snapshot.worldimage import compose

MAX_CHUNK_SIZE = 256 << 20  # the transfer engine's largest chunk
WRITER_COMPRESSION = ("auto", "none", "zstd", "byteplane")
CONFIRM = ("wait", "later")  # final's confirm: every reused chunk confirmed before the commit, or the cold ones after


# ----------------------------------------------------------------------------- the image commands
def precopy_to(
    engine: SnapshotEngine,
    store: str,
    key_ref: Mapping[str, str],
    parent: str | None = None,
    *,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One capture round into ``store`` (live unless the workload is parked): ``{"stats", "image"}``."""
    clock = Phases()
    with engine.lock:
        clock.mark("lock")
        writer = engine.open_writer(store, key_ref, parent, options)
        clock.mark("open")
        done = engine.capture_round(writer, clock=clock)
        return {"stats": asdict(done.stats), "image": asdict(done.image)}


def final_to(
    engine: SnapshotEngine,
    store: str,
    key_ref: Mapping[str, str],
    parent: str | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    confirm: str = "wait",
) -> dict[str, Any]:
    """The frozen workload's final round into ``store``: ``{"stats", "image", "confirmation"}``. ``confirm``:
    ``wait`` (every reused chunk confirmed before the commit) or ``later`` (the cold ones after it: their verdict
    is ``confirmed``'s; ``confirmation`` says ``pending`` then)."""
    clock = Phases()
    with gc_held(), engine.lock:
        clock.mark("lock")
        if not engine.frozen:
            raise SnapshotError("final needs a frozen workload: send freeze first")
        writer = engine.open_writer(store, key_ref, parent, options)
        clock.mark("open")

        def reopen(parent_id: str) -> ImageWriter:  # the follow-up of chunks the confirmation caught: same store
            return engine.open_writer(store, key_ref, parent_id, options)

        done = engine.capture_final(writer, clock=clock, reopen=reopen if confirm == "later" else None)
        pending = engine.capture.pending is not None
        return {
            "stats": asdict(done.stats),
            "image": asdict(done.image),
            "confirmation": "pending" if pending else "confirmed",
        }


def confirmed(engine: SnapshotEngine, image_id: str) -> dict[str, Any]:
    """The verdict of the final round that committed ``image_id`` (``confirmation.py``): the image to restore."""
    t0 = time.perf_counter()
    verdict = engine.confirmation(image_id)
    return {**verdict.reply(), "waited": time.perf_counter() - t0}


def restore_from(
    engine: SnapshotEngine,
    store: str,
    image_id: str,
    key_ref: Mapping[str, str],
    *,
    policy: Mapping[str, str] | None = None,
    ready: bool = True,
    rank: int | None = None,
    source: str | None = None,
    control_key: bytes | None = None,
) -> dict[str, Any]:
    """Open image ``image_id`` of ``store`` and load it into the engine (``SnapshotEngine.load``)."""
    if engine.reader_factory is None:
        raise SnapshotError("this agent has no image reader: the workload did not wire the transfer engine")
    clock = Phases()
    with gc_held():  # from the manifest's read on: every pause here is downtime in the final restore
        reader = engine.reader_factory(store, image_id, key_ref)
        clock.mark("open")
        try:
            return engine.load(
                reader, policy=policy, ready=ready, rank=rank, source=source, control_key=control_key, clock=clock
            )
        finally:
            # The restore that ends the downtime frees its manifest a second later, off that path. A pre-load frees
            # its own at once: a second later could land inside the final restore that follows it.
            if ready:
                release_later(reader)


def lend_to(
    engine: SnapshotEngine, landing: str, runs: Sequence[Run], chunk_size: int, *, control_key: bytes, tolerate: bool
) -> dict[str, Any]:
    """Source: move ``runs`` of the tracked tensors into the target's landing at ``landing`` (``fill.py``)."""
    return engine.lend(landing, runs, chunk_size, control_key=control_key, tolerate=tolerate)


def compose_world(
    engine: SnapshotEngine,
    store: str,
    key_ref: Mapping[str, str],
    images: list[str],
    ranks: list[Mapping[str, Any]],
    *,
    step: int | None = None,
) -> dict[str, Any]:
    """Compose the ranks' images (rank r's at ``images[r]``, all in ``store``) into one world image
    (``worldimage.py``): no chunk is copied. ``ranks[r]`` describes rank r (its ``info().rank``)."""
    if engine.reader_factory is None or engine.writer_factory is None:
        raise SnapshotError("this agent has no image reader/writer: the workload did not wire the transfer engine")
    with engine.lock:
        t0 = time.perf_counter()
        readers = [engine.reader_factory(store, image_id, key_ref) for image_id in images]
        ref = compose(engine.writer_factory(store, key_ref, None), readers, ranks, step=step)
        return {"image": asdict(ref), "world_size": len(images), "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- arguments
def key_ref_arg(value: Any) -> dict[str, str]:
    """Accept only a key *reference*: {"env": NAME} or {"file": PATH}, or nothing (an unencrypted store).

    Anything else, a key itself in particular, is refused before any image is touched.
    """
    if value is None or value == {}:
        return {}
    if (
        not isinstance(value, Mapping)
        or set(value) not in ({"env"}, {"file"})
        or not all(isinstance(v, str) for v in value.values())
    ):
        raise SnapshotError(
            'key_ref must be {"env": VARIABLE} or {"file": PATH}: the agent resolves keys locally, never over the wire'
        )
    return dict(value)


def writer_options_arg(value: Any) -> dict[str, Any]:
    """How the image is written: ``{"compression": one of WRITER_COMPRESSION}`` and a live round's bounds
    (``parallelism`` 1..64, ``rate_limit`` bytes/s, ``pacing``: gpumigrate/bounds.py), each optional."""
    if value in (None, {}):
        return {}
    allowed = {"compression", *OPTION_KEYS}
    if not isinstance(value, Mapping) or set(value) - allowed:
        raise SnapshotError(f"options may hold {', '.join(sorted(allowed))} and nothing else")
    out: dict[str, Any] = {}
    if "compression" in value:
        if value["compression"] not in WRITER_COMPRESSION:
            raise SnapshotError(
                f"options.compression {value['compression']!r}: allowed are {', '.join(WRITER_COMPRESSION)}"
            )
        out["compression"] = value["compression"]
    try:
        bounds = TransferBounds.from_options(value)
    except ValueError as exc:
        raise SnapshotError(f"options: {exc}") from None
    return out | {k: v for k, v in bounds.options().items() if k in value}


def _confirm_arg(value: Any) -> str:
    if value is None:
        return "wait"
    if value not in CONFIRM:
        raise SnapshotError(f"confirm {str(value)[:40]!r}: allowed are {', '.join(CONFIRM)}")
    return str(value)


def _image_id_arg(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise SnapshotError("image_id must be an image id (a string)")
    return value


def _steps_arg(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        raise SnapshotError(f"steps {value!r}: must be a whole number from 1 to 1000000")
    return value


def _seconds_arg(name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86_400:
        raise SnapshotError(f"{name} {value!r}: must be a number of seconds above 0 and at most 86400")
    return float(value)


def _rank_arg(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 16:
        raise SnapshotError(f"rank {value!r}: must be a whole number from 0")
    return value


def _lend_key_arg(identity: agent_keys.AgentIdentity, value: Any) -> bytes:
    """The lend key the orchestrator sealed to this agent in ``restore``'s ``grant``: ``{"source": "id#epoch",
    "sealed": hex}``. Without it a target cannot ask its source for anything."""
    if not isinstance(value, Mapping) or not isinstance(value.get("source"), str):
        raise SnapshotError(
            'a fill from the source needs grant {"source": ID#EPOCH, "sealed": HEX}: the lend key the orchestrator '
            "sealed to this agent (AgentClient.request_restore(source=...) sends it)"
        )
    key = agent_keys.unseal(identity.key, agent_keys.grant_label(value["source"], identity.agent), value.get("sealed"))
    if len(key) != 32:
        raise SnapshotError("the grant was not sealed to this agent (another agent's, or altered): no fill")
    return key


def _address_arg(name: str, value: Any) -> str:
    """An agent's or a landing's ``host:port`` (``source`` of ``restore``, ``landing`` of ``lend``)."""
    if not isinstance(value, str):
        raise SnapshotError(f"{name} {str(value)[:40]!r}: must be HOST:PORT")
    parse_address(value)
    return value


def _chunk_size_arg(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= MAX_CHUNK_SIZE or value % 8:
        raise SnapshotError(f"chunk_size {value!r}: must be a multiple of 8 bytes up to {MAX_CHUNK_SIZE}")
    return value


# ----------------------------------------------------------------------------- the commands, by name
def _freeze(engine: SnapshotEngine, args: Mapping[str, Any]) -> dict[str, Any]:
    timeout_s = _seconds_arg("timeout_s", args.get("timeout_s"), 60)
    engine.park(args.get("lease_s"), timeout_s=timeout_s, at_step=args.get("at_step"))
    steps = engine.freezer.steps if engine.freezer is not None else 0
    return {"frozen": True, "lease_s": engine.lease.lease_s, "steps": steps}


def _compose(engine: SnapshotEngine, args: Mapping[str, Any]) -> dict[str, Any]:
    images, ranks, step = args["images"], args["ranks"], args.get("step")
    if not isinstance(images, list) or not images or not all(isinstance(i, str) for i in images):
        raise SnapshotError("images must be a non-empty list of image ids, rank 0's first")
    if not isinstance(ranks, list) or not all(isinstance(r, Mapping) for r in ranks):
        raise SnapshotError("ranks must be a list of objects, one per rank (each rank's info().rank)")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise SnapshotError(f"step {step!r}: must be a whole number")
    return compose_world(engine, str(args["store"]), key_ref_arg(args.get("key_ref")), images, ranks, step=step)


def _resume(engine: SnapshotEngine) -> dict[str, Any]:
    engine.unpark()
    return {"frozen": False}


def _lend(engine: SnapshotEngine, args: Mapping[str, Any], lend_key: bytes | None) -> dict[str, Any]:
    if lend_key is None:
        raise SnapshotError(
            "lend is asked by a target with the lend key the orchestrator granted it, and by no one else"
        )
    return lend_to(
        engine,
        _address_arg("landing", args["landing"]),
        runs_arg(args["runs"]),
        _chunk_size_arg(args["chunk_size"]),
        control_key=lend_key,  # the landing's channel: the target holds the same key, nobody else does
        tolerate=bool(args.get("tolerate", False)),
    )


def handlers(
    engine: SnapshotEngine,
    args: Mapping[str, Any],
    *,
    identity: agent_keys.AgentIdentity,
    auth: Callable[[], dict[str, Any]],
    lend_key: bytes | None = None,
) -> dict[str, Callable[[], Any]]:
    """Every command the server answers, bound to ``args``: the name on the wire → what it runs. ``identity``: this
    agent's (its key unseals a fill's grant); ``auth``: the server's report of its refusals; ``lend_key``: the
    key a granted ``lend`` was signed with (it signs the landing's channel too)."""
    return {
        "ping": lambda: {"pong": True},
        "info": lambda: {**engine.info(), "auth": auth()},
        "precopy": lambda: precopy_to(
            engine,
            str(args["store"]),
            key_ref_arg(args.get("key_ref")),
            args.get("parent"),
            options=writer_options_arg(args.get("options")),
        ),
        "freeze": lambda: _freeze(engine, args),
        "hold": lambda: engine.hold(args.get("lease_s")),
        "teardown": engine.teardown_group,
        "rebuild": engine.rebuild_group,
        "compose": lambda: _compose(engine, args),
        "renew": lambda: engine.renew_lease(args.get("lease_s")),
        "advance": lambda: engine.advance_steps(
            _steps_arg(args.get("steps")), timeout_s=_seconds_arg("timeout_s", args.get("timeout_s"), 600)
        ),
        "metrics": lambda: engine.step_metrics(int(args.get("since") or 0)),
        "final": lambda: final_to(
            engine,
            str(args["store"]),
            key_ref_arg(args.get("key_ref")),
            args.get("parent"),
            options=writer_options_arg(args.get("options")),
            confirm=_confirm_arg(args.get("confirm")),
        ),
        "confirmed": lambda: confirmed(engine, _image_id_arg(args["image_id"])),
        "ready": lambda: engine.mark_ready(_image_id_arg(args["image_id"])),
        "resume": lambda: _resume(engine),
        "restore": lambda: restore_from(
            engine,
            str(args["store"]),
            str(args["image_id"]),
            key_ref_arg(args.get("key_ref")),
            policy=args.get("policy"),
            ready=bool(args.get("ready", True)),
            rank=_rank_arg(args.get("rank")),
            source=None if args.get("source") is None else _address_arg("source", args["source"]),
            control_key=None if args.get("source") is None else _lend_key_arg(identity, args.get("grant")),
        ),
        "zeroize": lambda: engine.zeroize(end_parked=bool(args.get("end_parked", False))),
        "key": lambda: engine.check_key(key_ref_arg(args.get("key_ref"))),
        "hand_over": lambda: engine.hand_over(args["target"]),
        "take_back": engine.take_back,
        "lend": lambda: _lend(engine, args, lend_key),
    }


def dispatch(
    engine: SnapshotEngine,
    cmd: str,
    args: Mapping[str, Any],
    *,
    identity: agent_keys.AgentIdentity,
    auth: Callable[[], dict[str, Any]],
    lend_key: bytes | None = None,
) -> Any:
    """Run command ``cmd``; an unknown command or a missing argument is refused naming what is allowed."""
    known = handlers(engine, args, identity=identity, auth=auth, lend_key=lend_key)
    handler = known.get(cmd)
    if handler is None:
        raise SnapshotError(f"unknown command {cmd!r}: allowed are {', '.join(sorted(known))}")
    try:
        return handler()
    except KeyError as exc:
        raise SnapshotError(f"command {cmd!r} needs argument {exc.args[0]!r}") from None
