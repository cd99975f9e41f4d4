"""Ranks of one process group, in one process: each rank a real agent behind its authenticated control
server, driven by the orchestrator's World over real sockets; a threading barrier inside every step
stands for the step's collective (a rank inside step k waits there until its peer enters step k too).

The group freeze parks every rank after one step with no deadlock; a rank alone cannot be frozen; a
failed group freeze leaves no rank frozen; the world image holds every rank's regions with its
manifest; a target rank loads exactly its rank's part, and a rank or world size that does not fit is
refused before anything is loaded; the GPU map given to the CUDA driver is complete.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import gpumigrate.agent as gm
from gpumigrate import transfer
from gpumigrate.agent.images import make_engine
from gpumigrate.errors import InvalidInputError, SnapshotError
from gpumigrate.snapshot.client import AgentClient
from gpumigrate.snapshot.errors import ImageMismatchError
from gpumigrate.snapshot.gpumap import gpu_pairs, rank_gpu_pairs
from gpumigrate.snapshot.ranks import RankGroup
from gpumigrate.snapshot.server import AgentServer, serve
from gpumigrate.snapshot.stepgate import SafePointGate
from gpumigrate.snapshot.tracked import rng_items
from gpumigrate.snapshot.world import World

WORLD = 2


@dataclass
class Rank:
    """One in-process rank: its state, gate, agent and control server, and the hooks' log."""

    rank: int
    weights: torch.Tensor
    gate: SafePointGate
    agent: Any
    server: AgentServer
    hooks: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.server.stop()
        self.agent.close()
        self.gate.reopen()


def make_rank(rank: int, *, await_restore: bool = False, size: int = 300_000) -> Rank:
    hooks: list[str] = []
    group = RankGroup(
        rank=rank,
        world_size=WORLD,
        backend="gloo",
        local_rank=rank,
        teardown=lambda: hooks.append("teardown"),
        rebuild=lambda: hooks.append("rebuild"),
    )
    gate = SafePointGate(ready=not await_restore)
    agent = make_engine(freezer=gate, set_ready=gate.set_ready, group=group)
    weights = torch.zeros(size) if await_restore else torch.arange(size, dtype=torch.float32) * (rank + 1)
    agent.track_tensor("w", weights)
    return Rank(rank, weights, gate, agent, serve(agent, 0), hooks)


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    made = [make_rank(r) for r in range(WORLD)]
    yield made
    for r in made:
        r.close()


@pytest.fixture
def targets() -> Iterator[list[Rank]]:
    made = [make_rank(r, await_restore=True) for r in range(WORLD)]
    yield made
    for r in made:
        r.close()


