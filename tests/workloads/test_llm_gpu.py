"""The LLM server's engine on CUDA with the ~1.09 B bf16 config (run on the lent GPU: pytest -m gpu tests/workloads).

The correctness half of the GPU bench: seeded weights, batch-invariant decode over a 64-slot cache,
and a stop/export/import mid-generation that continues every stream exactly.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import LlamaForCausalLM

from gpumigrate.workloads.llm.engine import Engine
from gpumigrate.workloads.llm.model import BOS, build_model
from gpumigrate.workloads.llm.requests import SamplingParams
from gpumigrate.workloads.llm.streams import Output

pytestmark = pytest.mark.gpu
SLOTS, CONTEXT, NEW = 64, 4608, 48


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaForCausalLM]:
    yield build_model(0, "1b", "bfloat16", "cuda")
    torch.cuda.empty_cache()


def _engine(model: LlamaForCausalLM) -> Engine:
    return Engine(model, model_id="llama-1b-bfloat16-s0", slots=SLOTS, max_context=CONTEXT, prefill_chunk=512)


def _jobs(n: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1-4k byte tokens; even requests greedy, odd ones sampled with their own seed."""
    rng = random.Random(7)
    out = []
    for i in range(n):
        prompt = [BOS, *(rng.randrange(256) for _ in range(rng.randrange(1000, 4000)))]
        out.append((prompt, SamplingParams(NEW, 0.0 if i % 2 == 0 else 0.8, 500 + i, (), True)))
    return out


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _run(model: LlamaForCausalLM, jobs: list[tuple[list[int], SamplingParams]], ids: list[int]) -> dict[int, str]:
    e = _engine(model)
    try:
        e.pause()
        outs: list[Output] = [e.submit(jobs[i][0], jobs[i][1], request_id=f"req-{i}") for i in ids]
        e.resume()
        _wait(lambda: all(o.done for o in outs), "the requests to finish")
        return {i: o.text for i, o in zip(ids, outs, strict=True)}
    finally:
        e.close()
        del e
        torch.cuda.empty_cache()


def test_the_1b_model_is_seeded_and_has_a_billion_parameters(model: LlamaForCausalLM) -> None:
    assert sum(p.numel() for p in model.parameters()) > 1_000_000_000
    assert next(model.parameters()).dtype == torch.bfloat16 and next(model.parameters()).is_cuda
    again = build_model(0, "1b", "bfloat16", "cuda")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    del again
    torch.cuda.empty_cache()


def test_decode_is_batch_invariant_on_cuda(model: LlamaForCausalLM) -> None:
    jobs = _jobs(12)
    together = _run(model, jobs, list(range(12)))
    assert _run(model, jobs, list(range(11, -1, -1))) == together  # other slots, other neighbours
    for i in (3, 8):
        assert _run(model, jobs, [i]) == {i: together[i]}


def test_export_import_continues_exactly_on_cuda(model: LlamaForCausalLM) -> None:
    jobs = _jobs(12)
    expected = _run(model, jobs, list(range(12)))
    source = _engine(model)
    # Stop after step 5: prompts over 2,560 tokens are still prefilling, shorter ones decoding.
    source.on_boundary.append(lambda e: e.pause_soon() if e.steps == 5 else None)
    source.pause()
    for i, (prompt, params) in enumerate(jobs):
        source.submit(prompt, params, request_id=f"req-{i}")
    source.resume()
    _wait(lambda: source.steps == 5 and source.parked, "the engine to stop at step 5")
    state, tensors = source.export_state()
    assert {r["where"] for r in state["requests"]} == {"running"}
    assert any(r["prefilled"] < len(r["prompt"]) for r in state["requests"]) or any(
        r["tokens"] for r in state["requests"]
    )
    kv = tensors["kv"].clone()
    source.close()
    target = _engine(model)
    try:
        ids = target.import_state(state, {"kv": kv})
        _wait(lambda: all(target.outputs[i].done for i in ids), "the imported requests to finish")
        assert {int(i.split("-")[1]): target.outputs[i].text for i in ids} == expected
    finally:
        target.close()
