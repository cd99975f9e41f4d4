"""``gpumigrate image``: pack, push, verify, unpack and receive checkpoint images (transfer/).

An IMAGE URL is ``STORE_URL#IMAGE_ID``; the id may be a unique prefix, or left out for the newest image
by the signed sequence in the manifests (``transfer/latest.py``: said on stderr, and refused when it is older
than one the store already served that way). Store URLs: file:///abs/dir, file://relative/dir, s3://bucket/prefix,
gs://bucket/prefix, and the receivers stream://host:port and nixl://host:port (push/pack
destinations only; ``image receive`` writes what arrives to its own file:// store).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.text import Text

from gpumigrate.cli.output import clean, console, emit_json
from gpumigrate.errors import GpumigrateError, InvalidInputError

app = typer.Typer(
    help="Checkpoint images: pack files, push between stores (file://, s3://, gs://) or to a receiver "
    "(stream://, nixl://), verify, unpack, receive.\n\n"
    "IMAGE URLs are STORE_URL#IMAGE_ID (a unique id prefix is enough; without an id, the newest signed image is "
    "taken and named, and one older than the store already served that way is refused), e.g. "
    "file:///data/images#3fa2c1. The key (32 bytes: hex, base64 or raw) comes from "
    "--key-env VAR, --key-file FILE, or GPUMIGRATE_IMAGE_KEY; --no-key writes/reads unencrypted, unsigned images.\n\n"
    "Exit codes: 0 ok, 2 bad input (wrong key, bad URL, missing file), 1 integrity or transfer failure.",
    no_args_is_help=True,
)

DEFAULT_KEY_ENV = "GPUMIGRATE_IMAGE_KEY"
KeyEnv = typer.Option(None, "--key-env", help="environment variable holding the image key")
KeyFile = typer.Option(None, "--key-file", help="file holding the image key (hex, base64 or raw 32 bytes)")
NoKey = typer.Option(False, "--no-key", help="no encryption or signature (integrity by BLAKE3 ids only)")
JsonOut = typer.Option(False, "--json", help="print a JSON summary as the last stdout line")
Parallelism = typer.Option(4, "--parallelism", "-j", min=1, max=64, help="worker threads / parallel connections")
Endpoint = typer.Option(
    None, "--endpoint-url", help="S3/GCS API endpoint (default: AWS_ENDPOINT_URL / GPUMIGRATE_GCS_ENDPOINT)"
)
Quiet = typer.Option(False, "--quiet", "-q", help="no progress bar")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)(?:/s)?\s*$", re.IGNORECASE)


def parse_size(text: str | None) -> int | None:
    """'10GiB', '500MB', '1000000' → bytes."""
    value = parse_rate(text)
    return None if value is None else int(value)


def parse_rate(text: str | None) -> float | None:
    """'100MB', '1GiB', '50M', '125000000' → bytes per second."""
    if not text:
        return None
    m = _SIZE.match(text)
    if not m:
        raise InvalidInputError(f"rate {text!r} is not a size per second", hint="e.g. 100MB, 1GiB, 50M")
    num, unit, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    power = "_kmgt".index(unit) if unit else 0
    value: float = num * ((1024 if binary else 1000) ** power)
    if value <= 0:
        raise InvalidInputError(f"rate {text!r} must be positive")
    return value


def _key(key_env: str | None, key_file: Path | None, no_key: bool) -> bytes | None:
    import os

    from gpumigrate.transfer.format.keys import resolve_key

    if no_key:
        if key_env or key_file:
            raise InvalidInputError("--no-key cannot be combined with --key-env/--key-file")
        return None
    if key_env or key_file:
        return resolve_key(env=key_env, file=str(key_file) if key_file else None)
    if os.environ.get(DEFAULT_KEY_ENV):
        return resolve_key(env=DEFAULT_KEY_ENV)
    raise InvalidInputError(
        "no image key given",
        hint=f"use --key-env VAR, --key-file FILE, set {DEFAULT_KEY_ENV}, or --no-key for an unencrypted image",
    )


def _parses(url: str) -> str:
    """A store URL that Python's URL parser takes (an unbalanced IPv6 bracket is bad input, exit 2)."""
    from urllib.parse import urlsplit

    try:
        urlsplit(url).port  # noqa: B018 (raises for a bad host or port)
    except ValueError as exc:
        raise InvalidInputError(f"store URL {url!r} does not parse: {exc}") from None
    return url


def _image_url(text: str) -> tuple[str, str | None]:
    """(store URL, image) of ``STORE_URL#IMAGE``; an image part that is no id, prefix or "latest" is refused here."""
    from gpumigrate.transfer.latest import check_image_ref
    from gpumigrate.transfer.stores import parse_image_url

    store, image = parse_image_url(_parses(text))
    return store, check_image_ref(image)