class Training:
    """Every rank steps in a thread; each step waits at a barrier (the collective) and then changes
    the rank's weights. Rank 1 runs flat out, rank 0 pauses between steps: rank 1 spends most of
    its time inside a step, waiting for rank 0, which a freeze of rank 0 alone would never release."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self.barrier = threading.Barrier(len(ranks))
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self.run, args=(r,), daemon=True) for r in ranks]

    def run(self, me: Rank) -> None:
        try:
            while not self.stop.is_set():
                with me.gate.safe_point(None) as step:
                    if self.stop.is_set():
                        return
                    self.barrier.wait(timeout=30)  # the step's collective
                    me.weights.add_(1.0)
                    step.report(loss=float(me.gate.steps))
                if me.rank == 0:
                    time.sleep(0.005)
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.errors.append(exc)

    def __enter__(self) -> Training:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for r in self.ranks:
            r.gate.reopen()
        self.barrier.abort()
        for t in self.threads:
            t.join(10)


def _world(ranks: list[Rank]) -> World:
    return World([r.server.address for r in ranks], timeout_s=60)


def test_freezing_each_rank_on_its_own_deadlocks_on_the_collective(ranks: list[Rank]) -> None:
    """Why the group freeze exists: rank 0 parked between steps leaves rank 1 inside its next step."""
    with Training(ranks):
        while min(r.gate.steps for r in ranks) < 5:
            time.sleep(0.01)
        ranks[0].gate.shut(10)
        while ranks[1].gate.started <= ranks[0].gate.steps:
            time.sleep(0.001)  # rank 1 enters the next step, and waits there for rank 0
        with pytest.raises(SnapshotError, match="not settled after 1s \\(1 in flight\\)"):
            ranks[1].gate.shut(1)
        assert ranks[1].gate.in_flight == 1 and ranks[1].gate.started == ranks[0].gate.steps + 1


def test_the_group_freezes_after_one_step_with_a_collective_in_every_step(ranks: list[Rank]) -> None:
    with Training(ranks) as training, _world(ranks) as world:
        while min(r.gate.steps for r in ranks) < 20:
            time.sleep(0.01)
        for _ in range(5):  # every freeze parks both ranks after the same step, whichever was ahead
            out = world.freeze_ranks(lease_s=30, timeout_s=10)
            step = out["step"]
            assert out["steps"] == [step, step] and max(out["steps_before"]) == step
            before = [r.weights.clone() for r in ranks]
            time.sleep(0.2)
            for r, w in zip(ranks, before, strict=True):
                assert r.gate.steps == step and r.gate.in_flight == 0 and r.agent.frozen
                assert torch.equal(r.weights, w)  # parked: nothing moves
            advanced = world.advance_ranks(3, timeout_s=30)  # together, as their steps hold collectives
            assert [a["steps"] for a in advanced] == [step + 3, step + 3]
            assert [s for s, _ in advanced[0]["losses"]] == [step + 1, step + 2, step + 3]
            world.resume_ranks()
            time.sleep(0.05)
        assert not training.errors


def test_one_rank_is_never_frozen_alone(ranks: list[Rank]) -> None:
    with AgentClient(ranks[0].server.address) as c:
        with pytest.raises(SnapshotError, match="rank 0 of a group of 2: freeze the whole group"):
            c.request_freeze()
        assert not ranks[0].gate.frozen
        held = c.call("hold", lease_s=30)
        assert held == {"steps": 0, "in_flight": 0, "started": 0, "frozen": False, "lease_s": 30}
        with pytest.raises(gm.Unavailable):  # held: no new step starts
            with ranks[0].gate.safe_point(0.2):
                pass
        assert c.call("freeze", at_step=0)["steps"] == 0
        assert c.request_info().frozen is True
        c.request_resume()
    with ranks[0].gate.safe_point(0.5):
        pass


def test_a_failed_group_freeze_resumes_every_rank(ranks: list[Rank]) -> None:
    addresses = [ranks[0].server.address, ranks[1].server.address]
    ranks[1].server.stop()  # rank 1's agent is gone
    with World(addresses, timeout_s=10) as world:
        with pytest.raises(SnapshotError, match="rank 1 .*cannot reach the snapshot agent"):
            world.freeze_ranks(lease_s=30)
    assert not ranks[0].agent.frozen and not ranks[0].agent.held and not ranks[0].gate.frozen
    with ranks[0].gate.safe_point(0.5):  # rank 0 runs on
        pass


def test_a_rank_past_the_group_step_is_refused_and_runs_on(ranks: list[Rank]) -> None:
    for _ in range(3):
        with ranks[0].gate.safe_point(None):
            pass
    with AgentClient(ranks[0].server.address) as c:
        with pytest.raises(SnapshotError, match="already started step 3, past the group's freeze step 2"):
            c.call("freeze", at_step=2)
        info = c.call("info")  # the raw reply: "held" is a rank field the typed AgentInfo does not carry
    assert info["frozen"] is False and info["held"] is False and info["lease"] is None


def test_teardown_and_rebuild_around_an_in_place_capture(ranks: list[Rank]) -> None:
    with _world(ranks) as world:
        with pytest.raises(SnapshotError, match="teardown needs the group frozen"):
            world.teardown_ranks()
        world.freeze_ranks(lease_s=30)
        world.teardown_ranks()
        assert [r.hooks for r in ranks] == [["teardown"], ["teardown"]]
        assert [x["group"] for x in world.describe()] == ["torn down", "torn down"]
        with pytest.raises(SnapshotError, match="advance needs the process group: send rebuild first"):
            world.advance_ranks(1)
        world.resume_ranks()  # a rollback: the group comes back before the first step
        assert [r.hooks for r in ranks] == [["teardown", "rebuild"], ["teardown", "rebuild"]]
        assert [x["group"] for x in world.describe()] == ["up", "up"]
        world.rebuild_ranks()  # idempotent
        assert ranks[0].hooks == ["teardown", "rebuild"]


def test_the_world_image_holds_every_rank_and_restores_rank_by_rank(
    ranks: list[Rank], targets: list[Rank], store: tuple[str, dict[str, str]]
) -> None:
    url, key_ref = store
    with _world(ranks) as source, _world(targets) as target:
        first = source.precopy_ranks(url, key_ref)
        target.restore_ranks(url, first["image"]["id"], key_ref, ready=False)  # pre-load: targets stay unready
        assert not any(t.gate.ready for t in targets)
        for r in ranks:
            r.weights[:1000] += 7.0  # dirty one chunk per rank
        source.freeze_ranks(lease_s=30)
        final = source.final_ranks(url, key_ref)
        restored = target.restore_ranks(url, final["image"]["id"], key_ref)
    for r, t in zip(ranks, targets, strict=True):
        assert torch.equal(t.weights, r.weights) and t.gate.ready
    assert [x["chunks_loaded"] for x in restored["ranks"]] == [2, 2]  # the dirty chunk and the progress blob
    # each rank's chunks land through the store reader's direct placement, as a process restoring its own image
    assert [x["placement"] for x in restored["ranks"]] == ["direct", "direct"]
    assert [(m["rank"], m["source"], m["target"]) for m in restored["device_map"]] == [
        (0, ["cpu"], ["cpu"]),
        (1, ["cpu"], ["cpu"]),
    ]
    reader = transfer.open_reader(url, final["image"]["id"], key=transfer.resolve_key(env=key_ref["env"]))
    names = {r.name for r in reader.regions()}
    assert names == {"rank0/w", "rank1/w", "rank0/progress", "rank1/progress"}
    world = reader.metadata()["world"]
    assert world["world_size"] == 2 and world["step"] == final["step"] == 0
    assert [(e["rank"], e["devices"], e["image"]) for e in world["ranks"]] == [
        (r, ["cpu"], img["image"]["id"]) for r, img in enumerate(final["ranks"])
    ]
    assert world["ranks"][1]["snapshot"]["rank"] == {"rank": 1, "world_size": 2}
    stats = transfer.verify(url, final["image"]["id"], key=transfer.resolve_key(env=key_ref["env"]))
    assert stats.chunks_total > 0 and not stats.errors  # every chunk it names is in the store and verifies


def test_a_rank_reads_its_part_of_a_world_image_through_the_direct_path(
    ranks: list[Rank], store: tuple[str, dict[str, str]]
) -> None:
    """A world image is no slower a format: rank r's view of it fills tensors through the reader's direct placement
    (``read_tensors``: fetch, open, decode, copy, verify), as the rank's own image would, and only where the
    reader has it. The pipeline sees it as Python 3.12's ``isinstance`` does (attributes looked up statically), on
    any Python: a view offering ``read_tensors`` through ``__getattr__`` passed on 3.11 and lost the direct path on
    the GPU machines' 3.12 (issue 32)."""
    from gpumigrate.interfaces import TensorChunk, reads_directly
    from gpumigrate.snapshot.worldimage import rank_view
    from gpumigrate.transfer.reader import StoreImageReader

    url, key_ref = store
    with _world(ranks) as source:
        source.freeze_ranks(lease_s=30)
        image = source.final_ranks(url, key_ref)["image"]["id"]
    reader = transfer.open_reader(url, image, key=transfer.resolve_key(env=key_ref["env"]))
    assert reads_directly(reader)
    mine = rank_view(reader, 1)
    assert reads_directly(mine)
    assert callable(inspect.getattr_static(mine, "read_tensors"))  # what isinstance looks up from Python 3.12
    cs = reader.chunk_size
    out = torch.zeros(ranks[1].weights.numel() * 4, dtype=torch.uint8)
    chunks = [TensorChunk("w", i, out[i * cs : (i + 1) * cs]) for i in range(mine.chunk_count("w"))]
    assert mine.read_tensors(chunks) == out.numel()
    assert torch.equal(out.view(torch.float32), ranks[1].weights)  # rank 1's bytes, not rank 0's
    plain = StoreImageReader(reader.store, image, reader.sealer)  # a reader without direct placement
    assert not reads_directly(rank_view(plain, 1))
    assert not hasattr(rank_view(plain, 1), "read_tensors")


