"""An LLM server moved with its streams in flight: what the clients see, beside the stop-and-copy and a re-prefill.

    python bench/llm_streams.py --json [--size 1b] [--device cuda] [--dtype bfloat16] [--streams 64]
        [--prompt-min 1024] [--prompt-max 4096] [--tokens 768] [--chunk-mb 1] [--runs disk,shm] [--root DIR]
        [--target-gpu N] [--parallelism N] [--pacing adaptive|off] [--out FILE]
    python bench/llm_streams.py --smoke      # the tiny config on the CPU; exit 1 unless every check holds

Two reference LLM servers (``python -m gpumigrate.workloads.llm``), each started through the one launcher
(``LocalProvider.bootstrap``) as a migration starts a workload, the target awaiting its restore. The source serves
``--streams`` greedy requests with prompts of ``--prompt-min``..``--prompt-max`` bytes (one token per byte), first
as the **control run** (unmigrated: each request's text), then again as the **measured run**: one client per
request reads its stream (``/v1/completions``, ``stream: true``) and timestamps every event as it arrives. Once
every stream decodes, the bench waits ``--before-s`` (the steady state) and migrates the server through the real
capture/restore path, driving the two agents as the flow's agent backend does: a live pre-copy round (the KV
cache's rows shipped by the engine's written-ranges report) pre-loaded into the target, a second one, the
freeze between two decode steps, the final round (the KV delta and the engine's requests), the source's resume,
the target's restore (it imports the requests and generates on), and the hand-over (the source relays its
clients' streams from the target). The store is the one the flow gives a local target: a ``file://`` directory
on disk (``<target workdir>/store``; run ``disk``); ``shm`` is /dev/shm beside it, labelled so.

Reported, every figure beside what it includes: streams broken (an error event, no ``[DONE]``), streams whose
text differs from the control run's or whose ``usage.completion_tokens`` is not ``--tokens`` (a lost or repeated
token shows in both), the stop-and-copy downtime (freeze → target restored and ready) and its parts, the largest
inter-token gap any client saw during the migration (vs the downtime + 50 ms and vs 150 ms), the p99 inter-token
gap over the whole migration vs the p99 before it (target ≤ 1.5x), the gaps of each phase apart
(``gaps_by_phase``: each pre-copy round's capture, the target's pre-load of it, the stop-and-copy, the hand-over and
the second after it), the source engine's steps in each of those phases (``engine_by_phase``: mean step time and the
share of it the engine's thread was on a CPU: a step waiting for the GIL sleeps, one waiting for the device spins),
and the **re-prefill baseline** from the same
run: each request as a replay-based system would resume it on a fresh target (its prompt plus the tokens it had at
the freeze, as one new prompt, all replayed at once on the target once the streams ended), timed to its first
token. ``--parallelism`` and ``--pacing`` are the plan's bounds, sent with each pre-copy round as the flow sends
them; ``--target-gpu`` starts the target on another GPU of the host (by default it shares the source's). The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import string
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpumigrate import control
from gpumigrate.infra.launch import service_url
from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import Host, HostSpec
from gpumigrate.launch import AWAIT_RESTORE_ENV, WorkloadLaunch
from gpumigrate.settings import state_root
from gpumigrate.snapshot.client import AgentClient

KEY_ENV = "GM_LLM_BENCH_IMAGE_KEY"
CONFIG_KEYS = ("size", "dtype", "streams", "prompt_min", "prompt_max", "tokens", "rounds", "chunk_mb", "target_gpu",
               "parallelism", "pacing")  # fmt: skip


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, -(-99 * len(ordered) // 100) - 1)], 2)


@dataclass
class Server:
    host: Host
    url: str
    agent: AgentClient
    model: str


@dataclass
class Stream:
    """One client's stream: every event's arrival (monotonic) and the text, usage and ending."""

    prompt: str
    times: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int | None = None
    done: bool = False
    error: str | None = None


def prompts(n: int, low: int, high: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + "      .,"
    return [f"Request {i}: " + "".join(rng.choices(alphabet, k=rng.randint(low, high) - 12)) for i in range(n)]


def launch(args: argparse.Namespace, *, await_restore: bool) -> WorkloadLaunch:
    argv = ("{python}", "-m", "gpumigrate.workloads.llm", "--host", "{host}", "--port", "{service_port}")
    argv += ("--name", "{name}", "--size", args.size, "--device", args.device, "--dtype", args.dtype)
    argv += ("--slots", str(args.streams + args.spare_slots), "--max-context", str(args.prompt_max + args.tokens + 8))
    env = {"OMP_NUM_THREADS": str(args.threads)}
    if await_restore and args.target_gpu is not None:  # the target on a GPU of its own (the source keeps the first)
        env["CUDA_VISIBLE_DEVICES"] = str(args.target_gpu)
    if args.chunk_mb:
        env["GPUMIGRATE_SNAPSHOT_CHUNK_MB"] = str(args.chunk_mb)
    contract = {"GPUMIGRATE_HOME": str(state_root()), **({AWAIT_RESTORE_ENV: "1"} if await_restore else {})}
    return WorkloadLaunch(argv=argv, env=env, contract_env=contract, ready_timeout_s=args.start_timeout)


def start(provider: LocalProvider, name: str, how: WorkloadLaunch) -> Server:
    spec = HostSpec(name, "local", "local")
    host = provider.wait_ready(provider.provision(spec, migration_id="llm-bench"), timeout_s=60)
    host = provider.bootstrap(host, how, timeout_s=how.ready_timeout_s)
    agent = AgentClient(f"{host.address}:{host.ports['agent']}")
    url = service_url(host)
    model = httpx.get(url + "/v1/models", timeout=60, trust_env=False).json()["data"][0]["id"]
    return Server(host, url, agent, model)


def wait_warm(server: Server, timeout_s: float = 900.0) -> float:
    """Seconds until the agent no longer reports ``warming`` (the SDK's one-time kernel compiles)."""
    t0 = time.perf_counter()
    while server.agent.call("info").get("warming") and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.2)
    return round(time.perf_counter() - t0, 2)


