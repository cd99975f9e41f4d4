"""Workloads of two ranks (torch.distributed over gloo, two processes each) through `gpumigrate migrate`, as
examples/multi/README.md says: the source world started from the example plan's own launch, the plan's world
migrated between two local hosts, the target's ranks started by the flow through the same launch (torchrun).

- the tensor-parallel service (examples/multi/tp-plan.yaml): rolled back mid-ramp on the operator's request (the
  source serves on, unfrozen, no target left), then migrated under load through its front door with exact parity
  through rank 0's endpoint and no failed request;
- the DDP job (dp-plan.yaml): every rank's next losses on the target are the source's, bit for bit;
- the FSDP job (each rank holding its own shards of the parameters and of AdamW's moments), its target filled from
  the source's memory (``transfer.restore_from: source``: target rank r from source rank r);
- the DDP job again, its orchestrator killed (SIGKILL) once the target world holds the final image, and the
  migration resumed with ``--resume``: it completes, with the same per-rank parity.

Only what CI cannot share is changed in the example plans: free ports, a target host of its own, absolute paths.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest
import yaml

from gpumigrate import transfer
from gpumigrate.plan import load_plan
from gpumigrate.workloads.worlds import LocalWorld, start_plan_launch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MULTI = REPO / "examples" / "multi"
KEY_ENV = "GPUMIGRATE_MULTI_KEY"  # the example plans' image key variable
DDP = "gpumigrate.workloads.dp_training"
FSDP = "gpumigrate.workloads.fsdp_training"


def example(name: str, *, module: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """The example plan ``name`` as a document, its launch running ``module`` (default: the plan's) on ``device``."""
    doc: dict[str, Any] = yaml.safe_load((MULTI / name).read_text())
    argv = doc["workload"]["launch"]["argv"]
    at = argv.index("-m", argv.index("torch.distributed.run") + 1) + 1
    argv[at] = module or argv[at]
    argv[argv.index("--device") + 1] = device
    return doc


@dataclass
class User:
    """An SRE's shell (the key exported, as the README says) and a folder holding the example plans."""

    home: Path
    env: dict[str, str]
    folder: Path
    cli: list[str]

    def gm(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.cli, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def plan(self, doc: dict[str, Any], world: LocalWorld, service_port: int | None, host: str, **edits: Any) -> Path:
        """An example plan (``example``) for this source world, its target on ``host``; ``edits``: sections merged
        into the plan's (``target={"rank_gpus": ...}`` among them)."""
        doc["workload"]["agent"] = world.agents[0]
        if service_port is not None:
            doc["workload"]["endpoint"] = f"http://127.0.0.1:{service_port}"
        doc["target"]["host"] = host
        doc["transfer"]["store"] = f"file://{self.folder / 'store'}"
        for section, value in edits.items():
            doc[section] = {**doc.get(section, {}), **value} if isinstance(value, dict) else value
        path = self.folder / f"{host}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def start(self, doc: dict[str, Any], name: str) -> tuple[LocalWorld, int]:
        """The source world, from an example plan's own launch (torchrun, two ranks)."""
        path = self.folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return start_plan_launch(load_plan(path).workload, self.folder, log=self.folder / f"{name}.log", env=self.env)

    def audit(self, mid: str) -> list[dict[str, Any]]:
        path = self.home / "migrations" / mid / "audit.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def state(self, mid: str) -> dict[str, Any]:
        return dict(json.loads((self.home / "migrations" / mid / "state.json").read_text()))


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[User]:
    from tests.conftest import gpumigrate_cmd

    folder = tmp_path_factory.mktemp("multi")
    home = folder / "gmhome"
    home.mkdir()
    shutil.copy(MULTI / "golden.jsonl", folder / "golden.jsonl")
    env = {**os.environ, "GPUMIGRATE_HOME": str(home), "PREFECT_API_URL": prefect_api, "OMP_NUM_THREADS": "1"}
    env[KEY_ENV] = transfer.generate_key()
    env.pop("GPUMIGRATE_AWAIT_RESTORE", None)
    made = User(home, env, folder, gpumigrate_cmd())
    yield made
    made.gm("hosts", "down", "--all", timeout=300)  # the targets this module's migrations left running


def _wait(
    what: str, done: Callable[[], bool], timeout_s: float = 240, alive: Callable[[], bool] = lambda: True
) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline or not alive():
            raise AssertionError(f"waited {timeout_s:g} s for {what}" + ("" if alive() else ": its process ended"))
        time.sleep(0.1)


def _result(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    return dict(json.loads(lines[-1]))


def _served(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------------------- the tensor-parallel service
@dataclass
class Service:
    world: LocalWorld
    port: int
    door: str  # the front door's listener: where clients call
    device: str
    name: str  # the workload's (its front door's) name


@contextlib.contextmanager
def serving(user: User, device: str) -> Iterator[Service]:
    """The tensor-parallel source world from tp-plan.yaml's launch on ``device``, behind the front door."""
    name = "tp-lm" if device == "cpu" else f"tp-lm-{device}"  # the front door's name: one per source
    world, port = user.start(example("tp-plan.yaml", device=device), f"tp-source-{device}")
    try:
        url = f"http://127.0.0.1:{port}"
        _wait("the source world to serve", lambda: _served(url), alive=lambda: world.popen.poll() is None)
        up = user.gm("frontdoor", "up", "--source", url, "--workload", name, "--listen", "127.0.0.1:0")
        assert up.returncode == 0, up.stderr
        from gpumigrate.traffic.frontdoor import read

        yield Service(world, port, str(read(user.home / "traffic" / name).listener), device, name)
    finally:
        user.gm("frontdoor", "down", "--workload", name, timeout=120)
        world.stop()


@pytest.fixture(scope="module")
def service(user: User) -> Iterator[Service]:
    with serving(user, "cpu") as made:
        yield made


def _load(service: Service, seconds: float = 300) -> Any:
    from gpumigrate.traffic.loadgen import LoadProcess

    body = {"prompt": "the load", "max_new_tokens": 4}
    return LoadProcess(service.door + "/v1/generate", rps=10, seconds=seconds, body=body)


def _source_untouched(user: User, service: Service) -> None:
    from gpumigrate.snapshot.world import World

    assert _served(f"http://127.0.0.1:{service.port}")
    with mock.patch.dict(os.environ, {"GPUMIGRATE_HOME": str(user.home)}):  # the control key the worlds share
        with World(service.world.agents, timeout_s=30) as world:
            infos = world.info_ranks()
    assert [i.frozen for i in infos] == [False, False] and [i.lease_expiries for i in infos] == [0, 0]


def test_a_tensor_parallel_service_rolled_back_mid_ramp_serves_on_from_its_source(user: User, service: Service) -> None:
    plan = user.plan(
        example("tp-plan.yaml"), service.world, service.port, "tp-rollback-b",
        traffic={"stages": [{"weight": 25, "hold_s": 120}, {"weight": 100, "hold_s": 1}],
                 "gates": {"min_requests": 3, "max_p99_ratio": 10.0}, "analysis_interval_s": 0.5},
    )  # fmt: skip
    load = _load(service)
    mid = "tp-rollback"
    proc = subprocess.Popen(
        [*user.cli, "migrate", str(plan), "--id", mid, "--json"],
        env=user.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _wait(
            "the ramp's first stage",
            lambda: any(e["event"] == "traffic.stage" for e in user.audit(mid)),
            timeout_s=400,
            alive=lambda: proc.poll() is None,
        )
        asked = user.gm("rollback", mid, "--reason", "pager says stop")
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        load.stop()
        report = load.wait(timeout_s=120)
    assert "requested" in asked.stderr, asked.stderr[-2000:]  # the running flow acts on it at its next interval
    assert proc.returncode == 3, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["status"] == "rolled_back" and "pager says stop" in result["rollback"]["reason"]
    names = [e["event"] for e in user.audit(mid)]
    assert "rollback.manual" in names and "rollback.target_torn_down" in names
    # Known gap (issue 32's report): a few requests in flight on the target's connections when the rollback tears it
    # down fail with ReadError (3 of 2745 on two busy cores): the rollback does not drain the target before teardown.
    assert report.ok > 10 and report.failed <= 0.01 * report.total, report.errors
    from gpumigrate.traffic.state import StateStore

    assert StateStore(user.home / "traffic" / "tp-lm").read().weights["source"] == 100.0
    _source_untouched(user, service)
    hosts = user.gm("hosts", "list", "--json")
    assert hosts.returncode == 0 and "tp-rollback-b" not in hosts.stdout, hosts.stdout  # the target is gone


def _tp_migrates(user: User, service: Service, mid: str, **target: Any) -> dict[str, Any]:
    """The service migrated under load through its front door; exact parity through rank 0; what it restored."""
    plan = user.plan(
        example("tp-plan.yaml", device=service.device), service.world, service.port, f"{mid}-b",
        target=target, workload={"name": service.name},
        traffic={"stages": [{"weight": 50, "hold_s": 1}, {"weight": 100, "hold_s": 1}],
                 "gates": {"min_requests": 3, "max_p99_ratio": 10.0}, "analysis_interval_s": 0.5},
    )  # fmt: skip
    load = _load(service)
    try:
        out = user.gm("migrate", str(plan), "--id", mid, "--json")
    finally:
        load.stop()
        report = load.wait(timeout_s=120)
    result = _result(out)
    assert out.returncode == 0 and result["status"] == "completed", (result.get("error"), out.stderr[-3000:])
    assert result["parity"] == {"passed": True, "cases": 8, "max_abs_err": 0.0}  # tokens and logprobs, exactly
    assert report.failed == 0 and report.ok > 10, report.errors
    from gpumigrate.traffic.state import StateStore

    assert StateStore(user.home / "traffic" / service.name).read().weights == {"source": 0.0, "target": 100.0}
    assert user.state(mid)["phases"]["snapshot"]["result"]["preloaded"] >= 1  # the target world pre-loaded, serving
    return dict(next(e["data"] for e in user.audit(mid) if e["event"] == "image.restored"))


def test_a_tensor_parallel_service_migrates_under_load_with_exact_parity_through_rank_0(
    user: User, service: Service
) -> None:
    restored = _tp_migrates(user, service, "tp-1")
    # each rank's part went to the same rank of the target world, the manifest's devices beside it
    assert [(r["rank"], r["source"], r["target"]) for r in restored["ranks"]] == [
        (0, ["cpu"], ["cpu"]),
        (1, ["cpu"], ["cpu"]),
    ]


# ----------------------------------------------------------------------------- training jobs
def _training_plan(user: User, world: LocalWorld, target: str, module: str, device: str = "cpu", **edits: Any) -> Path:
    doc = example("dp-plan.yaml", module=module, device=device)
    return user.plan(doc, world, None, target, snapshot={"freeze_lease_s": 60}, **edits)


@contextlib.contextmanager
def training(user: User, module: str, device: str = "cpu") -> Iterator[LocalWorld]:
    """A training world of ``module``, started as dp-plan.yaml's launch starts it on ``device``, a few steps in."""
    name = f"{module.rsplit('.', 1)[-1]}-{device}"
    world, _ = user.start(example("dp-plan.yaml", module=module, device=device), f"{name}-source")
    try:
        world.wait_steps(3)
        yield world
    finally:
        world.stop()


@pytest.fixture
def job(user: User, request: pytest.FixtureRequest) -> Iterator[tuple[LocalWorld, str]]:
    """A training world of the module ``request.param`` names, on the CPU."""
    with training(user, str(request.param)) as world:
        yield world, str(request.param)


def _trained_on_per_rank(user: User, mid: str, result: dict[str, Any]) -> None:
    """Every rank's next losses after the cut: the target's, the source's, bit for bit."""
    assert result["parity"] == {"passed": True, "cases": 10, "max_abs_err": 0.0}  # 5 steps × 2 ranks
    record = next(e["data"] for e in user.audit(mid) if e["event"] == "parity.training")
    assert len(record["ranks"]) == 2
    for rank in record["ranks"]:
        assert rank["source"] == rank["target"] and len(rank["source"]) == 5
    assert record["ranks"][0]["source"] != record["ranks"][1]["source"]  # each rank trains on its own shard
    assert user.state(mid)["phases"]["ramp"]["result"] == {"skipped": "a training job has no clients to shift"}


@pytest.mark.parametrize("job", [DDP], indirect=True)
def test_a_ddp_job_migrates_with_every_ranks_next_losses_identical(user: User, job: tuple[LocalWorld, str]) -> None:
    world, module = job
    plan = _training_plan(user, world, "ddp-b", module)
    assert user.gm("plan", "validate", str(plan)).returncode == 0
    out = user.gm("migrate", str(plan), "--id", "ddp-1", "--json")
    result = _result(out)
    assert out.returncode == 0 and result["status"] == "completed", (result.get("error"), out.stderr[-3000:])
    _trained_on_per_rank(user, "ddp-1", result)


@pytest.mark.parametrize("job", [FSDP], indirect=True)
def test_an_fsdp_job_filled_from_the_source_memory_rank_by_rank_trains_on_identically(
    user: User, job: tuple[LocalWorld, str]
) -> None:
    pytest.importorskip("nixl_cu13")  # the fill of host memory: NIXL READs
    world, module = job
    plan = _training_plan(user, world, "fsdp-b", module, transfer={"restore_from": "source"})
    out = user.gm("migrate", str(plan), "--id", "fsdp-1", "--json")
    result = _result(out)
    assert out.returncode == 0 and result["status"] == "completed", (result.get("error"), out.stderr[-3000:])
    _trained_on_per_rank(user, "fsdp-1", result)
    restored = next(e["data"] for e in user.audit("fsdp-1") if e["event"] == "image.restored")
    fills = restored["from_source"]["ranks"]  # target rank r from source rank r, frozen: nothing from the image
    assert len(fills) == 2 and all(f["chunks"] > 0 and f["chunks_from_image"] == 0 for f in fills)


@pytest.mark.parametrize("job", [DDP], indirect=True)
def test_a_ddp_migration_whose_orchestrator_is_killed_mid_world_resumes_and_completes(
    user: User, job: tuple[LocalWorld, str]
) -> None:
    """SIGKILL once the target world holds the final image (the source world frozen under its lease, which nobody
    renews then); `--resume` within the lease finds the target restored and goes on: parity and finalize."""
    world, module = job
    plan = _training_plan(user, world, "ddp-resume-b", module)
    mid = "ddp-resume"
    proc = subprocess.Popen(
        [*user.cli, "migrate", str(plan), "--id", mid, "--json"],
        env=user.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        _wait(
            "the target world's restore",
            lambda: any(e["event"] == "image.restored" for e in user.audit(mid)),
            timeout_s=400,
            alive=lambda: proc.poll() is None,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    phases = user.state(mid)["phases"]
    assert phases.get("finalize", {}).get("status") != "completed"  # it was killed mid-way
    out = user.gm("migrate", str(plan), "--id", mid, "--resume", "--json")
    result = _result(out)
    assert out.returncode == 0 and result["status"] == "completed", (result.get("error"), out.stderr[-3000:])
    _trained_on_per_rank(user, mid, result)
    names = [e["event"] for e in user.audit(mid)]
    assert names.count("image.committed") == 1  # the world froze and shipped once


# ----------------------------------------------------------------------------- on two GPUs (NCCL)
def _two_gpus() -> None:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def _swapped(restored: dict[str, Any]) -> None:
    """Rank 0 of the target runs on the GPU rank 1 of the source ran on, and the other way round (by UUID: with
    CUDA_VISIBLE_DEVICES=1,0 each target rank calls its GPU cuda:<local rank>)."""
    rank0, rank1 = restored["ranks"]
    assert rank0["source_gpus"] and rank0["source_gpus"] == rank1["target_gpus"], restored["ranks"]
    assert rank1["source_gpus"] == rank0["target_gpus"] and rank0["source_gpus"] != rank0["target_gpus"]


@pytest.mark.gpu
def test_on_gpus_a_tensor_parallel_service_migrates_onto_swapped_gpus(user: User) -> None:
    """NCCL, NVLink and P2P on (no NCCL_P2P_DISABLE): the target world builds its own communicators; the plan's
    target.rank_gpus puts target rank r on the GPU source rank 1 - r used; tokens and logprobs exactly equal."""
    _two_gpus()
    with serving(user, "cuda") as service:
        _swapped(_tp_migrates(user, service, "tp-gpu", rank_gpus=[1, 0]))


@pytest.mark.gpu
def test_on_gpus_a_ddp_job_migrates_onto_swapped_gpus_with_identical_losses(user: User) -> None:
    _two_gpus()
    with training(user, DDP, "cuda") as world:
        plan = _training_plan(user, world, "ddp-gpu-b", DDP, "cuda", target={"rank_gpus": [1, 0]})
        out = user.gm("migrate", str(plan), "--id", "ddp-gpu", "--json")
    result = _result(out)
    assert out.returncode == 0 and result["status"] == "completed", (result.get("error"), out.stderr[-3000:])
    _trained_on_per_rank(user, "ddp-gpu", result)
    _swapped(next(e["data"] for e in user.audit("ddp-gpu") if e["event"] == "image.restored"))


@pytest.mark.gpu
def test_on_gpus_an_fsdp_job_is_filled_gpu_to_gpu_rank_by_rank(user: User) -> None:
    """``restore_from: source`` on one host: target rank r copies source rank r's shards through CUDA IPC (the lend
    path), each chunk hashed on the GPU where it landed; the next losses are the source's on every rank."""
    _two_gpus()
    with training(user, FSDP, "cuda") as world:
        plan = _training_plan(user, world, "fsdp-gpu-b", FSDP, "cuda", transfer={"restore_from": "source"})
        out = user.gm("migrate", str(plan), "--id", "fsdp-gpu", "--json")
    result = _result(out)
    assert out.returncode == 0 and result["status"] == "completed", (result.get("error"), out.stderr[-3000:])
    _trained_on_per_rank(user, "fsdp-gpu", result)
    restored = next(e["data"] for e in user.audit("fsdp-gpu") if e["event"] == "image.restored")
    fills = restored["from_source"]["ranks"]
    assert [f["way"] for f in fills] == ["lend", "lend"] and all(f["chunks_from_image"] == 0 for f in fills)
