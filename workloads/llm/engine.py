"""The engine loop: continuous batching over the KV cache, one token per running request per step.

Requests arrive from any thread (``submit``) into the inbox; at the start of each step the engine
moves them to its queue (arrival order) and admits queued requests into free slots; then it runs one
prompt chunk for each request still prefilling (``prefill_chunk`` tokens) and one decode step over
all slots, and publishes each request's new text to its :class:`Output`. A finished or cancelled
request leaves its slot at once, and the next queued one takes it at the next step.

Step boundaries are where a migration's freeze lands. ``step_guard`` wraps each step (the SDK's safe
point: ``lambda: handle.safe_point(None)``), so a freeze waits for the step in flight and holds the
next; ``on_boundary`` callables run between two steps on the engine's thread; ``pause()`` parks the
loop at the next boundary by itself. At a boundary, ``export_state()`` gives the whole travelling
state — every request (running, queued, arrived), its tokens, text, sampler and limits — as JSON,
and the KV cache as named tensors; ``import_state()`` into an idle engine of the same shape makes
it continue exactly there (DESIGN.md, "The travelling state").
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from typing import Any

import torch
from transformers import LlamaForCausalLM

from .forward import Forward
from .kvcache import KVCache
from .model import EOS, NEVER_SAMPLED, PAD
from .requests import Request, SamplingParams
from .streams import Output

FORMAT = "gpumigrate-llm-engine/1"


class EngineStateError(ValueError):
    """An exported state that does not fit this engine (another model or cache shape), or an engine not idle."""


class Engine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        model_id: str,
        slots: int,
        max_context: int,
        prefill_chunk: int = 256,
        step_guard: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        cfg = model.config
        param = next(model.parameters())
        self.model_id = model_id
        self.cache = KVCache(
            slots=slots,
            positions=max_context,
            layers=cfg.num_hidden_layers,
            kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            dtype=param.dtype,
            device=param.device,
        )
        self.forward = Forward(model, self.cache)
        self.prefill_chunk = prefill_chunk
        self.step_guard = step_guard
        self.on_boundary: list[Callable[[Engine], None]] = []
        self.steps = 0
        self.last_step_s = 0.0
        # Every step's wall and engine-thread CPU seconds, summed: a step that waits for the GIL sleeps (wall without
        # CPU), one that waits for the device spins in its synchronisation (CPU time): ``stats`` says which a step is.
        self.step_s_total = 0.0
        self.step_cpu_s_total = 0.0
        self.warm_up_s: float | None = None
        self.running: dict[int, Request] = {}  # slot -> request
        self.queue: deque[Request] = deque()  # admitted by the scheduler, waiting for a slot
        self.inbox: list[Request] = []  # arrived since the last step began
        self.aside: list[tuple[str, Request]] = []  # (where, request) held for a migration: not stepped, slots kept
        self.outputs: dict[str, Output] = {}
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()  # held for a whole step: export/import run between steps
        self._paused = False
        self._parked = False
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    @property
    def max_context(self) -> int:
        return self.cache.positions

    # -- requests (any thread)
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> Output:
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(f"{len(prompt)} prompt + {params.max_tokens} new tokens exceed {self.max_context}")
        if params.temperature > 0 and params.seed is None:  # the seed travels with the request: draw it now
            params = SamplingParams(
                params.max_tokens, params.temperature, secrets.randbits(63), params.stop, params.ignore_eos
            )
        req = Request(request_id or f"cmpl-{secrets.token_hex(12)}", prompt, params)
        output = Output(req.id, len(prompt))
        with self._cond:
            if req.id in self.outputs:
                raise ValueError(f"request id {req.id} is in use")
            self.outputs[req.id] = output
            self.inbox.append(req)
            self._cond.notify_all()
        return output

    def cancel(self, request_id: str) -> None:
        """The client went away: the request leaves its slot (or the queue) at the next step."""
        with self._cond:
            for req in (*self.running.values(), *self.queue, *self.inbox, *(r for _, r in self.aside)):
                if req.id == request_id and not req.done:
                    req.cancelled = True
            self._cond.notify_all()

    def release(self, request_id: str) -> None:
        """Forget a request's output once nobody will read it again (cancelling it if still going)."""
        self.cancel(request_id)
        with self._cond:
            self.outputs.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            running = sorted(self.running.items())
            return {
                "model": self.model_id,
                "steps": self.steps,
                "slots": self.cache.slots,
                "free_slots": self.cache.free_slots,
                "running": [{"id": r.id, "slot": s, "tokens": len(r.tokens)} for s, r in running],
                "queued": [r.id for r in self.queue],
                "arrived": [r.id for r in self.inbox],
                "aside": [r.id for _, r in self.aside],
                "last_step_ms": round(self.last_step_s * 1000, 3),
                "step_s_total": round(self.step_s_total, 6),
                "step_cpu_s_total": round(self.step_cpu_s_total, 6),
                "warm_up_ms": None if self.warm_up_s is None else round(self.warm_up_s * 1000, 1),
            }

    def warm_up(self) -> float:
        """One prompt chunk and one decode step on a free slot, before the server takes requests (``Forward.warm_up``
        says why); the slot's rows are zeroed again and the record of written rows cleared, so the cache is as it was.
        Returns the seconds it took."""
        with self._step_lock:
            started, prompt = time.perf_counter(), min(self.prefill_chunk, self.max_context - 1)
            if prompt < 1 or not self.cache.free_slots:
                return 0.0  # no request fits such a cache (or none is free): nothing to warm
            slot = self.cache.take()
            try:
                self.forward.warm_up(slot, prompt)
            finally:
                self.cache.kv[slot].zero_()
                self.cache.give_back(slot)
                self.cache.take_written()
            self.warm_up_s = time.perf_counter() - started
        return self.warm_up_s

    # -- the loop
    def _has_work(self) -> bool:
        return bool(self.inbox or self.queue or self.running)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._parked = True
                self._cond.notify_all()
                while not self._stopping and (self._paused or not self._has_work()):
                    self._cond.wait()
                self._parked = False
                if self._stopping:
                    return
            try:
                guard = self.step_guard()
                guard.__enter__()
            except Exception:  # the safe point refused the step (a retired source): nothing will run here again
                self._fail_all()
                continue
            try:
                with self._step_lock:
                    started, cpu = time.perf_counter(), time.thread_time()
                    try:
                        self._step()
                    except Exception:  # a failed step (a device error) must not leave every stream waiting for ever
                        traceback.print_exc(file=sys.stderr)
                        self._fail_all()
                    self.last_step_s = time.perf_counter() - started
                    self.step_s_total += self.last_step_s
                    self.step_cpu_s_total += time.thread_time() - cpu
            finally:
                guard.__exit__(None, None, None)
            for hook in list(self.on_boundary):
                hook(self)

    def pause(self, timeout_s: float = 30.0) -> int:
        """Park the loop at the next step boundary; returns the steps taken so far. Raises TimeoutError."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._parked, timeout_s):
                raise TimeoutError(f"the engine did not reach a step boundary within {timeout_s:g}s")
            return self.steps

    @property
    def parked(self) -> bool:
        """The loop waits between two steps (paused, or idle)."""
        with self._cond:
            return self._parked

    def pause_soon(self) -> None:
        """Park at the next boundary without waiting (from an ``on_boundary`` hook: parks before the next step)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(30)

    # -- one step (engine thread, under _step_lock)
    def _step(self) -> None:
        with self._cond:
            self.queue.extend(self.inbox)
            self.inbox = []
            for req in [r for r in self.queue if r.cancelled]:
                self.queue.remove(req)
                self._finish(req, "cancelled")
            for req in [r for r in self.running.values() if r.cancelled]:
                self._finish(req, "cancelled")
            while self.queue and self.cache.free_slots:
                req = self.queue.popleft()
                req.slot = self.cache.take()
                self.running[req.slot] = req
            batch = sorted(self.running.items())
        touched: list[Request] = []
        decoding = [r for _, r in batch if r.prefill_done and r.tokens]
        for _, req in batch:  # one prompt chunk each; its boundaries depend on the prompt alone
            if not req.prefill_done:
                chunk = req.prompt[req.prefilled : req.prefilled + self.prefill_chunk]
                logits = self.forward.prefill(req.seat, chunk, req.prefilled)
                req.prefilled += len(chunk)
                if req.prefilled == len(req.prompt):
                    req.accept(*self._sample(logits[None], [req])[0])
                    touched.append(req)
        if decoding:
            tokens, positions = [PAD] * self.cache.slots, [0] * self.cache.slots
            for req in decoding:
                tokens[req.seat], positions[req.seat] = req.tokens[-1], req.position
            seats = [r.seat for r in decoding]
            logits = self.forward.decode(tokens, positions, seats)
            rows = logits[seats]
            for req, (token, logprob) in zip(decoding, self._sample(rows, decoding), strict=True):
                req.accept(token, logprob)
            touched.extend(decoding)
        with self._cond:
            for req in touched:
                self._publish(req)
            self.steps += 1

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple[int, float | None]]:
        """One token per row: argmax at temperature 0, else a draw from the request's own generator; with the
        token's log-probability (under the model's distribution) where the request asked for it."""
        logits[:, list(NEVER_SAMPLED)] = float("-inf")
        for i, req in enumerate(reqs):
            if req.params.ignore_eos:
                logits[i, EOS] = float("-inf")
        chosen = logits.argmax(dim=-1).tolist()
        for i, req in enumerate(reqs):
            if req.params.temperature > 0:
                probs = torch.softmax(logits[i].cpu() / req.params.temperature, dim=-1)
                chosen[i] = int(torch.multinomial(probs, 1, generator=req.generator))
        out: list[tuple[int, float | None]] = []
        for i, req in enumerate(reqs):
            logprob = float(torch.log_softmax(logits[i], dim=-1)[chosen[i]]) if req.params.logprobs else None
            out.append((chosen[i], logprob))
        return out

    def _publish(self, req: Request) -> None:
        delta = req.publishable()
        req.emitted += len(delta)
        output = self.outputs.get(req.id)
        if output is not None and (delta or req.done):
            logprobs = list(req.logprobs) if req.done and req.params.logprobs else None
            output.publish(delta, len(req.tokens), req.finish_reason, logprobs)
        if req.done and req.slot is not None:
            self.running.pop(req.slot, None)
            self.cache.give_back(req.slot)
            req.slot = None

    def _fail_all(self) -> None:
        """Every request here ends with finish_reason "error" (its client gets an error, not a hang); slots free."""
        with self._cond:
            for req in [*self.running.values(), *self.queue, *self.inbox]:
                req.finish_reason = "error"
                self._publish(req)
            self.running, self.queue, self.inbox = {}, deque(), []
            self.cache.reset_slots()

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self._publish(req)

    # -- the travelling state (between steps: the loop paused, or frozen at its step guard)
    def export_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The non-tensor state as JSON-able data, and the KV cache as named tensors (the live tensor, not a copy)."""
        with self._step_lock, self._cond:
            entries = [
                *({"where": where, **r.to_json()} for where, r in self.aside),  # held from an earlier capture
                *({"where": "running", **r.to_json()} for _, r in sorted(self.running.items())),
                *({"where": "queued", **r.to_json()} for r in self.queue),
                *({"where": "arrived", **r.to_json()} for r in self.inbox),
            ]
            plain = {"format": FORMAT, **self._shape(), "steps": self.steps, "requests": entries}
        return plain, {"kv": self.cache.kv}

    # -- requests held for a migration (``migration.py``): the final image carries them
    def set_aside(self, ids: Collection[str]) -> int:
        """These requests stop here, keeping their slots and state, until ``put_back`` (they go on here: a
        rollback) or ``let_go`` (they went on elsewhere). Returns how many are aside."""
        keep = set(ids)
        with self._step_lock, self._cond:
            for slot, req in sorted(self.running.items()):
                if req.id in keep:
                    self.aside.append(("running", self.running.pop(slot)))
            for where, held in (("queued", self.queue), ("arrived", self.inbox)):
                for req in [r for r in held if r.id in keep]:
                    held.remove(req)
                    self.aside.append((where, req))
            return len(self.aside)

    def put_back(self) -> list[str]:
        """The requests set aside go on here where they stopped, before the ones that arrived after them."""
        with self._step_lock, self._cond:
            aside, self.aside = self.aside, []
            for where, req in aside:
                if where == "running":
                    self.running[req.seat] = req
            self.queue.extendleft(reversed([r for where, r in aside if where != "running"]))
            self._cond.notify_all()
            return [r.id for _, r in aside]

    def let_go(self) -> list[str]:
        """The requests set aside went on elsewhere: their slots are free; their outputs stay for the followers."""
        with self._step_lock, self._cond:
            aside, self.aside = self.aside, []
            for where, req in aside:
                if where == "running":
                    self.cache.give_back(req.seat)
                    req.slot = None
            return [r.id for _, r in aside]

    def _shape(self) -> dict[str, Any]:
        return {"model": self.model_id, "kv_shape": list(self.cache.kv.shape), "kv_dtype": str(self.cache.kv.dtype)}

    def import_state(self, plain: dict[str, Any], tensors: dict[str, torch.Tensor] | None) -> list[str]:
        """Continue where an exported engine stopped; returns the request ids taken. This engine must have no
        request running or queued. ``tensors=None``: the KV cache is already in place (a restore filled it)."""
        if plain.get("format") != FORMAT:
            raise EngineStateError(f"not an engine state of format {FORMAT}: {plain.get('format')!r}")
        mine, theirs = self._shape(), {k: plain.get(k) for k in ("model", "kv_shape", "kv_dtype")}
        if theirs != mine:
            raise EngineStateError(f"the state is of {theirs}, this engine is {mine}")
        kv = None if tensors is None else tensors.get("kv")
        if tensors is not None and (
            kv is None or list(kv.shape) != mine["kv_shape"] or kv.dtype != self.cache.kv.dtype
        ):
            raise EngineStateError("the state's tensors lack a KV cache of this engine's shape and dtype")
        with self._step_lock, self._cond:
            if self.running or self.queue:
                raise EngineStateError("this engine is serving requests: import into an idle engine")
            if kv is not None:
                self.cache.kv.copy_(kv)
            self.cache.reset_slots()
            arrived_here, self.inbox = self.inbox, []  # requests that reached this engine first go after the moved ones
            for entry in plain["requests"]:
                req = Request.from_json(entry)
                self.outputs[req.id] = Output(
                    req.id, len(req.prompt), text=req.text[: req.emitted], tokens=len(req.tokens)
                )
                if entry["where"] == "running":
                    self.cache.claim(req.seat)
                    self.running[req.seat] = req
                elif entry["where"] == "queued":
                    self.queue.append(req)
                else:
                    self.inbox.append(req)
            self.inbox.extend(arrived_here)
            self._cond.notify_all()
            return [e["id"] for e in plain["requests"]]
