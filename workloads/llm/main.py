"""``python -m gpumigrate.workloads.llm``: flags, the SDK's attach, and uvicorn.

Prints one line ``{"event": "listening", "host", "port", "pid", "agent", "model"}`` once bound
(``--port 0`` picks a free port). SIGTERM: stop accepting, finish the streams in flight (up to 30 s),
exit 0. Bad flags or an agent address in use: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys

import torch
import uvicorn

import gpumigrate.agent as gm
from gpumigrate import control
from gpumigrate.errors import GpumigrateError
from gpumigrate.workloads.contract import add_contract_flags, apply_contract_overrides
from gpumigrate.workloads.inference import bind_socket

from .engine import Engine
from .handover import CLAIM_TIMEOUT_S, Handover
from .migration import EngineWork
from .model import CONFIGS, DTYPES, build_model, model_id
from .server import LLMServer

SIZE_ENV = "GPUMIGRATE_LLM_SIZE"  # the default of --size (tiny | 1b)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpumigrate.workloads.llm", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18080, help="HTTP port (0: pick a free one)")
    p.add_argument("--name", default=socket.gethostname(), help="this host's name in /v1/engine")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed")
    p.add_argument("--size", choices=sorted(CONFIGS), default=os.environ.get(SIZE_ENV, "tiny"), help=f"(${SIZE_ENV})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--slots", type=int, default=None, help="requests decoded together (default: the size's)")
    p.add_argument("--max-context", type=int, default=None, help="positions per request (default: the size's)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per request per step")
    add_contract_flags(p)
    p.add_argument(
        "--claim-timeout-s", type=float, default=CLAIM_TIMEOUT_S, help="cancel imported requests no relay claims"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    shape = CONFIGS[args.size]
    slots = args.slots if args.slots is not None else shape.slots
    max_context = args.max_context if args.max_context is not None else shape.max_context
    for flag, value in (("--slots", slots), ("--max-context", max_context), ("--prefill-chunk", args.prefill_chunk)):
        if value < 1:
            parser.error(f"{flag} must be at least 1; got {value}")
    apply_contract_overrides(args)
    torch.set_num_threads(max(1, args.threads))
    try:
        # On a target gpumigrate started, the weights come from the restore: build the shapes only.
        model = build_model(args.seed, args.size, args.dtype, args.device, load_weights=not gm.awaiting_restore())
        name = model_id(args.size, args.dtype, args.seed)
        engine = Engine(model, model_id=name, slots=slots, max_context=max_context, prefill_chunk=args.prefill_chunk)
        engine.warm_up()  # a target's first decode step after its restore holds every moved stream: not a cold one
        key = control.load_key(None, create=True)
        relay = Handover(engine, key, claim_timeout_s=args.claim_timeout_s)
        streams: list[LLMServer] = []  # the server, once built: its open streams are one of the work's figures
        handle = gm.attach(
            model,
            name="model",
            state={"kv": engine.cache.kv},
            written={"kv": engine.cache.take_written},  # pre-copy ships the KV rows written since the last round
            in_flight=EngineWork(engine, relay, streams=lambda: sum(s.streams for s in streams)),
        )
    except (GpumigrateError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, GpumigrateError) else 2
    # Each step in the SDK's safe point: a freeze waits for the step in flight and holds the next.
    engine.step_guard = lambda: handle.safe_point(None)
    server = LLMServer(engine, key=key, name=args.name, handle=handle, relay=relay)
    streams.append(server)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        engine.close()
        handle.close()
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        server.app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=30
    )
    port = sock.getsockname()[1]
    line = {"event": "listening", "host": args.host, "port": port, "pid": os.getpid(), "agent": handle.address}
    print(json.dumps({**line, "model": name}), flush=True)
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown: a no-op handler makes that exit 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()
        handle.close()
    return 0