def _chosen(store_url: str, image: str | None, key: bytes | None, endpoint_url: str | None) -> tuple[str, Any]:
    """The image id an image URL means, and (for a URL without an id) what was taken, also said on stderr."""
    from gpumigrate.transfer.format.chunkobj import Sealer
    from gpumigrate.transfer.latest import resolve_image
    from gpumigrate.transfer.stores import open_store

    with open_store(store_url, endpoint_url=endpoint_url) as store:
        found = resolve_image(store, image, Sealer(key))
    if found.how != "newest":
        return found.image_id, None
    console.print(Text(clean(found.describe(store_url))), soft_wrap=True)
    return found.image_id, found.as_json()


@contextlib.contextmanager
def _progress(label: str, quiet: bool) -> Iterator[Any]:
    """A rich bar on stderr with bytes/s; yields the (done, total) callback the transfer API takes."""
    if quiet:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    task = bar.add_task(label, total=None)
    started = threading.Event()
    lock = threading.Lock()

    def update(done: int, total: int) -> None:
        with lock:
            if not started.is_set():  # no bar at all for a command that fails before moving a byte
                bar.start()
                started.set()
            bar.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        if started.is_set():
            bar.stop()


def _summary(obj: dict[str, Any], as_json: bool, line: str) -> None:
    if as_json:
        emit_json(obj)
    else:
        console.print(Text(clean(line)))  # the line quotes URLs and paths a user gave: never markup


@app.command("keygen")
def keygen(
    out: Path = typer.Option(..., "--out", help="file to write the new key to (mode 0600; must not exist)"),
    as_json: bool = JsonOut,
) -> None:
    """Write a fresh random image key to a file (never to the terminal)."""
    import os

    from gpumigrate.transfer.format.keys import derive_keys, generate_key

    key_hex = generate_key()
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidInputError(f"{out} exists: refusing to overwrite a key") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(key_hex + "\n")
    key_id = derive_keys(bytes.fromhex(key_hex)).key_id
    _summary({"key_file": str(out), "key_id": key_id}, as_json, f"wrote a new key to {out} (key id {key_id})")


@app.command("pack")
def pack(
    paths: list[Path] = typer.Argument(..., help="files and directories to pack"),
    out: str = typer.Option(..., "--out", help="store URL to write the image to"),
    parent: str | None = typer.Option(
        None, "--parent", help="parent image id (in the same store): unchanged chunks cost nothing"
    ),
    compression: str = typer.Option("auto", "--compression", help="auto | none | zstd | byteplane"),
    dtype: str | None = typer.Option(
        None, "--dtype", help="treat file contents as this float dtype (bfloat16, float16, float32)"
    ),
    chunk_size: int | None = typer.Option(None, "--chunk-size", help="fixed chunk size in bytes (default 4 MiB)"),
    key_env: str | None = KeyEnv,
    key_file: Path | None = KeyFile,
    no_key: bool = NoKey,
    parallelism: int = Parallelism,
    endpoint_url: str | None = Endpoint,
    quiet: bool = Quiet,
    as_json: bool = JsonOut,
) -> None:
    """Pack PATHS into a new image in the store --out names."""
    import time

    from gpumigrate.transfer.pack import pack_paths

    key = _key(key_env, key_file, no_key)
    t0 = time.monotonic()
    with _progress("pack", quiet) as cb:
        ref = pack_paths(
            paths,
            out,
            key=key,
            parent=parent,
            compression=compression,
            parallelism=parallelism,
            chunk_size=chunk_size,
            dtype=dtype,
            endpoint_url=endpoint_url,
            progress=cb,
        )
    secs = time.monotonic() - t0
    summary = {
        "image": f"{ref.store}#{ref.id}",
        "image_id": ref.id,
        "parent": ref.parent,
        "bytes_image": ref.bytes_image,
        "bytes_sent": ref.bytes_sent,
        "bytes_stored": ref.bytes_stored,
        "seconds": round(secs, 3),
    }
    _summary(
        summary, as_json, f"packed {ref.bytes_image} bytes into {ref.store}#{ref.id} ({ref.bytes_sent} bytes sent)"
    )


