"""The LLM engine in-process: the model, batch invariance, the KV cache's written regions, export/import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from llm_support import (
    SLOTS,
    Job,
    control_run,
    engine,
    jobs,
    pause_at_step,
    save_state,
    straddling_plan,
    submit_all,
    wait_for,
)

from gpumigrate.workloads.llm.engine import Engine, EngineStateError
from gpumigrate.workloads.llm.model import build_model, encode
from gpumigrate.workloads.llm.requests import Request, SamplingParams

HERE = Path(__file__).parent
CUT = 12  # the step at which the engine is stopped mid-generation


def test_seeded_weights_and_the_engines_forward_agree_with_transformers() -> None:
    a, b = build_model(0, "tiny"), build_model(0, "tiny")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.lm_head.weight, build_model(1, "tiny").lm_head.weight)
    prompt = encode("The engine's own attention, the model's weights.")
    with torch.no_grad():
        expected = a.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    e = engine(a, prefill_chunk=16)  # a prompt of 51 tokens in four chunks
    try:
        out = e.submit(prompt, SamplingParams(24, ignore_eos=True))
        wait_for(lambda: out.done, "a greedy generation")
    finally:
        e.close()
    assert out.text == bytes(t for t in expected if t < 256).decode("utf-8", errors="replace")


def test_a_requests_tokens_do_not_depend_on_the_requests_beside_it() -> None:
    js = jobs(6, tokens=60)
    together = [o.text for o in control_run(js)]
    alone = [control_run([j])[0].text for j in (js[1], js[4])]
    reversed_order = [o.text for o in control_run(js[::-1])][::-1]  # other slots, other neighbours
    assert alone == [together[1], together[4]]
    assert reversed_order == together


def test_the_written_ranges_taken_are_exactly_what_changed() -> None:
    e = engine()
    try:
        outs = submit_all(e, jobs(5, tokens=40))
        wait_for(lambda: e.steps >= 8, "a few steps")
        e.pause()
        e.cache.take_written()
        before = e.cache.kv.clone()
        e.resume()
        wait_for(lambda: e.steps >= 20, "more steps")
        e.pause()
        spans = e.cache.take_written()
        assert e.cache.take_written() == []  # a take starts a new record
        after = e.cache.kv.clone()
        e.resume()
        wait_for(lambda: all(o.done for o in outs), "the requests to finish")
    finally:
        e.close()
    assert 0 < len(spans) <= 5
    # Shipping only those byte ranges onto the earlier copy reproduces the cache bit for bit.
    old, new = before.view(-1).view(torch.uint8), after.view(-1).view(torch.uint8)
    for offset, length in spans:
        old[offset : offset + length] = new[offset : offset + length]
    assert torch.equal(old, new)
    assert sum(n for _, n in spans) < new.numel() // 10  # a small part of the cache


def _stopped_mid_generation(js: list[Job]) -> tuple[Engine, dict, dict[str, torch.Tensor], dict[str, str]]:
    e = engine()
    e.on_boundary.append(pause_at_step(CUT))
    submit_all(e, js[:10])
    wait_for(lambda: e.steps == CUT and e.parked, f"the engine to stop at step {CUT}")
    assert e.pause() == CUT
    for i, j in enumerate(js[10:], start=10):  # arrive while stopped: they travel in the inbox
        e.submit(encode(j.prompt), j.params, request_id=f"req-{i}")
    state, tensors = e.export_state()
    published = {rid: o.text for rid, o in e.outputs.items()}
    return e, state, tensors, published


def test_export_import_continues_every_stream_exactly() -> None:
    js, stops = straddling_plan(CUT)
    expected = {o.id: (o.text, o.tokens, o.finish_reason) for o in control_run(js)}
    source, state, tensors, published = _stopped_mid_generation(js)
    where = [r["where"] for r in state["requests"]]
    assert where.count("running") == SLOTS and where.count("queued") == 2 and where.count("arrived") == 2
    json.dumps(state)  # JSON-able as it is
    running = {r["id"]: r for r in state["requests"] if r["where"] == "running"}
    for rid, stop in stops.items():  # the start of its stop sequence is generated, held back, not yet matched
        r = running[rid]
        assert (
            r["finish_reason"] is None and r["emitted"] < len(r["text"]) and stop.startswith(r["text"][r["emitted"] :])
        )
    kv = tensors["kv"].clone()
    source.close()

    target = engine(build_model(0, "tiny"))  # a fresh engine and model
    try:
        ids = target.import_state(state, {"kv": kv})
        wait_for(lambda: all(target.outputs[i].done for i in ids), "the imported requests to finish")
        got = {i: (target.outputs[i].text, target.outputs[i].tokens, target.outputs[i].finish_reason) for i in ids}
    finally:
        target.close()
    assert got == expected
    for rid, text in published.items():  # the target's text goes on from what the source published
        assert got[rid][0].startswith(text)
    for rid, stop in stops.items():
        assert got[rid][2] == "stop" and stop not in got[rid][0]


def test_import_in_another_process(tmp_path: Path) -> None:
    js = jobs(12, tokens=80)
    expected = {o.id: o.text for o in control_run(js)}
    source, state, tensors, _ = _stopped_mid_generation(js)
    save_state(tmp_path / "state.json", state, tensors)
    source.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "llm_continue.py"), str(tmp_path / "state.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {rid: d["text"] for rid, d in json.loads(proc.stdout).items()}
    assert got == expected


def test_import_refuses_another_shape_and_a_busy_engine() -> None:
    e = engine()
    try:
        state, tensors = e.export_state()
        other = Engine(build_model(0, "tiny"), model_id="llama-tiny-float32-s0", slots=4, max_context=512)
        try:
            try:
                other.import_state(state, tensors)
            except EngineStateError as exc:
                assert "kv_shape" in str(exc)
            else:
                raise AssertionError("a state of 8 slots went into an engine of 4")
        finally:
            other.close()
        out = e.submit(encode("busy"), SamplingParams(40))
        wait_for(lambda: out.tokens > 0, "a request to be running")
        e.pause()  # it stays in its slot
        try:
            e.import_state(state, tensors)
        except EngineStateError as exc:
            assert "idle" in str(exc)
        else:
            raise AssertionError("an import went into an engine with requests")
    finally:
        e.close()


def test_cancel_frees_the_slot_at_the_next_step() -> None:
    e = engine()
    try:
        outs = submit_all(e, jobs(SLOTS + 1, tokens=400))
        wait_for(lambda: outs[0].tokens > 3, "the first tokens")
        e.cancel(outs[0].id)
        wait_for(lambda: outs[SLOTS].tokens > 0, "the queued request to take the freed slot")
        assert outs[0].finish_reason == "cancelled"
        for o in outs:
            e.cancel(o.id)
        wait_for(lambda: e.cache.free_slots == SLOTS and not e.running, "every slot free")
    finally:
        e.close()


def test_the_engine_sums_its_steps_wall_and_cpu_time() -> None:
    """``stats`` says how long the steps took and how much of it the engine's thread ran (a GIL wait sleeps)."""
    e = engine()
    try:
        outs = submit_all(e, jobs(2, tokens=20))
        wait_for(lambda: all(o.done for o in outs), "both requests to finish")
        stats = e.stats()
        assert stats["steps"] >= 20 and stats["step_s_total"] > 0 and stats["step_cpu_s_total"] > 0
        assert stats["step_cpu_s_total"] <= stats["step_s_total"] * 1.05 + 0.01  # one thread: CPU within its wall
    finally:
        e.close()


