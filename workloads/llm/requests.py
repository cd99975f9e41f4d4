"""One generation request: what it asked for, how far it got, and its state as JSON.

Everything here is plain data plus the request's sampler (a seeded ``torch.Generator``) and its
incremental UTF-8 decoder, both exported by value: a request leaves one engine at a step boundary as
``to_json()`` and continues in another from ``from_json()`` with the same next token, the same
random draws and the same text (see DESIGN.md, "The travelling state").

Text: tokens are bytes, so a character may span tokens; ``text`` is what the decoder has produced so
far. ``emitted`` counts the characters already published to the client: text that could still turn
out to be the start of a ``stop`` sequence is held back until it cannot (OpenAI's semantics: the
stop sequence itself is never returned).
"""

from __future__ import annotations

import base64
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from .model import EOS, new_decoder

_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None  # the request's sampler seed (the server draws one when absent and temperature > 0)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_tokens even past an end-of-sequence token (vLLM's extension)
    logprobs: bool = False  # keep each generated token's log-probability

    def to_json(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(
            d["max_tokens"],
            float(d["temperature"]),
            d["seed"],
            tuple(d["stop"]),
            bool(d["ignore_eos"]),
            bool(d.get("logprobs", False)),
        )


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    seq: int = field(default_factory=lambda: next(_ids))  # arrival order within this engine
    slot: int | None = None
    prefilled: int = 0  # prompt positions already in the cache
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[float] = field(default_factory=list)  # of each generated token, where the request asked
    text: str = ""
    emitted: int = 0  # characters of ``text`` published to the client
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    cancelled: bool = False
    generator: torch.Generator | None = None
    decoder: Any = field(default_factory=new_decoder)

    def __post_init__(self) -> None:
        if self.generator is None and self.params.temperature > 0:
            self.generator = torch.Generator().manual_seed(self.params.seed or 0)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def seat(self) -> int:
        """The slot of a request that holds one."""
        if self.slot is None:
            raise ValueError(f"request {self.id} holds no slot")
        return self.slot

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.prompt)

    @property
    def position(self) -> int:
        """Where the next decode step feeds this request's last token."""
        return len(self.prompt) + len(self.tokens) - 1

    def accept(self, token: int, logprob: float | None = None) -> None:
        """Append a sampled token; update the text and decide whether the request is finished."""
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        before = len(self.text)
        if token == EOS and not self.params.ignore_eos:
            self.finish_reason = "stop"
        elif token < 256:
            self.text += self.decoder.decode(bytes([token]))
        if self.finish_reason is None and self.params.stop:
            longest = max(map(len, self.params.stop))
            start = max(0, before - longest + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and self.finish_reason != "stop":
            self.text += self.decoder.decode(b"", final=True)  # bytes of a character cut off by the limit

    def publishable(self) -> str:
        """Text not yet published that may be now: all of it once finished, else all but a possible stop prefix."""
        end = len(self.text)
        if not self.done:
            for s in self.params.stop:
                for n in range(min(len(s) - 1, end), 0, -1):
                    if self.text.endswith(s[:n]):
                        end = min(end, len(self.text) - n)
                        break
        return self.text[self.emitted : max(end, self.emitted)]

    # -- the travelling state
    def to_json(self) -> dict[str, Any]:
        pending, flag = self.decoder.getstate()
        sampler = None
        if self.generator is not None:
            sampler = base64.b64encode(self.generator.get_state().numpy().tobytes()).decode()
        return {
            "id": self.id,
            "prompt": self.prompt,
            "params": self.params.to_json(),
            "slot": self.slot,
            "prefilled": self.prefilled,
            "tokens": self.tokens,
            "logprobs": self.logprobs if self.params.logprobs else None,
            "text": self.text,
            "emitted": self.emitted,
            "finish_reason": self.finish_reason,
            "cancelled": self.cancelled,
            "sampler": sampler,
            "decoder": {"pending": pending.hex(), "flag": flag},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Request:
        req = cls(d["id"], list(d["prompt"]), SamplingParams.from_json(d["params"]))
        req.slot, req.prefilled, req.tokens = d["slot"], d["prefilled"], list(d["tokens"])
        req.logprobs = [float(x) for x in d.get("logprobs") or ()]
        req.text, req.emitted, req.finish_reason, req.cancelled = (
            d["text"],
            d["emitted"],
            d["finish_reason"],
            d["cancelled"],
        )
        if d["sampler"] is not None:
            raw = bytearray(base64.b64decode(d["sampler"]))
            gen = torch.Generator()
            gen.set_state(torch.frombuffer(raw, dtype=torch.uint8))
            req.generator = gen
        req.decoder.setstate((bytes.fromhex(d["decoder"]["pending"]), d["decoder"]["flag"]))
        return req