def test_a_rank_gets_only_its_own_part(
    ranks: list[Rank], targets: list[Rank], store: tuple[str, dict[str, str]]
) -> None:
    url, key_ref = store
    with _world(ranks) as source:
        source.freeze_ranks(lease_s=30)
        final = source.final_ranks(url, key_ref)
    image = final["image"]["id"]
    with AgentClient(targets[1].server.address) as c:
        with pytest.raises(ImageMismatchError, match="restore rank 0 of a world of 2 into rank 1 of 2"):
            c.request_restore(url, image, key_ref, rank=0)
        with pytest.raises(ImageMismatchError, match="holds rank 0 of 2; this process is rank 1 of 2"):
            c.request_restore(url, final["ranks"][0]["image"]["id"], key_ref)  # rank 0's own image
    assert not targets[1].gate.ready and not targets[1].weights.any()  # nothing was loaded
    with World([targets[1].server.address, targets[0].server.address]) as swapped:
        with pytest.raises(InvalidInputError, match="is rank 1 of 2; expected rank 0 of 2"):
            swapped.restore_ranks(url, image, key_ref)
    lone = make_engine(freezer=SafePointGate())  # a process that is no rank at all
    lone.track_tensor("w", torch.zeros(300_000))
    reader = transfer.open_reader(url, image, key=transfer.resolve_key(env=key_ref["env"]))
    with pytest.raises(ImageMismatchError, match="is a world image of 2 ranks: name the rank"):
        lone.load(reader)
    lone.close()


