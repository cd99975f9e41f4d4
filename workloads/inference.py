"""The reference inference server: the workload that demo, tests and benchmarks migrate.

    GPUMIGRATE_AGENT_ADDR=127.0.0.1:17070 python -m gpumigrate.workloads.inference --host 127.0.0.1 \
        --port 18080 --seed 0 --size tiny --device cpu --dtype float32 --threads 1 --name local-a

It embeds the migration agent through the public SDK (``gpumigrate.agent``) like any user's
service: it attaches to the model, serves each request inside the handle's safe point, and reads
its agent address and await-restore from the environment contract (``--agent-port`` and
``--await-restore`` are thin overrides of those two variables). ``POST /admin/fault`` exists only
in a process started with faults enabled (``--enable-faults`` or ``GPUMIGRATE_ENABLE_FAULTS=1``).

HTTP API: see ``workloads/README.md``. Starlette on uvicorn; the model runs in a small thread pool
so the event loop keeps answering health checks while a request waits at a frozen safe point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import gpumigrate.agent as gm
from gpumigrate.errors import GpumigrateError, InvalidInputError
from gpumigrate.workloads.contract import add_contract_flags, apply_contract_overrides
from gpumigrate.workloads.environment import environment_facts
from gpumigrate.workloads.model import build_model, decode, generate
from gpumigrate.workloads.serving import Fault, ServingState

MAX_NEW_TOKENS = 64
MAX_PROMPT_CHARS = 8192
FROZEN_WAIT_S = 30.0  # a request held by a freeze waits this long before it gets a 503
FAULTS_ENV = "GPUMIGRATE_ENABLE_FAULTS"  # "1": serve POST /admin/fault (demo, tests); never by default


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def parse_generate(raw: bytes) -> tuple[str, int]:
    """Validate a /v1/generate body; InvalidInputError names the field at fault."""
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInputError('body must be a JSON object like {"prompt": "...", "max_new_tokens": 8}')
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidInputError("field 'prompt' is required and must be a string")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidInputError(f"field 'prompt' must be at most {MAX_PROMPT_CHARS} characters")
    n = body.get("max_new_tokens", 8)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS:
        raise InvalidInputError(f"field 'max_new_tokens' must be an integer in 1..{MAX_NEW_TOKENS}; got {n!r}")
    unknown = set(body) - {"prompt", "max_new_tokens"}
    if unknown:
        raise InvalidInputError(f"unknown field(s) {sorted(unknown)}; allowed: prompt, max_new_tokens")
    return prompt, n


class InferenceApp:
    """Binds a :class:`ServingState` to HTTP routes."""

    def __init__(self, state: ServingState, *, workers: int = 2, faults: bool = False) -> None:
        self.state = state
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="infer")
        routes = [
            Route("/v1/generate", self.generate, methods=["POST"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/v1/info", self.info, methods=["GET"]),
        ]
        if faults:  # fault injection only where it was asked for: anyone who reaches it can break the service
            routes.append(Route("/admin/fault", self.fault, methods=["GET", "POST"]))
        self.app = Starlette(routes=routes)

    def _run_generate(self, prompt: str, n: int) -> tuple[int, dict[str, Any]]:
        state = self.state
        with state.request(FROZEN_WAIT_S):
            fault = state.fault
            hit = state.fault_hits()
            if hit and fault.kind == "crash":
                os._exit(17)  # the crash fault: die mid-request, as a real crash would
            if hit and fault.kind == "errors":
                return 500, {"error": "injected fault: errors"}
            if hit and fault.kind == "slow":
                time.sleep(fault.delay_ms / 1000.0)
            noise = state.drift_noise if hit and fault.kind == "drift" else None
            tokens, logprobs = generate(state.model, prompt, n, logit_noise=noise)
            if state.mutable is not None:  # --mutable-mb: state every request changes, as a KV cache would
                state.mutable.add_(1)
        return 200, {
            "tokens": tokens,
            "text": decode(tokens),
            "logprobs": logprobs,
            "model": state.model_id,
            "host": state.name,
        }

    async def generate(self, request: Request) -> Response:
        try:
            prompt, n = parse_generate(await request.body())
        except InvalidInputError as exc:
            return _error(400, exc.message)
        if not self.state.loaded and not self.state.safe_point.retired:  # retired: the safe point says why
            return _error(503, "not ready: weights not loaded yet (waiting for restore)")
        try:
            status, body = await asyncio.get_running_loop().run_in_executor(self.pool, self._run_generate, prompt, n)
        except GpumigrateError as exc:  # held too long at a frozen safe point, or a retired one
            return _error(503, str(exc))
        return JSONResponse(body, status_code=status)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "alive", "host": self.state.name})

    async def readyz(self, request: Request) -> Response:
        st = self.state
        status, body = st.safe_point.readiness()  # a freeze holds requests: it reads as ready ("held")
        return JSONResponse({**body, "host": st.name}, status_code=status)

    async def info(self, request: Request) -> Response:
        # Not the request pool: its threads may all be parked at a frozen safe point during a migration.
        facts = await asyncio.get_running_loop().run_in_executor(None, self._info)
        return JSONResponse(facts)

    def _info(self) -> dict[str, Any]:
        st = self.state
        facts = environment_facts(st.meta.get("device", "cpu"))
        facts.update(
            {
                "host": st.name,
                "model": st.model_id,
                "ready": st.ready,
                "weights_digest": st.weights_digest(),
                "n_params": sum(p.numel() for p in st.model.parameters()),
            }
        )
        facts.update({k: st.meta[k] for k in ("seed", "size", "dtype", "device", "params_mb") if k in st.meta})
        mutable = st.mutable
        if mutable is not None:
            from gpumigrate.workloads.model import weights_digest

            facts["mutable_digest"] = weights_digest({"mutable": mutable})
        return facts

    async def fault(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                raw = await request.body()
                self.state.set_fault(Fault.parse(json.loads(raw or b"{}")))
            except ValueError as exc:
                return _error(400, f"body is not valid JSON: {exc}")
            except InvalidInputError as exc:
                return _error(400, exc.message)
            if self.state.fault.kind == "crash" and self.state.fault.rate >= 1.0:
                # Acknowledge first so the caller knows the fault took, then die without cleanup.
                threading.Timer(0.05, os._exit, args=(17,)).start()
        return JSONResponse(self.state.fault.to_json())

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=False)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before uvicorn starts so port 0 works and the real port can be reported."""
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose proto is TCP,
    # and without it Nagle + delayed ACK add ~40 ms to every keep-alive response.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


