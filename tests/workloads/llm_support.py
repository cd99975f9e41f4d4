"""Shared by the LLM server's tests: an engine run to the end, a control run, and state on disk."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import LlamaForCausalLM

from gpumigrate.workloads.llm.engine import Engine
from gpumigrate.workloads.llm.model import build_model, encode
from gpumigrate.workloads.llm.requests import SamplingParams
from gpumigrate.workloads.llm.streams import Output

SLOTS = 8
MAX_CONTEXT = 512


@dataclass(frozen=True)
class Job:
    prompt: str
    params: SamplingParams


def jobs(n: int, tokens: int = 120, stops: dict[int, tuple[str, ...]] | None = None) -> list[Job]:
    """n requests: even ones greedy, odd ones sampled at temperature 0.8 with their own seed."""
    out = []
    for i in range(n):
        temp = 0.0 if i % 2 == 0 else 0.8
        stop = (stops or {}).get(i, ())
        out.append(
            Job(f"Request {i}: a story about the number {i * 37}.", SamplingParams(tokens, temp, 1000 + i, stop, True))
        )
    return out


def engine(model: LlamaForCausalLM | None = None, *, prefill_chunk: int = 256) -> Engine:
    model = model if model is not None else build_model(0, "tiny")
    return Engine(
        model, model_id="llama-tiny-float32-s0", slots=SLOTS, max_context=MAX_CONTEXT, prefill_chunk=prefill_chunk
    )


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.005)


def submit_all(e: Engine, js: list[Job]) -> list[Output]:
    """Submit every job before the first step, so the schedule does not depend on thread timing."""
    e.pause()
    outs = [e.submit(encode(j.prompt), j.params, request_id=f"req-{i}") for i, j in enumerate(js)]
    e.resume()
    return outs


def control_run(js: list[Job], model: LlamaForCausalLM | None = None) -> list[Output]:
    e = engine(model)
    try:
        outs = submit_all(e, js)
        wait_for(lambda: all(o.done for o in outs), "the control run to finish")
        return outs
    finally:
        e.close()


def pause_at_step(step: int) -> Callable[[Engine], None]:
    def hook(e: Engine) -> None:
        if e.steps == step:
            e.pause_soon()

    return hook


def encode_tensor(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).decode()


def decode_tensor(text: str, shape: list[int], dtype: str) -> torch.Tensor:
    raw = bytearray(base64.b64decode(text))
    return torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, dtype.removeprefix("torch."))).view(shape)


def _straddling_stop(text: str, cut: int) -> str | None:
    """A stop sequence that first occurs in ``text`` across character ``cut``."""
    for start in range(cut - 1, max(-1, cut - 6), -1):
        for end in range(cut + 1, min(len(text), cut + 12) + 1):
            if text.find(text[start:end]) == start:
                return text[start:end]
    return None


def _cut_texts(js: list[Job], cut: int) -> dict[str, int]:
    """Each running request's text length when an uninterrupted run is at step ``cut``."""
    seen: dict[str, int] = {}

    def record(e: Engine) -> None:
        if e.steps == cut:
            seen.update({r.id: len(r.text) for r in e.running.values()})

    e = engine()
    e.on_boundary.append(record)
    try:
        outs = submit_all(e, js)
        wait_for(lambda: all(o.done for o in outs), "the recording run")
    finally:
        e.close()
    return seen


def straddling_plan(step: int) -> tuple[list[Job], dict[str, str]]:
    """12 requests (8 running, 2 queued at step ``step``, 2 arriving then), some with a stop sequence across it."""
    base = jobs(12)
    texts = {o.id: o.text for o in control_run(base)}
    cut = _cut_texts(base[:10], step)
    stops = {}
    for i in range(10):
        rid = f"req-{i}"
        stop = _straddling_stop(texts[rid], cut[rid]) if rid in cut else None
        if stop is not None:
            stops[i] = (stop,)
    assert len(stops) >= 2, f"no stop sequences straddle the cut: {cut}"
    return jobs(12, stops=stops), {f"req-{i}": s[0] for i, s in stops.items()}


def save_state(path: Path, state: dict, tensors: dict[str, torch.Tensor]) -> None:
    path.write_text(json.dumps({"state": state, "tensors": {k: encode_tensor(t) for k, t in tensors.items()}}))


def load_state(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    d = json.loads(path.read_text())
    state = d["state"]
    return state, {k: decode_tensor(v, state["kv_shape"], state["kv_dtype"]) for k, v in d["tensors"].items()}


# -- real server processes
@dataclass
class LLMProc:
    proc: subprocess.Popen[str]
    url: str
    agent: str = ""  # the SDK's agent address

    def stop(self) -> int:
        """SIGTERM, as a supervisor would; the exit code (SIGKILL after 30 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(10)


def start_llm_server(*extra: str, home: Path, key_hex: str, timeout_s: float = 120.0) -> LLMProc:
    """``python -m gpumigrate.workloads.llm`` on a free port, its own state root and control key; waits for /readyz."""
    (server,) = start_llm_servers([(extra, home)], key_hex=key_hex, timeout_s=timeout_s)
    return server


def start_llm_servers(
    specs: list[tuple[tuple[str, ...], Path]],
    *,
    key_hex: str,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[LLMProc]:
    """Several servers (flags, state root) started side by side, sharing one control key (and ``env``); each waited
    for: ready, or alive for one started ``--await-restore``."""
    procs = []
    for extra, home in specs:
        proc_env = {
            **os.environ,
            **(env or {}),
            "GPUMIGRATE_HOME": str(home),
            "GPUMIGRATE_CONTROL_KEY": key_hex,
            "OMP_NUM_THREADS": "1",
        }
        argv = [sys.executable, "-m", "gpumigrate.workloads.llm", "--port", "0", "--agent-port", "0", *extra]
        procs.append(
            subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=proc_env, start_new_session=True
            )
        )
    try:
        servers = []
        for proc in procs:
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the LLM server exited ({proc.wait(10)}): {proc.stderr.read()[-3000:]}")
            listening = json.loads(line)
            servers.append(LLMProc(proc, f"http://127.0.0.1:{listening['port']}", listening["agent"]))
        for server, (extra, _) in zip(servers, specs, strict=True):
            path = "/healthz" if "--await-restore" in extra else "/readyz"
            wait_for(lambda u=server.url + path: _ready(u), f"{server.url}{path} to answer 200", timeout_s)
        return servers
    except BaseException:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        raise


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def engine_stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(url + "/v1/engine", timeout=10).json()
    return stats
