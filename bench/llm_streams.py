"""An LLM server moved with its streams in flight: what the clients see, beside the stop-and-copy and a re-prefill.

    python bench/llm_streams.py --json [--size 1b] [--device cuda] [--dtype bfloat16] [--streams 64]
        [--prompt-min 1024] [--prompt-max 4096] [--tokens 4096] [--chunk-mb N] [--runs disk,shm] [--root DIR]
        [--target-gpu N] [--parallelism N] [--pacing adaptive|off] [--rounds 3] [--max-downtime-ms 500]
        [--margin-s 3] [--refills 2] [--profile DIR] [--out FILE]
    python bench/llm_streams.py --smoke      # the tiny config on the CPU; exit 1 unless every check holds

Two reference LLM servers (``python -m gpumigrate.workloads.llm``), each started through the one launcher
(``LocalProvider.bootstrap``) as a migration starts a workload, the target awaiting its restore. The source serves
``--streams`` greedy requests with prompts of ``--prompt-min``..``--prompt-max`` bytes (one token per byte), first
as the **control run** (unmigrated: each request's text), then again as the **measured run**: one client per request
reads its stream (``/v1/completions``, ``stream: true``) and timestamps every event as it arrives. Once every stream
decodes, the bench waits ``--before-s`` (the steady state) and migrates the server through the real capture/restore
path, driving the two agents as the flow's agent backend does: live pre-copy rounds (the KV cache's rows shipped by
the engine's written-ranges report), each pre-loaded into the target, until the flow's own rule stops them
(``snapshot/precopy.py``: the dirty set fits ``--max-downtime-ms``, stopped shrinking, or ``--rounds`` ran; both the
plan's defaults), the freeze between two decode steps, the final round (the KV delta and the engine's requests), the
source's resume, the target's restore (it imports the requests and generates on), and the hand-over (the source
relays its clients' streams from the target). The store is the one the flow gives a local target: a ``file://``
directory on disk (``<target workdir>/store``; run ``disk``); ``shm`` is /dev/shm beside it, labelled so.

What a user's migration does: each pre-copy round carries the plan's defaults for ``transfer`` (``parallelism``,
``pacing``, ``compression``, read from ``gpumigrate.plan.Transfer``) unless ``--parallelism`` (0: one thread per
core) or ``--pacing`` say otherwise, and the chunk size is the SDK's own choice for a server that reports its KV
writes (``--chunk-mb`` sets another). The freeze must land mid-generation: when the streams would end within
``--margin-s`` of decoding (a paced round can outlast them), the bench waits for them to end, starts the same
prompts again (a new wave; their control texts are known) and runs the rule's rounds again (the first ships the
wave's prefill), at most ``--refills`` times; the gaps of a refill are not the migration's and are left out of its
figures. A run with no stream in flight at the freeze says so (``freeze_tested``: false) and fails ``--smoke``.

Reported, every figure beside what it includes: streams broken (an error event, no ``[DONE]``), streams whose text
differs from the control run's or whose ``usage.completion_tokens`` is not ``--tokens`` (a lost or repeated token
shows in both), the stop-and-copy downtime (freeze → target restored and ready) and its parts, the largest
inter-token gap any client saw during the migration (vs the downtime + 50 ms and vs 150 ms), the p99 inter-token gap
over the whole migration vs the p99 before it (target ≤ 1.5x), the gaps of each phase apart (``gaps_by_phase``: each
pre-copy round's capture, the target's pre-load of it, any refill, the stop-and-copy, the hand-over and the second
after it), what a moved stream saw across the move (``hand_over``: its gap, and its first event after the
hand-over), the source engine's steps in each of those phases and the target's from the hand-over to a second after
it (``engine_by_phase``: mean step time and the share of it the engine's thread was on a CPU: a step waiting for the
GIL sleeps, one waiting for the device spins), and the **re-prefill baseline** from the same run: each request as a
replay-based system would resume it on a fresh target (its prompt plus the tokens it had at the freeze, as one new
prompt, all replayed at once on the target once the streams ended), timed to its first token. ``--profile DIR``
records which of the source's threads hold the GIL during each capture (py-spy ``record --gil``, raw stacks per
thread, ``DIR/capture_N.txt``; py-spy is a diagnosis tool: install it by hand). ``--target-gpu`` starts the target
on another GPU of the host (by default it shares the source's). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from llm_clients import (
    Clients,
    EngineSample,
    GilProfile,
    Window,
    engine_between,
    engine_sample,
    engine_stats,
    failures,
    gap_figures,
    gaps_between,
    hand_over_figures,
    log,
    p99,
    prompts,
    ratio,
    reprefill,
    run_streams,
)

from gpumigrate import control
from gpumigrate.bounds import TransferBounds
from gpumigrate.infra.launch import service_url
from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import Host, HostSpec, Round
from gpumigrate.launch import AWAIT_RESTORE_ENV, WorkloadLaunch
from gpumigrate.plan import Snapshot, Transfer
from gpumigrate.settings import state_root
from gpumigrate.snapshot.client import AgentClient
from gpumigrate.snapshot.precopy import converge

KEY_ENV = "GM_LLM_BENCH_IMAGE_KEY"
CONFIG_KEYS = ("size", "dtype", "streams", "prompt_min", "prompt_max", "tokens", "rounds", "max_downtime_ms",
               "chunk_mb", "target_gpu", "parallelism", "pacing", "compression", "margin_s", "refills")  # fmt: skip
# What a migration's flow sends with each pre-copy round when the plan leaves transfer's bounds unset: the plan's own
# defaults, read from its model (flows/context.py sends compression and the bounds' options).
PLAN_DEFAULTS = {k: Transfer.model_fields[k].default for k in ("parallelism", "pacing", "compression")}


@dataclass
class Server:
    host: Host
    url: str
    agent: AgentClient
    model: str


def launch(args: argparse.Namespace, *, await_restore: bool) -> WorkloadLaunch:
    argv = ("{python}", "-m", "gpumigrate.workloads.llm", "--host", "{host}", "--port", "{service_port}")
    argv += ("--name", "{name}", "--size", args.size, "--device", args.device, "--dtype", args.dtype)
    argv += ("--slots", str(args.streams + args.spare_slots), "--max-context", str(args.prompt_max + args.tokens + 8))
    env = {"OMP_NUM_THREADS": str(args.threads)}
    if await_restore and args.target_gpu is not None:  # the target on a GPU of its own (the source keeps the first)
        env["CUDA_VISIBLE_DEVICES"] = str(args.target_gpu)
    if args.chunk_mb:  # else the SDK's own choice, as a user's migration gets (agent/warmup.py: chunk_size)
        env["GPUMIGRATE_SNAPSHOT_CHUNK_MB"] = str(args.chunk_mb)
    contract = {"GPUMIGRATE_HOME": str(state_root()), **({AWAIT_RESTORE_ENV: "1"} if await_restore else {})}
    return WorkloadLaunch(argv=argv, env=env, contract_env=contract, ready_timeout_s=args.start_timeout)


def start(provider: LocalProvider, name: str, how: WorkloadLaunch) -> Server:
    spec = HostSpec(name, "local", "local")
    host = provider.wait_ready(provider.provision(spec, migration_id="llm-bench"), timeout_s=60)
    host = provider.bootstrap(host, how, timeout_s=how.ready_timeout_s)
    agent = AgentClient(f"{host.address}:{host.ports['agent']}")
    url = service_url(host)
    model = httpx.get(url + "/v1/models", timeout=60, trust_env=False, verify=False).json()["data"][0]["id"]
    return Server(host, url, agent, model)


def wait_warm(server: Server, timeout_s: float = 900.0) -> float:
    """Seconds until the agent no longer reports ``warming`` (the SDK's one-time kernel compiles)."""
    t0 = time.perf_counter()
    while server.agent.call("info").get("warming") and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.2)
    return round(time.perf_counter() - t0, 2)


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
        control_streams, threads = run_streams(source.url, source.model, texts, args.tokens)
        for t in threads:
            t.join()
        out["control_run_s"] = round(time.perf_counter() - t0, 2)
        expected = [s.text for s in control_streams]
        if any(s.error or not s.done for s in control_streams):
            raise RuntimeError(f"the control run failed: {[s.error for s in control_streams if s.error][:3]}")
        target = start(provider, "llm-bench-target", launch(args, await_restore=True))
        out["target_warmup_wait_s"] = wait_warm(target)
        out["engine_warm_up_ms"] = {"source": engine_stats(source.url).get("warm_up_ms"),
                                    "target": engine_stats(target.url).get("warm_up_ms")}  # fmt: skip
        log("measured run ...")
        clients = Clients(source.url, source.model, texts, args)
        t_decoding = clients.start_wave()
        steady = engine_sample(source.url)
        time.sleep(args.before_s)
        out.update(move(args, source, target, store, key_ref, clients))
        first, engine_phases = out.pop("_engine")
        t_begin, t_end, at_freeze = out.pop("_t_begin"), out.pop("_t_end"), out.pop("_t_freeze")
        phases, refills = out.pop("_phases"), out.pop("_refills")
        clients.join()
        streams = clients.streams
        broken = [s.error or "no [DONE]" for s in streams if s.error or not s.done]
        differ = [i for i, s in enumerate(streams) if s.done and s.text != expected[s.index]]
        miscounted = [i for i, s in enumerate(streams) if s.done and s.tokens != args.tokens]
        before = gaps_between([s for s in streams if s.wave == 1], t_decoding, t_begin)
        during = gaps_between(streams, t_begin, t_end, skip=refills)
        downtime = out["downtime"]["stop_and_copy_ms"]
        max_gap = round(max(during), 1) if during else None
        in_flight = [s for s in streams if s.spans(at_freeze)]
        out.update(
            streams=len(streams),
            waves=clients.wave,
            broken=len(broken),
            broken_examples=broken[:3],
            texts_differ=len(differ),
            tokens_miscounted=len(miscounted),
            lost_or_duplicated=len(set(differ) | set(miscounted)),
            in_flight_at_freeze=len(in_flight),
            freeze_tested=bool(in_flight) and (out["handed_over"] or 0) >= 1,
            max_gap_ms=max_gap,
            itl_p99_before_ms=p99(before),
            itl_p99_migration_ms=p99(during),
            itl_p99_ratio=ratio(p99(during), p99(before)),
            gaps_by_phase={name: gap_figures(gaps_between(streams, a, b)) for name, a, b in phases},
            hand_over=hand_over_figures(streams, at_freeze, out.pop("_t_ready"), t_end),
            engine_by_phase={"before": engine_between(steady, first)}
            | {name: engine_between(a, b) for name, a, b in engine_phases},
            gaps_include="between two token events of one stream as its client read them; 'migration': events "
            "arriving from the first pre-copy round until 1 s after the hand-over, but none in a refill (the bench "
            "waiting for one wave of streams to end and starting the next, so that the freeze lands mid-generation); "
            "'before': the first wave's steady state before the migration",
            targets={
                "streams_in_flight_at_freeze": bool(in_flight),
                "max_gap_le_downtime_plus_50ms": None if max_gap is None else max_gap <= downtime + 50,
                "max_gap_le_150ms": None if max_gap is None else max_gap <= 150,
                "itl_p99_ratio_le_1_5": None,
            },
        )
        if out["itl_p99_ratio"] is not None:
            out["targets"]["itl_p99_ratio_le_1_5"] = out["itl_p99_ratio"] <= 1.5
        replayed = in_flight or [s for s in streams if s.wave == clients.wave]
        out["reprefill"] = reprefill(target.url, target.model, replayed, at_freeze)
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
    args: argparse.Namespace, source: Server, target: Server, store: str, key_ref: dict[str, str], clients: Clients
) -> dict[str, Any]:
    """The migration's snapshot, restore and hand-over, through the agents, timed. Before the freeze, streams that
    would end before the hand-over and the second after it (``--margin-s``) are refilled (up to ``--refills``
    times), each refill followed by the rule's rounds again: the first ships the new wave's prefill."""
    out: dict[str, Any] = {"_t_begin": time.monotonic()}
    rounds: list[dict[str, Any]] = []
    phases: list[tuple[str, float, float]] = []
    engine_phases: list[tuple[str, EngineSample, EngineSample]] = []
    refills: list[Window] = []
    first = last = engine_sample(source.url)  # the source's engine at each phase's ends
    options = {"compression": args.compression, **TransferBounds(args.parallelism or None, None, args.pacing).options()}

    def live_round(n: int) -> Round:
        nonlocal last
        spy = GilProfile(source.host.meta["workload"]["pid"], f"{args.profile}/capture_{n}.txt")
        profiled = bool(args.profile) and spy.start()
        t0, began = time.perf_counter(), time.monotonic()
        r = source.agent.request_precopy(store, key_ref, options=options)
        captured = time.monotonic()
        if profiled and spy is not None:
            spy.stop()
        at_captured = engine_sample(source.url)
        pre = target.agent.request_restore(store, r.image.id, key_ref, ready=False)
        preloaded = engine_sample(source.url)
        engine_phases.extend([(f"capture_{n}", last, at_captured), (f"preload_{n}", at_captured, preloaded)])
        phases.extend([(f"capture_{n}", began, captured), (f"preload_{n}", captured, time.monotonic())])
        last = preloaded
        rounds.append({"bytes_dirty": r.stats.bytes_dirty, "chunks_dirty": r.stats.chunks_dirty,
                       "seconds": round(r.stats.seconds, 3), "preload_s": round(pre.seconds, 3),
                       "wall_s": round(time.perf_counter() - t0, 3), "pacing": r.stats.pacing,
                       "wave": clients.wave})  # fmt: skip
        return r

    def step_s() -> float:  # the slower of the steady state's steps and the last phase's
        times = [x["step_ms"] for x in (engine_between(first, last), engine_between(*engine_phases[-1][1:]))]
        return max([t for t in times if t] or [50.0]) / 1000

    def wave_rounds(wave: int) -> None:  # the flow's own rule (snapshot/precopy.py), as its snapshot phase runs it
        conv = converge(lambda: live_round(len(rounds) + 1), max_rounds=args.rounds,
                        max_downtime_ms=args.max_downtime_ms)  # fmt: skip
        stops.append({"wave": wave, "rounds": len(conv.rounds), "reason": conv.reason,
                      "predicted_downtime_ms": conv.predicted_downtime_ms})  # fmt: skip

    stops: list[dict[str, Any]] = []
    wave_rounds(1)
    while clients.decoding_left_s(step_s()) < args.margin_s and len(refills) < args.refills:
        log(f"the streams would end before the hand-over: refill {len(refills) + 1} ...")
        a, before_refill = time.monotonic(), engine_sample(source.url)
        clients.refill()
        refills.append((a, time.monotonic()))
        phases.append((f"refill_{len(refills)}", *refills[-1]))
        last = engine_sample(source.url)
        engine_phases.append((f"refill_{len(refills)}", before_refill, last))
        wave_rounds(len(refills) + 1)
    out["precopy"] = rounds
    out["precopy_stops"] = stops
    out["_engine"] = (first, engine_phases)
    out["_refills"] = refills
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
    handed = source.agent.request_hand_over(target.url)  # at once, as the flow's restore phase does
    t_handed = time.monotonic()
    at_handed = engine_sample(target.url)  # after the hand-over: no bench call between ready and it
    time.sleep(max(0.0, t_handed + 1.0 - time.monotonic()))
    engine_phases.append(("target_hand_over_to_1s_after", at_handed, engine_sample(target.url)))
    out["_t_end"], out["_t_ready"] = t_handed + 1.0, t_ready
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
    p.add_argument("--tokens", type=int, default=4096, help="tokens per stream (outlasting the paced rounds)")
    p.add_argument("--rounds", type=int, default=Snapshot().precopy_rounds,
                   help="the most live pre-copy rounds of each wave (default: the plan's precopy_rounds)")  # fmt: skip
    p.add_argument("--max-downtime-ms", type=float, default=Snapshot().max_downtime_ms,
                   help="the rounds of a wave stop once the dirty set fits this (default: the plan's)")  # fmt: skip
    p.add_argument("--before-s", type=float, default=3.0, help="steady decoding measured before the migration")
    p.add_argument("--margin-s", type=float, default=3.0,
                   help="decoding the streams must have left at the freeze, else a refill")  # fmt: skip
    p.add_argument("--refills", type=int, default=2, help="waves of streams the bench may start again for the freeze")
    p.add_argument("--chunk-mb", type=int, default=0, help="GPUMIGRATE_SNAPSHOT_CHUNK_MB of both (0: the SDK's choice)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per server (CPU)")
    p.add_argument("--target-gpu", type=int, default=None, help="the target's GPU (default: the one the source uses)")
    p.add_argument("--parallelism", type=int, default=PLAN_DEFAULTS["parallelism"],
                   help="the pre-copy rounds' host threads (default: the plan's; 0: one per core)")  # fmt: skip
    p.add_argument("--pacing", choices=("adaptive", "off"), default=PLAN_DEFAULTS["pacing"],
                   help="the pre-copy rounds' pacing (default: the plan's)")  # fmt: skip
    p.add_argument("--compression", default=PLAN_DEFAULTS["compression"], help="(default: the plan's)")
    p.add_argument("--runs", default="disk", help="stores, comma-separated: disk (the flow's), shm (/dev/shm)")
    p.add_argument("--root", default=None, help="where the disk store and the hosts live (default: a temp dir)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--smoke", action="store_true", help="the tiny config on the CPU; exit 1 unless every check holds")
    p.add_argument("--profile", default=None, help="a folder: py-spy --gil of the source's round 1 (if installed)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    import torch

    if args.smoke:  # 3,000 tokens: a wave outlasts its rounds and a refill's wait for the pacing's base window
        args.size, args.device, args.dtype, args.streams = "tiny", "cpu", "float32", 6
        args.prompt_min, args.prompt_max, args.tokens, args.before_s, args.chunk_mb = 40, 160, 3000, 0.5, 0
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
    failed = [f"{where}: {why}" for where, r in out["runs"].items() for why in failures(r)]
    if failed:
        log("not every check holds: " + "; ".join(failed))
    return 1 if failed and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