def body(model: str, prompt: str, tokens: int, *, stream: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                           "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def read_stream(url: str, payload: dict[str, Any], s: Stream) -> None:
    try:
        with httpx.Client(timeout=httpx.Timeout(900.0), trust_env=False) as client:
            with client.stream("POST", url + "/v1/completions", json=payload) as r:
                if r.status_code != 200:
                    s.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        s.done = True
                        return
                    event = json.loads(line[6:])
                    if "error" in event:
                        s.error = str(event["error"].get("message"))[:300]
                        return
                    if event.get("usage"):
                        s.tokens = int(event["usage"]["completion_tokens"])
                    if event.get("choices") and event["choices"][0]["text"]:
                        s.times.append(time.monotonic())
                        s.text += event["choices"][0]["text"]
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"[:300]


def run_streams(server: Server, texts: list[str], tokens: int) -> tuple[list[Stream], list[threading.Thread]]:
    streams = [Stream(p) for p in texts]
    threads = [
        threading.Thread(target=read_stream, args=(server.url, body(server.model, s.prompt, tokens), s), daemon=True)
        for s in streams
    ]
    for t in threads:
        t.start()
    return streams, threads


def engine_sample(server: Server) -> tuple[float, int, float, float]:
    """(monotonic, steps, every step's wall seconds, their engine-thread CPU seconds) as the server's engine has them."""
    got = httpx.get(server.url + "/v1/engine", timeout=60, trust_env=False).json()
    return time.monotonic(), int(got["steps"]), float(got["step_s_total"]), float(got["step_cpu_s_total"])


def engine_between(a: tuple[float, int, float, float], b: tuple[float, int, float, float]) -> dict[str, Any]:
    """The engine's steps between two samples: how many, their mean wall time, and the share of it its thread was on
    a CPU (a GIL wait sleeps; a device wait spins, on a host with a core to spare)."""
    steps, wall, cpu = b[1] - a[1], b[2] - a[2], b[3] - a[3]
    return {"steps": steps, "step_ms": round(wall * 1000 / steps, 2) if steps else None,
            "cpu_share": round(cpu / wall, 3) if wall > 0 else None}  # fmt: skip


def gaps_between(streams: list[Stream], start: float, end: float) -> list[float]:
    """Every gap between two events of one stream whose later event arrived in [start, end], in ms."""
    return [(b - a) * 1000 for s in streams for a, b in zip(s.times, s.times[1:], strict=False) if start <= b <= end]


def migrate(args: argparse.Namespace, store_dir: Path) -> dict[str, Any]:
    shutil.rmtree(store_dir, ignore_errors=True)
    store, key_ref = f"file://{store_dir}", {"env": KEY_ENV}
    provider = LocalProvider()
    out: dict[str, Any] = {"store": store}
    source = target = None
    try:
        source = start(provider, "llm-bench-source", launch(args, await_restore=False))
        out["source_warmup_wait_s"] = wait_warm(source)
        texts = prompts(args.streams, args.prompt_min, args.prompt_max)
        log("control run ...")
        t0 = time.perf_counter()
        control_streams, threads = run_streams(source, texts, args.tokens)
        for t in threads:
            t.join()
        out["control_run_s"] = round(time.perf_counter() - t0, 2)
        expected = [s.text for s in control_streams]
        if any(s.error or not s.done for s in control_streams):
            raise RuntimeError(f"the control run failed: {[s.error for s in control_streams if s.error][:3]}")
        target = start(provider, "llm-bench-target", launch(args, await_restore=True))
        out["target_warmup_wait_s"] = wait_warm(target)
        log("measured run ...")
        streams, threads = run_streams(source, texts, args.tokens)
        deadline = time.monotonic() + args.start_timeout
        while not all(len(s.times) >= 2 or s.error or s.done for s in streams):  # every stream decodes
            if time.monotonic() > deadline:
                raise RuntimeError("the streams did not all start decoding")
            time.sleep(0.01)
        t_decoding, steady = time.monotonic(), engine_sample(source)
        time.sleep(args.before_s)
        out.update(move(args, source, target, store, key_ref))
        first, engine_phases = out.pop("_engine")
        t_begin, t_end = out.pop("_t_begin"), out.pop("_t_end")
        at_freeze = out.pop("_t_freeze")
        phases = out.pop("_phases")
        for t in threads:
            t.join()
        broken = [s.error or "no [DONE]" for s in streams if s.error or not s.done]
        differ = [i for i, s in enumerate(streams) if s.done and s.text != expected[i]]
        miscounted = [i for i, s in enumerate(streams) if s.done and s.tokens != args.tokens]
        before, during = gaps_between(streams, t_decoding, t_begin), gaps_between(streams, t_begin, t_end)
        downtime = out["downtime"]["stop_and_copy_ms"]
        max_gap = round(max(during), 1) if during else None
        out.update(
            streams=len(streams),
            broken=len(broken),
            broken_examples=broken[:3],
            texts_differ=len(differ),
            tokens_miscounted=len(miscounted),
            lost_or_duplicated=len(set(differ) | set(miscounted)),
            in_flight_at_freeze=sum(1 for s in streams if s.times and s.times[0] < at_freeze < s.times[-1]),
            max_gap_ms=max_gap,
            itl_p99_before_ms=p99(before),
            itl_p99_migration_ms=p99(during),
            itl_p99_ratio=_ratio(p99(during), p99(before)),
            gaps_by_phase={name: _gap_figures(gaps_between(streams, a, b)) for name, a, b in phases},
            engine_by_phase={"before": engine_between(steady, first)}
            | {name: engine_between(a, b) for name, a, b in engine_phases},
            gaps_include="between two token events of one stream as its client read them; 'migration': events "
            "arriving from the first pre-copy round until 1 s after the hand-over, 'before': the steady state before",
            targets={
                "max_gap_le_downtime_plus_50ms": None if max_gap is None else max_gap <= downtime + 50,
                "max_gap_le_150ms": None if max_gap is None else max_gap <= 150,
                "itl_p99_ratio_le_1_5": None,
            },
        )
        if out["itl_p99_ratio"] is not None:
            out["targets"]["itl_p99_ratio_le_1_5"] = out["itl_p99_ratio"] <= 1.5
        out["reprefill"] = reprefill(target, streams, at_freeze)
    finally:
        for server in (target, source):
            if server is not None:
                server.agent.close()
        for name in ("llm-bench-target", "llm-bench-source"):
            for host in provider.list_hosts():
                if host.name == name:
                    provider.terminate(host)
    return out


def move(
    args: argparse.Namespace, source: Server, target: Server, store: str, key_ref: dict[str, str]
) -> dict[str, Any]:
    """The migration's snapshot, restore and hand-over, through the agents, timed."""
    out: dict[str, Any] = {"_t_begin": time.monotonic()}
    rounds, phases = [], []
    first = last = engine_sample(source)  # the source's engine at each phase's ends
    engine_phases = []
    options = {k: v for k, v in (("parallelism", args.parallelism), ("pacing", args.pacing)) if v}  # the plan's bounds
    for n in range(1, args.rounds + 1):
        t0, began = time.perf_counter(), time.monotonic()
        r = source.agent.request_precopy(store, key_ref, options=options)
        captured, at_captured = time.monotonic(), engine_sample(source)
        pre = target.agent.request_restore(store, r.image.id, key_ref, ready=False)
        preloaded = engine_sample(source)
        engine_phases += [(f"capture_{n}", last, at_captured), (f"preload_{n}", at_captured, preloaded)]
        last = preloaded
        phases += [(f"capture_{n}", began, captured), (f"preload_{n}", captured, time.monotonic())]
        rounds.append({"bytes_dirty": r.stats.bytes_dirty, "chunks_dirty": r.stats.chunks_dirty,
                       "seconds": round(r.stats.seconds, 3), "preload_s": round(pre.seconds, 3),
                       "wall_s": round(time.perf_counter() - t0, 3), "pacing": r.stats.pacing})  # fmt: skip
    out["precopy"] = rounds
    out["_engine"] = (first, engine_phases)
    t_freeze = time.monotonic()
    out["_t_freeze"] = t_freeze
    source.agent.request_freeze(lease_s=120)
    t_frozen = time.monotonic()
    final = source.agent.request_final(store, key_ref)
    t_final = time.monotonic()
    source.agent.request_resume()
    t_resumed = time.monotonic()
    done = target.agent.request_restore(store, final.image.id, key_ref)
    t_ready = time.monotonic()
    handed = source.agent.request_hand_over(target.url)
    t_handed = time.monotonic()
    out["_t_end"] = t_handed + 1.0
    out["_phases"] = [
        *phases,
        ("stop_and_copy", t_freeze, t_ready),
        ("hand_over_and_1s_after", t_ready, t_handed + 1.0),
    ]
    ms = lambda a, b: round((b - a) * 1000, 1)  # noqa: E731
    out["downtime"] = {
        "stop_and_copy_ms": ms(t_freeze, t_ready),
        "freeze_ms": ms(t_freeze, t_frozen),
        "final_ms": ms(t_frozen, t_final),
        "resume_ms": ms(t_final, t_resumed),
        "restore_ms": ms(t_resumed, t_ready),
        "hand_over_ms": ms(t_ready, t_handed),
        "final_bytes_dirty": final.stats.bytes_dirty,
        "final_chunks_dirty": final.stats.chunks_dirty,
        "final_agent_phases": dict(final.stats.phases),
        "restore_bytes_loaded": done.bytes_loaded,
        "restore_chunks_loaded": done.chunks_loaded,
        "includes": "stop_and_copy: freeze (the decode step in flight ends) → final round (the KV chunks the rows "
        "written since the last round touch, the engine's requests as JSON; commit) → the source resumes (its "
        "requests wait aside) → the target loads what the final image changed and imports the requests → ready; "
        "hand_over: the source is told, its clients' relays open after it",
    }
    out["handed_over"] = (handed.get("figures") or {}).get("moved")
    return out


def _gap_figures(gaps: list[float]) -> dict[str, Any]:
    """A phase's inter-token gaps (those whose later event arrived in it): how many, their largest and p99, in ms."""
    return {"gaps": len(gaps), "max_ms": round(max(gaps), 1) if gaps else None, "p99_ms": p99(gaps)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / max(b, 1e-3), 3)


def reprefill(target: Server, streams: list[Stream], at_freeze: float) -> dict[str, Any]:
    """Every stream replayed on the target as a replay-based system resumes it: one prompt of the original prompt
    plus the tokens it had at the freeze (the same length in bytes: one token each), all at once, timed to the
    first token."""
    replays = [s.prompt + "x" * sum(1 for t in s.times if t < at_freeze) for s in streams]
    firsts: list[float] = []
    lock = threading.Lock()

    def one(prompt: str) -> None:
        s = Stream(prompt)
        t0 = time.monotonic()
        read_stream(target.url, body(target.model, prompt, 1), s)
        if s.times:
            with lock:
                firsts.append((s.times[0] - t0) * 1000)

    threads = [threading.Thread(target=one, args=(p,)) for p in replays]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ordered = sorted(firsts)
    return {
        "replayed": len(replays),
        "answered": len(firsts),
        "first_token_p50_ms": round(ordered[len(ordered) // 2], 1) if ordered else None,
        "first_token_max_ms": round(ordered[-1], 1) if ordered else None,
        "includes": "the gap a replayed client would see at the least: the target prefills every request's prompt "
        "and tokens so far (all replayed at once, as after a failover), to its first new token; not the detection "
        "and resubmission before it",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="(always on) the result as JSON on the last line")
    p.add_argument("--size", default="1b")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where available)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--spare-slots", type=int, default=4, help="slots beyond the streams (new requests at the freeze)")
    p.add_argument("--prompt-min", type=int, default=1024)
    p.add_argument("--prompt-max", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=768, help="tokens per stream (long enough to outlast the move)")
    p.add_argument("--rounds", type=int, default=2, help="live pre-copy rounds before the freeze")
    p.add_argument("--before-s", type=float, default=3.0, help="steady decoding measured before the migration")
    p.add_argument("--chunk-mb", type=int, default=1, help="GPUMIGRATE_SNAPSHOT_CHUNK_MB of both servers (0: default)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per server (CPU)")
    p.add_argument("--target-gpu", type=int, default=None, help="the target's GPU (default: the one the source uses)")
    p.add_argument("--parallelism", type=int, default=None, help="the pre-copy rounds' host threads (plan's bound)")
    p.add_argument("--pacing", choices=("adaptive", "off"), default=None, help="the pre-copy rounds' pacing (plan's)")
    p.add_argument("--runs", default="disk", help="stores, comma-separated: disk (the flow's), shm (/dev/shm)")
    p.add_argument("--root", default=None, help="where the disk store and the hosts live (default: a temp dir)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--smoke", action="store_true", help="the tiny config on the CPU; exit 1 unless every check holds")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    if args.smoke:
        args.size, args.device, args.dtype, args.streams = "tiny", "cpu", "float32", 6
        args.prompt_min, args.prompt_max, args.tokens, args.before_s, args.chunk_mb = 40, 160, 500, 0.5, 0
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from gpumigrate.transfer import generate_key

    os.environ[KEY_ENV] = generate_key()  # the hosts inherit it; the agents resolve it by name
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="gm-llm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GPUMIGRATE_HOME", str(root / "home"))
    control.load_key(None, create=True)
    gpu = args.device.startswith("cuda")
    out: dict[str, Any] = {
        "bench": "llm_streams",
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "torch": torch.__version__,
        "config": {k: getattr(args, k) for k in CONFIG_KEYS},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "runs": {},
    }
    try:
        for where in args.runs.split(","):
            base = Path("/dev/shm") / f"gm-llm-bench-{os.getpid()}" if where == "shm" else root / "disk"
            label = "shm: /dev/shm (beside the flow's store)" if where == "shm" else "disk: the flow's store kind"
            log(f"run {where} ...")
            try:
                out["runs"][where] = {"store_kind": label, **migrate(args, base / "store")}
            except Exception as exc:
                out["runs"][where] = {"store_kind": label, "error": f"{type(exc).__name__}: {exc}"}
            finally:
                shutil.rmtree(base, ignore_errors=True)
            if args.out:
                Path(args.out).write_text(json.dumps(out) + "\n")
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    ok = all(
        "error" not in r and r["broken"] == 0 and r["lost_or_duplicated"] == 0 and (r["handed_over"] or 0) >= 1
        and r["reprefill"]["answered"] == r["streams"]
        for r in out["runs"].values()
    )  # fmt: skip
    return 0 if ok or not args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
