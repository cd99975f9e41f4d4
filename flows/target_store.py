"""Where the image lands on the target, and the receiver the flow runs there (flows/README.md, "Where the image goes").

The source's agent writes its pre-copy rounds and its final image straight to where the target
reads them; nothing is stored and forwarded. :func:`landing` decides both ends from the plan's
``transfer.store`` once the target exists:

============================================  ==============================================  ==============================
``transfer.store``                            the source's agent writes to                    the target reads
============================================  ==============================================  ==============================
``file://DIR``, a local target                the target host's own store (``<workdir>/store``)  the same
``file://DIR``, another target                ``DIR`` (a filesystem both share)               the same
``s3://…``, ``gs://…``                        the bucket                                      the same
``stream://target``, ``nixl://target``        a receiver the flow starts on the target        the receiver's store there
``stream://HOST:PORT?fingerprint=sha256:HEX``  that receiver, which the operator runs          the store it reports
============================================  ==============================================  ==============================

``stream://target`` and ``nixl://target`` (with the sender's options after ``?``: ``connections``,
and for nixl:// ``transports``, ``slots``, ``inline``) mean "a receiver on the target, started by the
flow": it listens on the target's address, makes a fresh certificate, and the source's agent pushes to
its pinned URL. The flow stops it once the image is checked there (and in the undo).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

from gpumigrate import control
from gpumigrate.errors import GpumigrateError, InvalidInputError, PolicyDeniedError, TransferError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.infra import start_on_host
from gpumigrate.infra.launch import last_lines, netloc
from gpumigrate.infra.residency import check_store
from gpumigrate.interfaces import Host, Provider
from gpumigrate.transfer.receiver.host import (
    ReceiverInfo,
    ReceiverOptions,
    read_receiver_info,
    receiver_argv,
    stop_receiver,
)
from gpumigrate.transfer.stores.connections import PinnedCertificateError
from gpumigrate.transfer.stores.stream import StreamStore

RECEIVERS = ("stream", "nixl")
ON_TARGET = "target"  # the host part of stream://target, nixl://target
SENDER_OPTIONS = ("connections", "transports", "slots", "inline")  # what a plan may add after "?"
NIXL_ONLY = ("transports", "slots", "inline")
RECEIVER_START_S = 60.0


@dataclass(frozen=True)
class Landing:
    """Where the source writes the image (``write``) and where the target reads it (``read``)."""

    write: str
    read: str
    receiver_dir: str | None = None  # a receiver the flow started there


def is_receiver(url: str) -> bool:
    return urlsplit(url).scheme in RECEIVERS


def started_by_flow(url: str) -> bool:
    """``stream://target`` / ``nixl://target``: a receiver on the target that the flow starts."""
    parts = urlsplit(url)
    return parts.scheme in RECEIVERS and parts.netloc == ON_TARGET


def control_ref(ctx: RunContext) -> dict[str, str]:
    """The control key's reference for processes the flow starts, a plan's file made absolute."""
    key = ctx.plan.workload.control_key
    if key is None:
        return control.key_reference()
    if key.file:
        return {"file": str(ctx.resolve(key.file))}
    return {"env": str(key.env)}


def control_url(url: str) -> str:
    """The stream:// URL of a receiver for this process's own requests (listing, manifests, stop): a
    nixl:// receiver serves them on the same port, and the orchestrator never needs NIXL itself."""
    parts = urlsplit(url)
    query = {k: v for k, v in parse_qs(parts.query).items() if k not in NIXL_ONLY}
    return f"stream://{parts.netloc}" + (f"?{urlencode(query, doseq=True)}" if query else "")


def landing(ctx: RunContext, provider: Provider, host: Host) -> Landing:
    """Both ends of the image for ``host``, a receiver started there when the plan asks for one."""
    url = ctx.store_url()
    if started_by_flow(url):
        return start_target_receiver(ctx, provider, host, url)
    if is_receiver(url):
        return Landing(url, receiver_store(ctx, url))
    if host.provider == "local" and host.workdir and url.startswith("file://"):
        own = "file://" + str(Path(host.workdir) / "store")
        return Landing(own, own)
    return Landing(url, url)


