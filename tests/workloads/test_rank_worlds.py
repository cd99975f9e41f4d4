"""Workloads of 2 ranks (torch.distributed; gloo on the CPU, NCCL on GPUs), each rank embedding the SDK,
migrated between real torchrun worlds through the orchestrator's World: pre-copy rounds pre-loading
the target world, the group freeze, the final round and its world image, the restore of rank r's
part into target rank r.

The data-parallel job (a DDP all-reduce in every step) continues with the losses the source gives
for the same steps and an unmigrated control run gives, rank by rank; the tensor-parallel model
(half the weights per rank, collectives in every token) answers exactly like the source, with no
failed request under load; the communicators' teardown and rebuild around an in-place capture
leaves the job's losses unchanged. Marked ``gpu``: the same over NCCL, restored onto swapped GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gpumigrate import transfer
from gpumigrate.errors import PlanError
from gpumigrate.plan import load_plan, parse_plan
from gpumigrate.snapshot.cutover import restore_and_ready
from gpumigrate.snapshot.gpumap import gpu_pairs, rank_gpu_pairs
from gpumigrate.snapshot.ranks import visible_gpu_uuids
from gpumigrate.snapshot.world import World
from gpumigrate.traffic.loadgen import LoadGenerator
from gpumigrate.workloads.worlds import LocalWorld, start_plan_launch, start_world

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "multi"
DP = "gpumigrate.workloads.dp_training"
FSDP = "gpumigrate.workloads.fsdp_training"
TP = "gpumigrate.workloads.tp_inference"
PARITY_STEPS = 4


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, str]]:
    monkeypatch.setenv("GM_RANKS_TEST_KEY", transfer.generate_key())
    return f"file://{tmp_path / 'store'}", {"env": "GM_RANKS_TEST_KEY"}


class Worlds:
    """Worlds this test started (each a torchrun), all killed at its end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[LocalWorld] = []

    def __call__(self, module: str, args: list[str], *, name: str, await_restore: bool = False) -> LocalWorld:
        world = start_world(module, 2, args, log=self.tmp_path / f"{name}.log", await_restore=await_restore)
        self.started.append(world)
        return world

    def from_plan(self, plan_path: Path, *, name: str, await_restore: bool = False) -> LocalWorld:
        """The plan's own workload.launch, rendered for a local host as the flow renders it."""
        plan = load_plan(plan_path)
        world, _ = start_plan_launch(
            plan.workload, plan_path.parent, log=self.tmp_path / f"{name}.log", await_restore=await_restore
        )
        self.started.append(world)
        return world


@pytest.fixture
def worlds(tmp_path: Path, gm_home: Path) -> Iterator[Worlds]:
    made = Worlds(tmp_path)
    yield made
    for world in made.started:
        world.stop()