def test_a_world_image_refuses_images_of_other_ranks(ranks: list[Rank], store: tuple[str, dict[str, str]]) -> None:
    url, key_ref = store
    with _world(ranks) as world:
        rounds = [AgentClient(r.server.address).request_precopy(url, key_ref) for r in ranks]
        world.describe()
        with pytest.raises(ImageMismatchError, match="written by rank 1 of 2, not by rank 0 of 2"):
            world.compose_ranks(url, key_ref, [rounds[1].image.id, rounds[0].image.id])


def _gpu(n: int) -> str:
    return f"GPU-{n:08x}-0000-0000-0000-{n:012x}"


def test_the_gpu_map_pairs_every_gpu_the_driver_sees() -> None:
    a, b, c, d = (_gpu(n) for n in range(1, 5))
    source = [{"gpus": [{"uuid": a}]}, {"gpus": [{"uuid": b}]}]
    swapped = [{"gpus": [{"uuid": b.removeprefix("GPU-")}]}, {"gpus": [{"uuid": a.upper()}]}]  # any spelling
    used = rank_gpu_pairs(source, swapped)
    assert used == {a: b, b: a}
    assert gpu_pairs(used, [a, b, c, d]) == [(a, b), (b, a), (c, c), (d, d)]
    # Ranks on GPUs 0,1 of four, restored onto 2,3: the idle GPUs take the ones left over.
    assert gpu_pairs({a: c, b: d}, [a, b, c, d]) == [(a, c), (b, d), (c, a), (d, b)]
    with pytest.raises(InvalidInputError, match="are not among those the driver sees"):
        gpu_pairs({a: _gpu(9)}, [a, b])
    with pytest.raises(InvalidInputError, match="two GPUs of the source would go onto one GPU"):
        gpu_pairs({a: b, b: b}, [a, b])
    with pytest.raises(InvalidInputError, match="rank 1 uses 1 GPU"):
        rank_gpu_pairs(source, [{"gpus": [{"uuid": a}]}, {"gpus": []}])
    with pytest.raises(InvalidInputError, match="'GPU-a' is not a GPU UUID"):
        gpu_pairs({"GPU-a": b}, [a, b])


