"""A tensor-parallel language model of N ranks: each rank holds 1/N of every layer; rank 0 serves HTTP.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m gpumigrate.workloads.tp_inference \\
        --host 127.0.0.1 --port 18080 --seed 0 --device cpu|cuda [--devices 1,0] [--params-mb N] [--mutable-mb N]

The model (byte tokens, vocabulary 260): token and position embeddings and layer norms replicated;
per block a column-parallel input projection and a row-parallel output projection (Megatron's MLP
split) joined by an all-reduce; the output head split by vocabulary, its halves gathered on every
rank. So rank r holds rows [r·F/N, (r+1)·F/N) of each block and 1/N of the head, and every token
costs collectives on every rank.

Rank 0 runs an engine loop: each iteration takes one request (or none after ``--idle-ms``: an idle
tick, so that every rank keeps stepping), broadcasts it to the other ranks and decodes it with them,
all inside one safe point of the SDK on every rank. A group freeze therefore parks every rank after
the same engine step with no collective in flight. ``POST /v1/generate`` ``{"prompt": str,
"max_new_tokens": 1..64}`` → ``{"tokens", "logprobs", "text", "ranks"}`` (greedy); ``GET /v1/info``;
``/healthz`` and ``/readyz`` from the SDK's middleware. Rank 0 prints ``{"event": "listening", ...}``.
``--params-mb N``: about N MB of weights per rank; ``--mutable-mb N``: N MB of device state per rank that every
request changes (a KV cache's stand-in: what a stop-and-copy moves after the pre-copy).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import signal
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import gpumigrate.agent as gm
from gpumigrate.workloads.inference import bind_socket
from gpumigrate.workloads.ranked import Rank, emit, join, parse_devices

VOCAB = 260
BOS = 256
CONTEXT = 128
WINDOW = 8  # the tokens each position averages over (a cheap stand-in for attention)
MAX_PROMPT = 256
MAX_NEW = 64
REQUEST_WAIT_S = 30.0
IDLE, STOP = -1, -2  # header kinds besides a request's prompt length


@dataclass(frozen=True)
class Shape:
    d_model: int
    d_ff: int
    layers: int


def shape_for(params_mb: float | None, ranks: int) -> Shape:
    """The tiny default, or wider layers adding up to about ``params_mb`` of fp32 per rank."""
    if not params_mb:
        return Shape(128, 512, 2)
    d = 256 if params_mb < 64 else 1024 if params_mb < 4096 else 4096
    per_layer_mb = 2 * d * (4 * d // ranks) * 4 / 2**20
    return Shape(d, 4 * d, max(1, round(params_mb / per_layer_mb)))


class ShardedLM(torch.nn.Module):
    """Rank ``rank``'s shard of the model; ``forward`` needs every rank to call it at once."""

    def __init__(self, shape: Shape, ranks: int, rank: int) -> None:
        super().__init__()
        if shape.d_ff % ranks or VOCAB % ranks:
            raise SystemExit(f"{ranks} ranks do not divide d_ff {shape.d_ff} and the vocabulary {VOCAB}")
        d, f = shape.d_model, shape.d_ff // ranks
        self.ranks, self.rank = ranks, rank
        self.tok_emb = torch.nn.Parameter(torch.empty(VOCAB, d))
        self.pos_emb = torch.nn.Parameter(torch.empty(CONTEXT, d))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d) for _ in range(shape.layers + 1))
        self.w_in = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(f, d)) for _ in range(shape.layers))
        self.b_in = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(f)) for _ in range(shape.layers))
        self.w_out = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(d, f)) for _ in range(shape.layers))
        self.b_out = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(d)) for _ in range(shape.layers))
        self.head = torch.nn.Parameter(torch.empty(VOCAB // ranks, d))

    def init_weights(self, seed: int) -> None:
        """Replicated tensors from one stream (equal on every rank), shards from a stream of their own."""
        with torch.no_grad():
            for i, (name, p) in enumerate(self.named_parameters()):
                replicated = name.startswith(("tok_emb", "pos_emb", "norms", "b_out"))
                gen = torch.Generator(p.device).manual_seed(
                    seed * 1_000_003 + i * 101 + (0 if replicated else self.rank + 1)
                )
                if name.startswith("norms") and name.endswith("weight"):
                    p.fill_(1.0)
                elif name.startswith(("norms", "b_")):
                    p.normal_(0.0, 0.01, generator=gen)
                else:
                    p.normal_(0.0, 0.05, generator=gen)

    def logits(self, context: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits for the next token after ``context`` (1-D token ids)."""
        window = context[-WINDOW:]
        h = self.tok_emb[context[-1]] + self.tok_emb[window].mean(0) + self.pos_emb[(context.numel() - 1) % CONTEXT]
        for i in range(len(self.w_in)):
            a = F.gelu(F.linear(self.norms[i](h), self.w_in[i], self.b_in[i]))
            part = F.linear(a, self.w_out[i])
            dist.all_reduce(part)  # row-parallel: each rank's partial sum of the output projection
            h = h + part + self.b_out[i]
        local = F.linear(self.norms[-1](h), self.head)
        shards = [torch.empty_like(local) for _ in range(self.ranks)]
        dist.all_gather(shards, local)  # column-parallel head: every rank gets the whole vocabulary
        return torch.cat(shards)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new: int) -> tuple[list[int], list[float]]:
        context = prompt
        tokens: list[int] = []
        logprobs: list[float] = []
        for _ in range(max_new):
            logp = torch.log_softmax(self.logits(context).float(), dim=-1)
            token = int(torch.argmax(logp))
            tokens.append(token)
            logprobs.append(float(logp[token]))
            context = torch.cat([context, torch.tensor([token], device=context.device)])
        return tokens, logprobs


def encode_prompt(text: str) -> list[int]:
    return [BOS, *text.encode()]


@dataclass
class Job:
    prompt: list[int]
    max_new: int
    future: Future[dict[str, Any]]


class Engine:
    """Rank 0's loop: one request (or an idle tick) per safe point, broadcast to every rank."""

    def __init__(
        self, model: ShardedLM, handle: gm.Handle, me: Rank, idle_s: float, mutable: torch.Tensor | None = None
    ) -> None:
        self.model, self.handle, self.me, self.idle_s, self.mutable = model, handle, me, idle_s, mutable
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="tp-engine", daemon=True)

    def submit(self, prompt: list[int], max_new: int) -> Future[dict[str, Any]]:
        job = Job(prompt, max_new, Future())
        self.jobs.put(job)
        return job.future

    def run(self) -> None:
        if self.me.device.type == "cuda":
            torch.cuda.set_device(self.me.device)  # a thread starts on device 0; NCCL's work runs on ours
        while True:
            try:
                job: Job | None = self.jobs.get(timeout=self.idle_s)
            except queue.Empty:
                job = None
            stop = job is None and self.stopping.is_set()
            if job is not None and not job.future.set_running_or_notify_cancel():
                job = None  # its client gave up while it was held
            with self.handle.safe_point(timeout_s=None):
                out = step(self.model, self.me, job, stop=stop, mutable=self.mutable)
            if job is not None:
                job.future.set_result(out or {})
            if stop:
                return


def step(
    model: ShardedLM, me: Rank, job: Job | None, *, stop: bool = False, mutable: torch.Tensor | None = None
) -> dict[str, Any] | None:
    """One engine step on any rank: rank 0's job (None: idle) reaches every rank through a broadcast; a request
    changes every byte of the rank's ``mutable`` state (``--mutable-mb``: a KV cache's stand-in)."""
    header = torch.zeros(2 + MAX_PROMPT, dtype=torch.long, device=me.device)
    if me.rank == 0:
        header[0] = STOP if stop else IDLE if job is None else len(job.prompt)
        if job is not None:
            header[1] = job.max_new
            header[2 : 2 + len(job.prompt)] = torch.tensor(job.prompt)
    dist.broadcast(header, src=0)
    kind = int(header[0])
    if kind < 0:
        return {"stop": True} if kind == STOP else None
    tokens, logprobs = model.generate(header[2 : 2 + kind].clone(), int(header[1]))
    if mutable is not None:
        mutable.add_(1)
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "text": bytes(t for t in tokens if t < 256).decode(errors="replace"),
    }


def serve_worker(model: ShardedLM, handle: gm.Handle, me: Rank, mutable: torch.Tensor | None = None) -> None:
    """Ranks other than 0: take part in every engine step until rank 0 says stop."""
    while True:
        with handle.safe_point(timeout_s=None):
            out = step(model, me, None, mutable=mutable)
        if out is not None and out.get("stop"):
            return


def build_app(engine: Engine, info: dict[str, Any]) -> Starlette:
    async def generate(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "body must be JSON"}, status_code=400)
        prompt, max_new = (body.get("prompt"), body.get("max_new_tokens", 8)) if isinstance(body, dict) else (None, 0)
        if not isinstance(prompt, str) or len(encode_prompt(prompt)) > MAX_PROMPT:
            return JSONResponse({"error": f"prompt: a string of at most {MAX_PROMPT - 1} bytes"}, status_code=400)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or not 1 <= max_new <= MAX_NEW:
            return JSONResponse({"error": f"max_new_tokens: a whole number from 1 to {MAX_NEW}"}, status_code=400)
        future = engine.submit(encode_prompt(prompt), max_new)
        try:
            out = await asyncio.wait_for(asyncio.wrap_future(future), REQUEST_WAIT_S)
        except (TimeoutError, FutureTimeout):
            future.cancel()
            return JSONResponse({"error": "the model is being migrated; retry"}, status_code=503)
        return JSONResponse({**out, "ranks": info["world_size"]})

    async def get_info(request: Request) -> JSONResponse:
        return JSONResponse(info)

    app = Starlette(routes=[Route("/v1/generate", generate, methods=["POST"]), Route("/v1/info", get_info)])
    app.add_middleware(gm.ReadinessMiddleware)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumigrate.workloads.tp_inference", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18080, help="rank 0's HTTP port (0: a free one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--devices", default=None, help="rank r's CUDA device index, e.g. 1,0 (default: its local rank)")
    p.add_argument("--params-mb", type=float, default=None, help="about N MB of weights per rank")
    p.add_argument("--idle-ms", type=float, default=20.0, help="an idle engine tick after this long without requests")
    p.add_argument(
        "--mutable-mb",
        type=float,
        default=0,
        help="N MB of device state per rank that every request changes (migrated)",
    )
    args = p.parse_args(argv)

    me = join(args.device, parse_devices(args.devices))
    torch.set_num_threads(1)
    shape = shape_for(args.params_mb, me.world_size)
    with torch.device("meta"):
        model = ShardedLM(shape, me.world_size, me.rank)
    model = model.to_empty(device=me.device).eval()
    if not gm.awaiting_restore():  # a target gets its shard from the restore
        model.init_weights(args.seed)
    # --mutable-mb: state every request changes, as a KV cache would; it travels with the rank's weights.
    mutable = torch.zeros(int(args.mutable_mb * (1 << 20)), dtype=torch.uint8, device=me.device)
    handle = gm.attach(model, process_group=dist.group.WORLD, state={"mutable": mutable} if args.mutable_mb else None)
    kept = mutable if args.mutable_mb else None
    if me.rank != 0:
        serve_worker(model, handle, me, kept)
    else:
        serve_rank0(model, handle, me, args, shape, kept)
    handle.close()
    dist.destroy_process_group()
    return 0


def serve_rank0(
    model: ShardedLM,
    handle: gm.Handle,
    me: Rank,
    args: argparse.Namespace,
    shape: Shape,
    mutable: torch.Tensor | None = None,
) -> None:
    engine = Engine(model, handle, me, args.idle_ms / 1000, mutable)
    info = {
        "model": f"tp-lm-d{shape.d_model}-l{shape.layers}-s{args.seed}",
        "world_size": me.world_size,
        "device": str(me.device),
        "backend": me.backend,
        "torch": torch.__version__,
        "pid": os.getpid(),
    }
    sock = bind_socket(args.host, args.port)
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine, info), log_level="warning", access_log=False, lifespan="off")
    )
    engine.thread.start()
    emit("listening", host=args.host, port=sock.getsockname()[1], pid=os.getpid(), agent=handle.address)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # uvicorn's graceful stop, then exit 0
    try:
        server.run(sockets=[sock])
    finally:
        engine.stopping.set()
        engine.thread.join(REQUEST_WAIT_S)  # a frozen engine (a migration in progress) is left behind


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's slow interpreter teardown; everything is closed by now