def test_the_warm_up_leaves_the_cache_and_the_generations_as_they_were() -> None:
    """The server's warm-up (a prompt chunk and a decode step before it takes requests, so a restored target's first
    step is not a cold one) writes a free slot and then zeroes it: the cache, its record of written rows and every
    request's tokens are those of an engine that never warmed up."""
    js = jobs(3, tokens=30)
    expected = [o.text for o in control_run(js)]
    e = engine()
    try:
        before = e.cache.kv.clone()
        assert e.warm_up() > 0 and e.stats()["warm_up_ms"] is not None
        assert torch.equal(e.cache.kv, before) and e.cache.take_written() == [] and e.cache.free_slots == SLOTS
        outs = submit_all(e, js)
        wait_for(lambda: all(o.done for o in outs), "the warmed engine's requests")
        assert [o.text for o in outs] == expected
    finally:
        e.close()


def test_text_holds_back_a_possible_stop_and_joins_split_characters() -> None:
    req = Request("r", encode("x"), SamplingParams(10, stop=("é!",)))
    for token in "aé".encode():  # é is two bytes: two tokens, one character
        req.accept(token)
    assert req.text == "aé" and req.publishable() == "a"  # "é" may begin the stop sequence
    req.emitted = 1
    req.accept(ord("!"))
    assert req.finish_reason == "stop" and req.text == "a" and req.publishable() == ""
    restored = Request.from_json(json.loads(json.dumps(Request("s", [1], SamplingParams(5, 0.7, 3)).to_json())))
    assert restored.generator is not None and torch.equal(
        restored.generator.get_state(), torch.Generator().manual_seed(3).get_state()
    )


def test_a_failed_step_ends_its_requests_with_an_error_and_the_engine_goes_on() -> None:
    e = engine()
    decode = e.forward.decode

    def device_error(*args: object) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    try:
        e.forward.decode = device_error  # type: ignore[method-assign]
        failed = submit_all(e, jobs(3, tokens=10))
        wait_for(lambda: all(o.done for o in failed), "the failed requests to end")
        assert {o.finish_reason for o in failed} == {"error"} and e.cache.free_slots == SLOTS
        e.forward.decode = decode  # type: ignore[method-assign]
        for o in failed:
            e.release(o.id)
        (after,) = submit_all(e, jobs(1, tokens=10))
        wait_for(lambda: after.done, "a request after the failure")
        assert after.finish_reason == "length" and after.tokens == 10
    finally:
        e.close()