@dataclass
class RunningServer:
    """An in-process server (tests, embedding): ``url``, ``state``, ``stop()``."""

    url: str
    port: int
    state: ServingState
    app: InferenceApp
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.app.close()


def _uvicorn_config(app: Starlette) -> uvicorn.Config:
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=30)


def start_in_thread(
    state: ServingState, host: str = "127.0.0.1", port: int = 0, *, workers: int = 2, faults: bool = False
) -> RunningServer:
    """Serve ``state`` from a background thread of this process (no signal handlers installed)."""
    app = InferenceApp(state, workers=workers, faults=faults)
    sock = bind_socket(host, port)
    server = uvicorn.Server(_uvicorn_config(app.app))
    # uvicorn installs signal handlers only on the main thread: this server's thread leaves them alone.
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    real_port = sock.getsockname()[1]
    return RunningServer(f"http://{host}:{real_port}", real_port, state, app, server, thread)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpumigrate.workloads.inference", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18080, help="HTTP port (0: pick a free one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", default="tiny", help="tiny | small")
    p.add_argument("--params-mb", type=float, default=None, help="scale the model to about N MB of weights")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--workers", type=int, default=2, help="request worker threads")
    p.add_argument("--name", default=socket.gethostname(), help="host name reported in every answer")
    add_contract_flags(p)
    p.add_argument("--enable-faults", action="store_true", help=f"serve POST /admin/fault (${FAULTS_ENV}=1)")
    p.add_argument(
        "--mutable-mb", type=float, default=0, help="N MB of device state that every request changes (migrated too)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_contract_overrides(args)
    torch.set_num_threads(max(1, args.threads))
    try:
        # On a target gpumigrate started, the weights come from the restore: build the shapes only.
        model = build_model(
            args.seed,
            args.size,
            args.dtype,
            args.device,
            params_mb=args.params_mb,
            load_weights=not gm.awaiting_restore(),
        )
        # --mutable-mb: device state that every request changes, as a KV cache would; it travels too.
        mutable = torch.zeros(int(args.mutable_mb * (1 << 20)), dtype=torch.uint8, device=args.device)
        handle = gm.attach(model, name="model", state={"mutable": mutable} if args.mutable_mb else None)
    except GpumigrateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    size = f"{args.params_mb:g}mb" if args.params_mb else args.size
    meta = {"seed": args.seed, "size": size, "dtype": args.dtype, "device": args.device, "threads": args.threads}
    if args.params_mb:
        meta["params_mb"] = args.params_mb
    state = ServingState(
        model, name=args.name, model_id=f"tinylm-{size}-{args.dtype}-s{args.seed}", meta=meta, handle=handle
    )
    state.mutable = mutable if args.mutable_mb else None
    faults = args.enable_faults or os.environ.get(FAULTS_ENV) == "1"
    app = InferenceApp(state, workers=args.workers, faults=faults)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        handle.close()
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(_uvicorn_config(app.app))
    port = sock.getsockname()[1]
    # One machine-readable line so launchers learn the bound ports without polling.
    listening = {"event": "listening", "host": args.host, "port": port, "pid": os.getpid(), "agent": handle.address}
    print(json.dumps(listening), flush=True)
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown, restoring the previous handler
    # first; a no-op handler there turns a finished graceful shutdown into exit 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])  # uvicorn handles SIGTERM/SIGINT: stop accepting, finish in-flight
    finally:
        handle.close()
        app.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is closed by now (requests finished, agent and pool closed); skipping interpreter
    # finalization skips torch's and OpenMP's teardown, slow enough to eat the supervisor's grace period.
    os._exit(code)