def check_landing(ctx: RunContext, host: Host, where: Landing) -> None:
    """Residency of where the bytes land, before any byte moves: the target's disk is in its region, a
    receiver is where the target is. (A bucket's real location is checked at preflight.)"""
    plan = ctx.plan
    if not (is_receiver(where.write) or where.write.startswith("file://")):
        return
    check_store(
        where.write,
        host.region if where.write.startswith("file://") else plan.transfer.store_region,
        plan.data.allowed_jurisdictions,
        target_provider=plan.target.provider,
        target_region=host.region,
        record=ctx.migration.record,
    )


# ----------------------------------------------------------------------------- a receiver the operator runs
def receiver_store(ctx: RunContext, url: str) -> str:
    """Authenticate to a receiver (its pinned certificate checked before anything is sent) and return the
    store it lands images in, on its host. A certificate other than the pinned one is a denial (exit 2)."""
    sender = StreamStore(control_url(url), connections=1, control_key=control.load_key(control_ref(ctx)))
    try:
        said = sender.hello()
    except PinnedCertificateError as exc:
        raise PolicyDeniedError("receiver-certificate", exc.message) from None
    finally:
        sender.close()
    if urlsplit(url).scheme == "nixl" and not said.get("nixl"):
        raise InvalidInputError(f"the receiver at {urlsplit(url).netloc} takes no nixl:// (start it with --nixl)")
    store = said.get("store")
    if not isinstance(store, str) or not store.startswith("file://"):
        raise TransferError(f"the receiver at {urlsplit(url).netloc} does not say where it stores images")
    return store


# ----------------------------------------------------------------------------- a receiver the flow runs
def start_target_receiver(ctx: RunContext, provider: Provider, host: Host, url: str) -> Landing:
    """Start a receiver on ``host`` under its workdir (a receiver an earlier attempt left is stopped first;
    the chunks it verified stay and are not sent again) and return its pinned URL and its store."""
    if not host.workdir:
        raise InvalidInputError(f"host {host.name} has no work directory to run a receiver in")
    parts = urlsplit(url)
    options = {k: v for k, v in parse_qs(parts.query).items() if k in SENDER_OPTIONS}
    state = Path(host.workdir) / "receiver"
    stop_flow_receiver(ctx, str(state))
    transports = options["transports"][0] if options.get("transports") else None
    receiver = ReceiverOptions(
        listen=netloc(host.address, host.ports.get("stream", 0)),
        nixl=parts.scheme == "nixl",
        nixl_transports=transports,
    )
    argv = receiver_argv(state, receiver, key_ref=ctx.key_ref())
    env = control.reference_env(control_ref(ctx))
    proc = start_on_host(provider, host, argv, env=env, name="receiver")
    deadline = time.monotonic() + RECEIVER_START_S
    info: ReceiverInfo | None = None
    while info is None:
        code = proc.returncode()
        if code is not None:
            raise TransferError(
                f"the receiver on {host.name} exited at start (status {code}): {last_lines(proc.log, 5)}"
            )
        if time.monotonic() > deadline:
            raise TransferError(f"the receiver on {host.name} did not listen within {RECEIVER_START_S:g}s")
        try:
            info = read_receiver_info(state, timeout_s=0.2, pid=proc.pid)
        except TransferError:
            continue
    query = urlencode({"fingerprint": info.fingerprint, **options}, doseq=True)
    write = f"{parts.scheme}://{netloc(info.host, info.port)}?{query}"
    emit(
        ctx.migration,
        "transfer.receiver.started",
        {"host": host.name, "url": write, "store": info.store, "pid": info.pid, "nixl": info.nixl},
    )
    return Landing(write, info.store, str(state))


def stop_flow_receiver(ctx: RunContext, state_dir: str) -> bool:
    """Stop the receiver of ``state_dir`` if one runs (it flushes its store first); True when it ran."""
    try:
        running = read_receiver_info(state_dir).state == "running"
    except TransferError:
        return False  # none was ever started there
    if not running:
        return False
    try:
        final = stop_receiver(state_dir, control_key=control.load_key(control_ref(ctx)))
    except GpumigrateError as exc:
        raise TransferError(f"the receiver in {state_dir} could not be stopped: {exc.message}") from None
    emit(ctx.migration, "transfer.receiver.stopped", {"state": final.state, **final.stats})
    return True


def stop_target_receiver(ctx: RunContext) -> None:
    """Stop the receiver this migration started on its target, once (after the transfer, or in an undo)."""
    rt = ctx.runtime
    if rt.receiver_dir and not rt.receiver_stopped:
        stop_flow_receiver(ctx, rt.receiver_dir)
        ctx.update(receiver_stopped=True)