def connect(world: LocalWorld, timeout_s: float = 240.0) -> World:
    """The orchestrator's handle on a started world, once every rank's agent answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        agents = World(world.agents, timeout_s=300)
        try:
            agents.describe()
            return agents
        except Exception:
            agents.close()
            if time.monotonic() > deadline or world.popen.poll() is not None:
                raise AssertionError(f"the world's agents did not come up:\n{world.text()[-3000:]}") from None
            time.sleep(0.2)


def migrate(
    source: World, target: World, store: tuple[str, dict[str, str]], rounds: int = 2, *, confirm_later: bool = False
) -> dict[str, Any]:
    """Pre-copy rounds, the group freeze, the final round, the target's restore. ``confirm_later``: the final round
    returns before it confirms its cold chunks, the target restores unready beside each rank's verdict and reports
    ready after it (``snapshot/cutover.py``)."""
    url, key_ref = store
    for _ in range(rounds):  # live rounds, each pre-loaded into the target world (which stays unready)
        image = source.precopy_ranks(url, key_ref)["image"]["id"]
        loaded = target.restore_ranks(url, image, key_ref, ready=False)
        assert all(r["ready"] is False for r in loaded["ranks"])
    frozen = source.freeze_ranks(lease_s=120)
    if confirm_later:
        final = source.final_ranks(url, key_ref, confirm="later")
        assert final["confirmation"] == "pending"  # each rank's weights were still being hashed
        cut = restore_and_ready(source, target, url, key_ref, final)
        assert cut["verdict"]["follow_up"] is False and [v["caught"] for v in cut["verdict"]["ranks"]] == [0, 0]
        restored = cut["restored"]
        assert all(r["ready"] is False for r in restored["ranks"])  # restored unready, beside the verdict
        assert cut["ready"] is not None and all(r["ready"] is True for r in cut["ready"])
    else:
        final = source.final_ranks(url, key_ref)
        restored = target.restore_ranks(url, final["image"]["id"], key_ref)
        assert all(r["ready"] is True for r in restored["ranks"])
    # every rank's chunks landed through the store reader's direct placement (on a GPU: into the device tensor,
    # verified there), as one process restoring its own image: a world image is no slower a format (issue 32)
    assert [r["placement"] for r in restored["ranks"]] == ["direct", "direct"]
    return {"freeze": frozen, "final": final, "restore": restored}


def _check_world_image(store: tuple[str, dict[str, str]], image_id: str, step: int, devices: list[str]) -> None:
    url, key_ref = store
    reader = transfer.open_reader(url, image_id, key=transfer.resolve_key(env=key_ref["env"]))
    world = reader.metadata()["world"]
    assert world["world_size"] == 2 and world["step"] == step
    assert [(e["rank"], e["devices"], e["backend"]) for e in world["ranks"]] == [
        (r, [devices[r]], "nccl" if devices[r].startswith("cuda") else "gloo") for r in range(2)
    ]
    names = [r.name for r in reader.regions()]
    assert all(n.startswith(("rank0/", "rank1/")) for n in names)
    for r in range(2):
        assert {f"rank{r}/model/0.weight", f"rank{r}/optimizer/state/0/exp_avg", f"rank{r}/state.plain"} <= set(names)


def _dp_migration(
    worlds: Worlds,
    store: tuple[str, dict[str, str]],
    source_args: list[str],
    target_args: list[str],
    job: str = DP,
) -> dict[str, Any]:
    source_args, target_args = ["--steps", "400", *source_args], ["--steps", "400", *target_args]
    control = worlds(job, source_args, name="control")
    src = worlds(job, [*source_args, "--step-delay-ms", "100"], name="source")
    dst = worlds(job, target_args, name="target", await_restore=True)
    src.wait_steps(3)
    with connect(src) as source, connect(dst) as target:
        done = migrate(source, target, store)
        cut = done["freeze"]["step"]
        assert done["freeze"]["steps"] == [cut, cut]  # both ranks parked after the same step
        advanced = source.advance_ranks(PARITY_STEPS)  # the source's losses for the steps the target takes next
        assert [a["steps"] for a in advanced] == [cut + PARITY_STEPS] * 2
        source.resume_ranks()
    devices = [m["source"][0] for m in done["restore"]["device_map"]]
    _check_world_image(store, done["final"]["image"]["id"], cut, devices)
    dst.wait_steps(cut + PARITY_STEPS)
    control.wait_steps(cut + PARITY_STEPS)
    for rank in range(2):
        target, reference = dst.losses(rank), control.losses(rank)
        source_losses = dict(advanced[rank]["losses"])
        assert min(target) == cut + 1  # the target continued from the cut: it did not start over
        for step in range(cut + 1, cut + PARITY_STEPS + 1):
            assert target[step] == source_losses[step] == reference[step], (rank, step)
        assert {s: v for s, v in src.losses(rank).items() if s <= cut} == {s: reference[s] for s in range(1, cut + 1)}
    return done


def test_data_parallel_training_continues_with_identical_losses(
    worlds: Worlds, store: tuple[str, dict[str, str]]
) -> None:
    done = _dp_migration(worlds, store, ["--device", "cpu"], ["--device", "cpu"])
    assert [(m["source"], m["target"]) for m in done["restore"]["device_map"]] == [(["cpu"], ["cpu"])] * 2


def test_fully_sharded_training_continues_with_identical_losses(
    worlds: Worlds, store: tuple[str, dict[str, str]]
) -> None:
    """FSDP2: each rank carries its own shards of the parameters and of AdamW's moments (its half of each layer)."""
    done = _dp_migration(worlds, store, ["--device", "cpu"], ["--device", "cpu"], job=FSDP)
    url, key_ref = store
    reader = transfer.open_reader(url, done["final"]["image"]["id"], key=transfer.resolve_key(env=key_ref["env"]))
    names = ("model/0.weight", "optimizer/state/0/exp_avg")  # the first layer's weight (128 × 32) and its moment
    shards = {r.name: list(r.shape or ()) for r in reader.regions() if r.name.endswith(names)}
    assert shards == {f"rank{r}/{n}": [64, 32] for r in range(2) for n in names}  # half of its rows on each rank


def _answered(load: LoadGenerator) -> int:
    return sum(1 for r in list(load.records) if r[2])