def test_attach_refuses_a_process_group_it_cannot_use() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="needs torch.distributed initialised first"):
        gm.attach(model, process_group=object())
    with pytest.raises(TypeError, match="go with process_group"):
        gm.attach(model, on_rebuild=lambda: None)
    assert gm.current() is None


@pytest.mark.gpu
def test_a_rank_carries_its_own_gpus_rng_stream_onto_another_gpu() -> None:
    """Rank 0 moved from GPU 0 to GPU 1 (a world restored onto GPUs 1,0) draws what it would have drawn."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.manual_seed_all(0)
    torch.randn(10, device="cuda:0")  # GPU 0's stream moves on; GPU 1's does not
    (source,) = [i for i in rng_items("rng", cuda_devices=[0]) if i.prefix == "rng/cuda"]
    saved = source.tensors()["rng/cuda"].clone()
    expected = torch.randn(5, device="cuda:0").cpu()  # what rank 0 draws next where it was
    (target,) = [i for i in rng_items("rng", cuda_devices=[1]) if i.prefix == "rng/cuda"]
    target.after_restore({}, {"rng/cuda": saved})
    assert torch.equal(torch.randn(5, device="cuda:1").cpu(), expected)


def test_the_lightning_callback_refuses_a_trainer_of_several_ranks() -> None:
    import pytorch_lightning as pl

    from gpumigrate.agent.lightning import MigrationCallback

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(RuntimeError, match="this one has 2 ranks.*process_group=torch.distributed.group.WORLD"):
        MigrationCallback().on_train_start(trainer, pl.LightningModule())
    assert gm.current() is None  # nothing attached


def _consecutive(await_restore: bool) -> list[Rank]:
    """The ranks with their agents on consecutive ports, as ``workload.ranks`` addresses them (port + r)."""
    import socket

    for _ in range(20):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        made: list[Rank] = []
        try:
            for r in range(WORLD):
                rank = make_rank(r, await_restore=await_restore)
                made.append(rank)
                rank.server.stop()
                rank.server = serve(rank.agent, base + r)
            return made
        except OSError:  # a port of the pair was taken: another pair
            for rank in made:
                rank.close()
    raise AssertionError("no two consecutive free ports on loopback in 20 tries")


def test_the_agent_backend_moves_a_world_of_ranks_through_the_seam(store: tuple[str, dict[str, str]]) -> None:
    """``workload.ranks: 2`` behind the one factory: the flow's calls reach every rank (a pre-load leaves the
    target's ranks unready, the freeze parks both after one step, the final world image restores rank by rank)."""
    from gpumigrate.snapshot.backends import Setup, snapshot_backend

    url, key_ref = store
    source, target = _consecutive(False), _consecutive(True)
    try:
        setup = Setup(
            store=url,
            key_ref=key_ref,
            source_agent=source[0].server.address,
            ranks=WORLD,
            target_agent=target[0].server.address,
        )
        backend = snapshot_backend("agent", setup)
        assert backend.check() == {"agent": source[0].server.address}
        first = backend.precopy()
        loaded = backend.preload(first.image)
        assert not loaded.ready and not any(t.gate.ready for t in target)
        for r in source:
            r.weights[:1000] += 7.0  # dirty one chunk per rank
        assert backend.freeze(30) == 0 and all(r.agent.frozen for r in source)
        image = backend.final()
        restored = backend.restore(image)
        assert restored.ready and restored.chunks_loaded == 4  # per rank: the dirty chunk and the progress blob
        assert all(torch.equal(t.weights, s.weights) and t.gate.ready for s, t in zip(source, target, strict=True))
        assert backend.facts("target")["python"] == backend.facts("source")["python"]
        backend.resume()
        assert not any(r.agent.frozen for r in source)
        record = backend.retire()
        assert record["verified"] and record["zeroized_regions"] == WORLD
        assert not any(r.weights.any() for r in source)
    finally:
        for r in (*source, *target):
            r.close()