@app.command("push")
def push(
    src: str = typer.Argument(..., help="IMAGE URL to copy (STORE_URL#IMAGE_ID)"),
    dst: str = typer.Argument(
        ..., help="destination: a store URL (file://, s3://, gs://) or a receiver (stream://, nixl://host:port)"
    ),
    key_env: str | None = KeyEnv,
    key_file: Path | None = KeyFile,
    no_key: bool = NoKey,
    parallelism: int = Parallelism,
    rate_limit: str | None = typer.Option(None, "--rate-limit", help="cap on bytes/s, e.g. 100MB, 1GiB"),
    endpoint_url: str | None = Endpoint,
    quiet: bool = Quiet,
    as_json: bool = JsonOut,
) -> None:
    """Copy an image and whichever of its chunks DST lacks (resumable: re-run moves only the rest).

    Chunks DST already holds are verified before they are trusted; a receiver verifies every chunk it gets.
    """
    from gpumigrate.transfer.push import push as do_push

    store, image = _image_url(src)
    key = _key(key_env, key_file, no_key)
    image_id, resolved = _chosen(store, image, key, endpoint_url)
    with _progress("push", quiet) as cb:
        stats = do_push(
            store,
            dst,
            image_id,
            key=key,
            parallelism=parallelism,
            progress=cb,
            rate_limit=parse_rate(rate_limit),
            endpoint_url=endpoint_url,
        )
    _summary(
        {**stats.as_dict(), **({"resolved": resolved} if resolved else {})},
        as_json,
        f"pushed {stats.image_id[:16]}: {stats.chunks_sent} chunks sent ({stats.bytes_sent} bytes), "
        f"{stats.chunks_skipped} already there, in {stats.seconds:.2f}s",
    )


@app.command("verify")
def verify(
    image_url: str = typer.Argument(..., help="IMAGE URL (STORE_URL#IMAGE_ID)"),
    key_env: str | None = KeyEnv,
    key_file: Path | None = KeyFile,
    no_key: bool = NoKey,
    parallelism: int = Parallelism,
    endpoint_url: str | None = Endpoint,
    quiet: bool = Quiet,
    as_json: bool = JsonOut,
) -> None:
    """Check the manifest signature and every chunk (authentication, decoding, BLAKE3). Exit 1 on any failure."""
    from gpumigrate.transfer.push import verify as do_verify

    store, image = _image_url(image_url)
    key = _key(key_env, key_file, no_key)
    image_id, resolved = _chosen(store, image, key, endpoint_url)
    with _progress("verify", quiet) as cb:
        stats = do_verify(store, image_id, key=key, parallelism=parallelism, endpoint_url=endpoint_url, progress=cb)
    _summary(
        {**stats.as_dict(), "ok": True, **({"resolved": resolved} if resolved else {})},
        as_json,
        f"image {stats.image_id[:16]} verified: {stats.chunks_total} chunks ok",
    )


@app.command("unpack")
def unpack(
    image_url: str = typer.Argument(..., help="IMAGE URL (STORE_URL#IMAGE_ID)"),
    out_dir: Path = typer.Argument(..., help="directory to restore the files under"),
    key_env: str | None = KeyEnv,
    key_file: Path | None = KeyFile,
    no_key: bool = NoKey,
    parallelism: int = Parallelism,
    endpoint_url: str | None = Endpoint,
    quiet: bool = Quiet,
    as_json: bool = JsonOut,
) -> None:
    """Restore a packed image's files; nothing appears in OUT_DIR unless every chunk verified."""
    from gpumigrate.transfer.pack import unpack as do_unpack

    store, image = _image_url(image_url)
    key = _key(key_env, key_file, no_key)
    image_id, resolved = _chosen(store, image, key, endpoint_url)
    with _progress("unpack", quiet) as cb:
        summary = do_unpack(
            store, image_id, out_dir, key=key, parallelism=parallelism, endpoint_url=endpoint_url, progress=cb
        )
    if resolved:
        summary["resolved"] = resolved
    _summary(summary, as_json, f"unpacked {summary['files']} files ({summary['bytes']} bytes) into {out_dir}")