def _wait_answered(load: LoadGenerator, n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while _answered(load) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def _url(world: LocalWorld) -> str:
    return f"http://127.0.0.1:{world.wait_event('listening')['port']}"


def _wait(url: str, path: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url}{path} did not answer 200")


def _tp_migration(store: tuple[str, dict[str, str]], src: LocalWorld, dst: LocalWorld) -> dict[str, Any]:
    src_url, dst_url = _url(src), _url(dst)
    _wait(src_url, "/readyz")
    _wait(dst_url, "/healthz")
    assert httpx.get(dst_url + "/readyz").json() == {"status": "not ready", "reason": "awaiting restore"}
    prompts = [f"prompt {i}: {'xyz' * i}" for i in range(12)]
    expected = [httpx.post(src_url + "/v1/generate", json={"prompt": p, "max_new_tokens": 12}).json() for p in prompts]
    assert len({tuple(e["tokens"]) for e in expected}) > 1  # the answers depend on the prompt
    body = {"prompt": prompts[3], "max_new_tokens": 4}
    load = LoadGenerator(src_url + "/v1/generate", rps=20, seconds=600, body=body, timeout_s=60).start()
    with connect(src) as source, connect(dst) as target:
        _wait_answered(load, 20)
        done = migrate(source, target, store, confirm_later=True)
        assert httpx.get(dst_url + "/readyz").status_code == 200
        source.resume_ranks()  # the requests held at the freeze go on: slow for a moment, never failed
        _wait_answered(load, _answered(load) + 20)
    load.stop()
    report = load.wait()
    assert report.failed == 0 and report.ok >= 40, report.errors
    assert done["freeze"]["steps"] == [done["freeze"]["step"]] * 2
    got = [httpx.post(dst_url + "/v1/generate", json={"prompt": p, "max_new_tokens": 12}).json() for p in prompts]
    assert got == expected  # tokens, logprobs and text, bit for bit
    return done


def test_tensor_parallel_model_answers_identically_after_migration(
    worlds: Worlds, store: tuple[str, dict[str, str]]
) -> None:
    """Source and target started from examples/multi/tp-plan.yaml's own launch, as the flow starts them."""
    plan = EXAMPLES / "tp-plan.yaml"
    assert load_plan(plan).workload.ranks == 2
    _tp_migration(
        store, worlds.from_plan(plan, name="source"), worlds.from_plan(plan, name="target", await_restore=True)
    )


@pytest.mark.slow
def test_teardown_and_rebuild_of_the_group_keep_the_losses(worlds: Worlds) -> None:
    """Around an in-place capture (the CUDA driver's, CRIU's) the communicators are destroyed and made
    again, the DDP wrapper with them: the job then takes the steps an untouched run takes."""
    control = worlds(DP, ["--steps", "400"], name="control")
    src = worlds(DP, ["--steps", "400", "--step-delay-ms", "50"], name="source")
    src.wait_steps(3)
    with connect(src) as source:
        cut = source.freeze_ranks(lease_s=120)["step"]
        source.teardown_ranks()
        assert [r["group"] for r in source.describe()] == ["torn down", "torn down"]
        source.rebuild_ranks()
        source.resume_ranks()
    src.wait_steps(cut + 5)
    control.wait_steps(cut + 5)
    for rank in range(2):
        mine, reference = src.losses(rank), control.losses(rank)
        assert [mine[s] for s in range(1, cut + 6)] == [reference[s] for s in range(1, cut + 6)], rank


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
def test_data_parallel_over_nccl_restored_onto_swapped_gpus(worlds: Worlds, store: tuple[str, dict[str, str]]) -> None:
    if not _two_gpus():
        pytest.skip("needs two GPUs")
    done = _dp_migration(worlds, store, ["--device", "cuda"], ["--device", "cuda", "--devices", "1,0"])
    device_map = done["restore"]["device_map"]
    assert [(m["source"], m["target"]) for m in device_map] == [(["cuda:0"], ["cuda:1"]), (["cuda:1"], ["cuda:0"])]
    # The GPUs by UUID: rank 0's old GPU is rank 1's new one, and the driver's full map pairs them so.
    rank0, rank1 = device_map
    assert rank0["source_gpus"] == rank1["target_gpus"] and rank1["source_gpus"] == rank0["target_gpus"]
    used = rank_gpu_pairs(
        [{"gpus": [{"uuid": u} for u in m["source_gpus"]]} for m in device_map],
        [{"gpus": [{"uuid": u} for u in m["target_gpus"]]} for m in device_map],
    )
    assert sorted(gpu_pairs(used, visible_gpu_uuids())[:2]) == sorted(used.items())


@pytest.mark.gpu
def test_tensor_parallel_over_nccl_restored_onto_swapped_gpus(
    worlds: Worlds, store: tuple[str, dict[str, str]]
) -> None:
    if not _two_gpus():
        pytest.skip("needs two GPUs")
    src = worlds(TP, ["--port", "0", "--device", "cuda"], name="source")
    dst = worlds(TP, ["--port", "0", "--device", "cuda", "--devices", "1,0"], name="target", await_restore=True)
    done = _tp_migration(store, src, dst)
    swapped = [(m["source"], m["target"]) for m in done["restore"]["device_map"]]
    assert swapped == [(["cuda:0"], ["cuda:1"]), (["cuda:1"], ["cuda:0"])]


@pytest.mark.parametrize("name", ["tp-plan.yaml", "dp-plan.yaml", "fsdp-plan.yaml"])
def test_the_example_plans_name_their_world(name: str) -> None:
    plan = load_plan(EXAMPLES / name)
    assert plan.workload.ranks == 2 and plan.workload.agent == "127.0.0.1:7070"
    assert plan.workload.launch is not None
    assert "--nproc-per-node=2" in plan.workload.launch.argv  # torchrun starts as many ranks as the plan says
    data = yaml.safe_load((EXAMPLES / name).read_text())
    for bad in (0, 65, "two"):
        data["workload"]["ranks"] = bad
        with pytest.raises(PlanError, match="workload.ranks"):
            parse_plan(data)
