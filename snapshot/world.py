"""The orchestrator's side of a workload's agents: every rank's agent driven as one (PROTOCOL.md, "Ranks").

A workload of N ranks (torch.distributed) embeds one agent per rank; rank r's listens at the
workload's agent address with its port + r (``World.consecutive``), or wherever a list says. Each
command goes to every rank at once and fails as a whole, naming the rank (the method names end in
``_ranks``):

- ``precopy_ranks``: one live round on every rank (each commits its own image), then the world image
  composed from them by rank 0's agent (``worldimage.py``): one image id per round to push and to
  pre-load, like a single process's.
- ``freeze_ranks``: ``hold`` on every rank (gates shut, steps in flight go on), then ``freeze`` at the
  highest step any rank started, so every rank ends parked after the same step and none is inside
  a collective. Any failure resumes every rank: the source is never left half-frozen.
- ``final_ranks``: each rank's last dirty set (the leases renewed from a second connection meanwhile),
  then the world image; ``restore_ranks``: target rank r loads rank r's part, after its agent said it is
  rank r of a world of the same size; ``ready_ranks``: a target loaded unready reports ready. A final round
  that returns before its confirmation ends, and the target's restore beside its verdict: ``cutover.py``.
- ``advance_ranks`` / ``metrics_ranks``: per-rank steps and losses for training parity;
  ``teardown_ranks`` / ``rebuild_ranks`` around an in-place capture (the CUDA driver, CRIU);
  ``resume_ranks``; ``zeroize_ranks``.

A world of one is a plain process: its own image (no world image), a plain freeze, a restore without a
rank (and with a fill from the source's memory where asked), its errors as the agent gave them. The agent
backend (``backends/embedded.py``) drives every workload through this class. The GPU map of a world
(old → new GPUs for the CUDA driver's restore) is ``gpumap.py``. No torch here: this runs in the
orchestrator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from gpumigrate.errors import GpumigrateError, InvalidInputError
from gpumigrate.interfaces import ImageRef, Round, RoundStats
from gpumigrate.snapshot.client import AgentClient
from gpumigrate.snapshot.precopy import Convergence, converge
from gpumigrate.snapshot.rankmath import rank_addresses, ranked, shares
from gpumigrate.snapshot.replies import AgentInfo

__all__ = ["DEFAULT_LEASE_S", "World", "rank_addresses", "shares"]

T = TypeVar("T")
DEFAULT_LEASE_S = 60.0


class World:
    """The agents of one workload's ranks, rank 0's first. Thread-safe per call; close() when done."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        key: bytes | None = None,
        key_ref: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        agent: str | None = None,
        source: bool = False,
    ) -> None:
        if not addresses:
            raise InvalidInputError("a world needs the agent address of at least one rank")
        self.addresses = list(addresses)

        def client(address: str, timeout: float) -> AgentClient:  # agent: the workload's id; each rank's extends it
            return AgentClient(address, key=key, key_ref=key_ref, timeout_s=timeout, agent=agent, source=source)

        self._clients = [client(a, timeout_s) for a in self.addresses]
        # A second connection per rank: renewals must not queue behind a long final on the first.
        self._renewers = [client(a, 30.0) for a in self.addresses]
        self._pool = ThreadPoolExecutor(max_workers=2 * len(self.addresses), thread_name_prefix="gm-world")
        self.ranks: list[dict[str, Any]] | None = None  # each rank's info()["rank"], once described
        self.step: int | None = None  # the step the world froze after

    @classmethod
    def consecutive(
        cls,
        address: str,
        ranks: int,
        *,
        key: bytes | None = None,
        key_ref: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        agent: str | None = None,
        source: bool = False,
    ) -> World:
        """Rank r's agent at ``address``'s host, port + r (the SDK's default for a group); ``agent``: the id
        expected there (each rank's is ``agent/rR``); ``source``: a source's agents (never a target's)."""
        return cls(
            rank_addresses(address, ranks), key=key, key_ref=key_ref, timeout_s=timeout_s, agent=agent, source=source
        )

    @property
    def size(self) -> int:
        return len(self.addresses)

    @property
    def alone(self) -> bool:
        """A world of one: a plain process (see the module)."""
        return self.size == 1

    def close(self) -> None:
        for c in (*self._clients, *self._renewers):
            c.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ fan-out
    def _each(self, call: Callable[[int, AgentClient], T], clients: Sequence[AgentClient] | None = None) -> list[T]:
        """``call(rank, client)`` on every rank at once; the first failure (in rank order) is raised
        once every call has returned, naming its rank."""
        clients = self._clients if clients is None else clients
        futures = [self._pool.submit(call, r, c) for r, c in enumerate(clients)]
        results: list[T] = []
        failure: GpumigrateError | None = None
        for r, fut in enumerate(futures):
            try:
                results.append(fut.result())
            except GpumigrateError as exc:
                failure = failure or (exc if self.alone else ranked(exc, r, self.addresses[r]))
        if failure is not None:
            raise failure
        return results

    def _rank0(self, cmd: str, **args: Any) -> Any:
        try:
            return self._clients[0].call(cmd, **args)
        except GpumigrateError as exc:
            raise (exc if self.alone else ranked(exc, 0, self.addresses[0])) from None

    # The rank commands carry per-rank members (``rank``, ``world``) that the single-agent typed replies
    # leave out: the world reads the agents' raw replies (snapshot/PROTOCOL.md, "Ranks").

    # ------------------------------------------------------------------ what the ranks are
    def ping_ranks(self) -> None:
        """Every rank's agent answers (and accepts this control key)."""
        self._each(lambda r, c: c.call("ping"))

    def info_ranks(self) -> list[AgentInfo]:
        return self._each(lambda r, c: c.request_info())

    def describe(self) -> list[dict[str, Any]]:
        """Each rank's place (rank, world size, backend, devices, GPUs), checked: the agents are
        ranks 0..N-1 of one world of N, listed in rank order."""
        infos = self._each(lambda r, c: c.call("info"))
        ranks: list[dict[str, Any]] = []
        for r, info in enumerate(infos):
            own = info.get("rank")
            if own is None and self.size == 1:
                own = {"rank": 0, "world_size": 1, "devices": [], "gpus": []}
            if own is None:
                raise InvalidInputError(
                    f"the agent at {self.addresses[r]} is not a rank of a process group (attach(process_group=...))"
                )
            if (own["rank"], own["world_size"]) != (r, self.size):
                raise InvalidInputError(
                    f"the agent at {self.addresses[r]} is rank {own['rank']} of {own['world_size']}; "
                    f"expected rank {r} of {self.size} (agents are listed in rank order)"
                )
            ranks.append({**own, "agent": self.addresses[r]})
        self.ranks = ranks
        return ranks

    # ------------------------------------------------------------------ source side
    def _shares(self, options: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        """Each rank's part of the round's writer options (:func:`shares`, by the host each rank described)."""
        ranks = self.ranks if self.ranks is not None else self.describe()
        return shares(options or {}, [str(r.get("host") or "") for r in ranks])

    def compose_ranks(self, store: str, key_ref: Mapping[str, str], images: list[str]) -> dict[str, Any]:
        """The world image of rank r's image ``images[r]``, composed by rank 0's agent."""
        ranks = self.ranks if self.ranks is not None else self.describe()
        out: dict[str, Any] = self._rank0(
            "compose", store=store, key_ref=dict(key_ref), images=images, ranks=ranks, step=self.step
        )
        return out

    def precopy_ranks(
        self,
        store: str,
        key_ref: Mapping[str, str],
        *,
        parent: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One live round on every rank, then their world image. ``stats``: the round over all ranks
        (chunks and bytes summed, seconds of the slowest rank, as they run side by side). ``parent``: the
        image a world of one ships against (each rank of a larger world ships against its own last image)."""
        if self.alone:
            one = self._rank0("precopy", store=store, key_ref=dict(key_ref), parent=parent, options=dict(options or {}))
            return {"stats": RoundStats(**one["stats"]), "image": one["image"], "ranks": [one], "compose_seconds": 0.0}
        mine = self._shares(options)
        rounds = self._each(lambda r, c: c.call("precopy", store=store, key_ref=dict(key_ref), options=mine[r]))
        world = self.compose_ranks(store, key_ref, [x["image"]["id"] for x in rounds])
        stats = [x["stats"] for x in rounds]
        total = RoundStats(
            round=max(s["round"] for s in stats),
            chunks_total=sum(s["chunks_total"] for s in stats),
            chunks_dirty=sum(s["chunks_dirty"] for s in stats),
            bytes_dirty=sum(s["bytes_dirty"] for s in stats),
            seconds=max(s["seconds"] for s in stats),
        )
        return {"stats": total, "image": world["image"], "ranks": rounds, "compose_seconds": world["seconds"]}

    def precopy_until(
        self,
        store: str,
        key_ref: Mapping[str, str],
        *,
        max_rounds: int,
        max_downtime_ms: float,
        options: Mapping[str, Any] | None = None,
        on_image: Callable[[str], None] | None = None,
    ) -> Convergence:
        """Rounds until the world's dirty set fits ``max_downtime_ms`` or stops shrinking;
        ``on_image(world image id)`` after each (push it, pre-load the target)."""

        def one() -> Round:
            out = self.precopy_ranks(store, key_ref, options=options)
            if on_image is not None:
                on_image(out["image"]["id"])
            return Round(stats=out["stats"], image=ImageRef(**out["image"]))

        return converge(one, max_rounds=max_rounds, max_downtime_ms=max_downtime_ms)

    def freeze_ranks(self, *, lease_s: float | None = DEFAULT_LEASE_S, timeout_s: float = 60.0) -> dict[str, Any]:
        """Park every rank after the same step: hold all, then freeze all at the highest step any
        started. On any failure every rank is resumed and the error raised."""
        t0 = time.perf_counter()
        if self.alone:
            args = {} if lease_s is None else {"lease_s": lease_s}
            step = int(self._rank0("freeze", timeout_s=timeout_s, **args).get("steps") or 0)
            self.step = step
            return {"step": step, "steps_before": [step], "steps": [step], "seconds": time.perf_counter() - t0}
        lease = DEFAULT_LEASE_S if lease_s is None else lease_s
        try:
            held = self._each(lambda r, c: c.call("hold", lease_s=lease))
            step = max(h["started"] for h in held)
            frozen = self._each(lambda r, c: c.call("freeze", at_step=step, lease_s=lease, timeout_s=timeout_s))
        except GpumigrateError:
            self._resume_quietly()
            raise
        self.step = step
        return {
            "step": step,
            "steps_before": [h["started"] for h in held],
            "steps": [f["steps"] for f in frozen],
            "seconds": time.perf_counter() - t0,
        }

    def renew_ranks(self, lease_s: float | None = None) -> list[dict[str, Any]]:
        args = {} if lease_s is None else {"lease_s": lease_s}
        return self._each(lambda r, c: c.call("renew", **args), self._renewers)

    @contextmanager
    def keepalive(self, every_s: float = DEFAULT_LEASE_S / 3) -> Iterator[None]:
        """Renew every rank's lease from the second connections while a long command runs."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(every_s):
                try:
                    self.renew_ranks()
                except GpumigrateError:
                    pass  # the command in progress reports the real trouble

        thread = threading.Thread(target=run, name="gm-world-renew", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _kept_alive(self) -> AbstractContextManager[None]:
        """A world renews its ranks' leases during a long command; one process's lease is its orchestrator's."""
        return nullcontext() if self.alone else self.keepalive()

    def final_ranks(
        self,
        store: str,
        key_ref: Mapping[str, str],
        *,
        parent: str | None = None,
        options: Mapping[str, Any] | None = None,
        confirm: str = "wait",
    ) -> dict[str, Any]:
        """Every frozen rank's last dirty set, then the world image to restore (a world of one: its own image,
        shipped against ``parent``). ``confirm="later"``: each rank may return before the confirmation of its cold
        chunks ends (``confirmation``: ``pending``); no target may be made ready before its verdict (``cutover.py``)."""
        extra = {"confirm": confirm} if confirm != "wait" else {}
        with self._kept_alive():
            if self.alone:
                one = self._rank0(
                    "final", store=store, key_ref=dict(key_ref), parent=parent, options=dict(options or {}), **extra
                )
                finals, image, seconds = [one], one["image"], 0.0
            else:
                mine = self._shares(options)
                finals = self._each(
                    lambda r, c: c.call("final", store=store, key_ref=dict(key_ref), options=mine[r], **extra)
                )
                world = self.compose_ranks(store, key_ref, [x["image"]["id"] for x in finals])
                image, seconds = world["image"], world["seconds"]
        pending = any(x.get("confirmation") == "pending" for x in finals)
        return {
            "image": image,
            "step": self.step,
            "ranks": finals,
            "compose_seconds": seconds,
            "bytes_dirty": sum(x["stats"]["bytes_dirty"] for x in finals),
            "confirmation": "pending" if pending else "confirmed",
        }

    def confirmed_ranks(self, images: Sequence[str]) -> list[dict[str, Any]]:
        """Rank r's verdict (``confirmed``) of the final round that committed ``images[r]`` (``cutover.py``)."""
        return self._each(lambda r, c: c.call("confirmed", image_id=images[r]))

    def _resume_quietly(self) -> None:
        try:
            self.resume_ranks()
        except GpumigrateError:
            pass  # each rank that could resume did; a lease resumes the rest

    def resume_ranks(self) -> None:
        """Resume every rank (rebuilding a torn-down group first), even if some fail; then raise the first failure."""
        self._each(lambda r, c: c.request_resume())

    def hand_over_ranks(self, target: str) -> list[dict[str, Any]]:
        """Every rank's sealed work in flight goes on at ``target`` (the restored target's service URL)."""
        return self._each(lambda r, c: c.request_hand_over(target))

    def take_back_ranks(self) -> list[dict[str, Any]]:
        """Every rank's sealed work in flight goes on at the source (a rollback); even if some fail."""
        return self._each(lambda r, c: c.request_take_back())

    def teardown_ranks(self) -> list[dict[str, Any]]:
        """Destroy every rank's communicators (frozen world; before an in-place capture)."""
        return self._each(lambda r, c: c.call("teardown"))

    def rebuild_ranks(self) -> list[dict[str, Any]]:
        """Build every rank's communicators again; all at once, as it is a rendezvous."""
        return self._each(lambda r, c: c.call("rebuild"))

    def advance_ranks(self, steps: int, *, timeout_s: float = 600.0) -> list[dict[str, Any]]:
        """Every frozen rank takes exactly ``steps`` more steps (together: they hold collectives),
        then parks again; per rank ``{"steps", "losses": [[step, loss], ...]}``."""
        with self._kept_alive():
            return self._each(lambda r, c: c.call("advance", steps=steps, timeout_s=timeout_s))

    def metrics_ranks(self, since: int = 0) -> list[dict[str, Any]]:
        return self._each(lambda r, c: c.call("metrics", since=since), self._renewers)

    def zeroize_ranks(self, *, end_parked: bool = False) -> list[dict[str, Any]]:
        return self._each(lambda r, c: c.call("zeroize", end_parked=end_parked))

    def check_key_ranks(self, key_ref: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every rank's process reads the image key ``key_ref`` names; each its ``{"key_id"}``."""
        return self._each(lambda r, c: c.call("key", key_ref=dict(key_ref)))

    # ------------------------------------------------------------------ target side
    def restore_ranks(
        self,
        store: str,
        image_id: str,
        key_ref: Mapping[str, str],
        *,
        policy: Mapping[str, str] | None = None,
        ready: bool = True,
        source: str | None = None,
        source_agent: str | None = None,
    ) -> dict[str, Any]:
        """Rank r of this (target) world loads rank r's part of world image ``image_id``, all at once.
        ``device_map``: per rank, the devices it ran on at the source and runs on here. ``source``: rank 0's agent
        on the source (one host): target rank r fills its tensors from source rank r's memory (``fill.py``), its
        agent at ``source``'s port + r, granted by source rank r's lend key sealed to target rank r's agent
        (``source_agent``: the id expected there; each rank's extends it)."""
        args: dict[str, Any] = {"store": store, "image_id": image_id, "key_ref": dict(key_ref)}
        args.update(policy=dict(policy or {}), ready=ready)
        if self.alone:
            if source is not None:
                args.update(source=source, grant=self._clients[0].lend_grant(source, expect=source_agent))
            one = self._rank0("restore", **args)
            return {"image": image_id, "ranks": [one], "device_map": [], **_sums([one])}
        lenders = rank_addresses(source, self.size) if source is not None else None
        targets = self.ranks if self.ranks is not None else self.describe()

        def restore_rank(r: int, c: AgentClient) -> Any:
            if lenders is None:
                return c.call("restore", **args, rank=r)
            grant = c.lend_grant(lenders[r], expect=source_agent)  # source rank r's lend key, sealed to this rank
            return c.call("restore", **args, rank=r, source=lenders[r], grant=grant)

        results = self._each(restore_rank)
        device_map = [
            {
                "rank": r,
                "source": (res.get("world") or {}).get("devices"),
                "target": targets[r].get("devices"),
                "source_gpus": [g.get("uuid") for g in (res.get("world") or {}).get("gpus") or []],
                "target_gpus": [g.get("uuid") for g in targets[r].get("gpus") or []],
            }
            for r, res in enumerate(results)
        ]
        return {"image": image_id, "ranks": results, "device_map": device_map, **_sums(results)}

    def ready_ranks(self, image_id: str) -> list[dict[str, Any]]:
        """Every target rank loaded (world) image ``image_id`` unready: each reports ready now, loading nothing
        (the orchestrator had the source's verdict first: ``cutover.py``)."""
        return self._each(lambda r, c: c.call("ready", image_id=image_id))


def _sums(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"bytes_loaded": sum(x["bytes_loaded"] for x in results), "seconds": max(x["seconds"] for x in results)}