@app.command("receive")
def receive(
    listen: str = typer.Option(
        "127.0.0.1:0", "--listen", help="host:port to listen on (port 0 picks a free one; loopback by default)"
    ),
    state_dir: Path | None = typer.Option(
        None,
        "--state-dir",
        help="directory for receiver.json (address and certificate fingerprint) and store/ (the images)",
    ),
    store: str | None = typer.Option(None, "--store", help="file:// store to write to (default: STATE_DIR/store)"),
    key_env: str | None = KeyEnv,
    key_file: Path | None = KeyFile,
    no_key: bool = typer.Option(
        False, "--no-key", help="no image key: only unencrypted chunks can be verified, encrypted ones are refused"
    ),
    advertise: str | None = typer.Option(None, "--advertise", help="host name senders use (listening on 0.0.0.0)"),
    quota: str | None = typer.Option(None, "--quota", help="most bytes the store may hold, e.g. 50GiB"),
    nixl: bool = typer.Option(False, "--nixl", help="also land nixl:// WRITEs (needs the nixl-cu13 package)"),
    nixl_transports: str | None = typer.Option(
        None, "--nixl-transports", help="UCX transports for NIXL (UCX_TLS), e.g. tcp; default: UCX chooses"
    ),
    handshake_timeout: float = typer.Option(
        10.0, "--handshake-timeout", min=0.001, help="seconds a client has from connecting to a signed HELLO, all of it"
    ),
    max_unauthenticated: int = typer.Option(
        16, "--max-unauthenticated", min=1, help="connections still proving themselves; past it the oldest is shed"
    ),
    max_clients: int = typer.Option(
        64, "--max-clients", min=1, help="authenticated connections (a sender opens one per --parallelism)"
    ),
    detach: bool = typer.Option(False, "--detach", help="run in the background; needs --state-dir"),
    exit_after: int = typer.Option(
        0, "--exit-after", min=0, help="exit after this many images arrived (0: until SIGTERM or `receive-stop`)"
    ),
) -> None:
    """Receive stream:// and nixl:// pushes into a local store, verifying every chunk before storing it.

    Only clients holding the control key (GPUMIGRATE_CONTROL_KEY_FILE) are served. Prints one JSON
    line with the URL to push to (certificate pinned) once listening, and the counts when it stops.
    """
    from gpumigrate.transfer.receiver.admission import ReceiverLimits
    from gpumigrate.transfer.receiver.host import ReceiverOptions, run_receiver, start_receiver

    key = _key(key_env, key_file, no_key)
    options = ReceiverOptions(
        listen=listen,
        advertise=advertise,
        quota_bytes=parse_size(quota),
        nixl=nixl,
        nixl_transports=nixl_transports,
        limits=ReceiverLimits(handshake_timeout, max_unauthenticated, max_clients),
    )
    if detach:
        if state_dir is None:
            raise InvalidInputError("--detach needs --state-dir (where receiver.json tells senders the address)")
        key_ref = {"env": key_env} if key_env else {"file": str(key_file)} if key_file else None
        if key_ref is None and not no_key:
            key_ref = {"env": DEFAULT_KEY_ENV}
        info = start_receiver(state_dir, options, key_ref=key_ref)
        emit_json({"url": info.url, "fingerprint": info.fingerprint, "store": info.store, "pid": info.pid})
        return

    def ready(doc: dict[str, Any]) -> None:
        emit_json({k: doc[k] for k in ("url", "fingerprint", "host", "port", "store", "nixl")})

    stats = run_receiver(state_dir, options, key=key, store=store, on_ready=ready, exit_after=exit_after)
    emit_json(stats)


@app.command("receive-stop")
def receive_stop(
    state_dir: Path = typer.Option(..., "--state-dir", help="the receiver's state directory"),
    timeout: float = typer.Option(30.0, "--timeout", min=1, help="seconds to wait for it to stop"),
) -> None:
    """Stop the receiver started with `receive --detach --state-dir DIR` (an authenticated request; it flushes its
    store first) and print its counts."""
    from gpumigrate.transfer.receiver.host import stop_receiver

    info = stop_receiver(state_dir, timeout_s=timeout)
    emit_json({"state": info.state, **info.stats})
    if info.state != "stopped":
        raise GpumigrateError(f"the receiver of {state_dir} did not stop cleanly (pid {info.pid})")


@app.command("ls")
def ls(
    store: str = typer.Argument(..., help="store URL"),
    endpoint_url: str | None = Endpoint,
    as_json: bool = JsonOut,
) -> None:
    """List the images in a store (unverified: use `image verify` before trusting one)."""
    import json as _json

    from gpumigrate.transfer.stores import open_store

    st = open_store(_parses(store), endpoint_url=endpoint_url)
    if (missing := st.missing()) is not None:  # a mistyped path is not an empty store
        raise missing
    rows: list[dict[str, Any]] = []
    for image_id in st.list_manifests():
        try:
            body = _json.loads(st.get_manifest(image_id))["body"]
        except (ValueError, KeyError):
            rows.append({"image_id": image_id, "error": "unreadable manifest"})
            continue
        rows.append(
            {
                "image_id": image_id,
                "created": body.get("created"),
                "sequence": body.get("sequence"),  # the newest is the largest (unverified here, as the rest)
                "parent": body.get("parent"),
                "bytes": sum(int(r["nbytes"]) for r in body.get("regions", [])),
                "encryption": body.get("encryption"),
            }
        )
    if as_json:
        emit_json({"store": store, "images": rows})
    else:
        for r in rows:
            console.print(f"{r['image_id']}  {r.get('created')}  {r.get('bytes')} bytes  parent={r.get('parent')}")


@app.command("region")
def region(
    store: str = typer.Argument(..., help="store URL"),
    endpoint_url: str | None = Endpoint,
    as_json: bool = JsonOut,
) -> None:
    """Where a store's bucket lives (for residency checks); none for file://, stream:// and nixl://."""
    from gpumigrate.transfer import store_region

    where = store_region(_parses(store), endpoint_url=endpoint_url)
    _summary({"store": store, "region": where}, as_json, f"{store}: {where or 'no cloud region'}")
