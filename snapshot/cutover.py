"""The stop-and-copy's last steps, from the orchestrator: the target's restore beside the final round's verdict.

A frozen final round trusts no fingerprint alone: every chunk it references unchanged is confirmed by its BLAKE3
(``engine/confirmation.py``). With ``final_ranks(confirm="later")`` the source commits as soon as its dirty set
is shipped and returns, while the confirmation of its cold chunks (a model's weights) goes on. Then, here:

1. the target restores that image **unready** while the source is asked for the verdict (``confirmed``), at once;
2. every chunk confirmed: the target reports ready (``ready``, nothing loaded); a chunk caught changed: the
   target restores the follow-up image (a child of the round's, holding those chunks) with ``ready``, which
   loads only what changed. No target is ready before the verdict: a verdict that fails leaves it unready and
   the error is raised (the caller rolls back, as after any failed restore).

The source stays frozen until its verdict is taken (a ``resume`` takes it first), so undo and rollback work as
after any final round. A world of N ranks goes the same way (each rank's verdict; a world image of the
follow-ups where any rank has one); a world of one is a plain process.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpumigrate.snapshot.world import World


def verdict(world: World, store: str, key_ref: Mapping[str, str], final: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict of ``world.final_ranks``' round (``final``: its reply): the image a target may be made ready
    from. Every rank's own (``confirmed``); where one shipped a follow-up of chunks its confirmation caught, a world
    image of the follow-ups (and the other ranks' images) is composed. ``follow_up``: the image differs from the
    round's (restore it; else ``ready_ranks`` of the round's)."""
    t0 = time.perf_counter()
    if final.get("confirmation") != "pending":
        return {"image": final["image"], "follow_up": False, "caught": 0, "ranks": [], "seconds": 0.0}
    own = [x["image"]["id"] for x in final["ranks"]]
    verdicts = world.confirmed_ranks(own)
    image = final["image"]
    if any(v["follow_up"] for v in verdicts):
        images = [v["image"]["id"] for v in verdicts]
        image = verdicts[0]["image"] if world.alone else world.compose_ranks(store, key_ref, images)["image"]
    return {
        "image": image,
        "follow_up": image["id"] != final["image"]["id"],
        "caught": sum(int(v["caught"]) for v in verdicts),
        "ranks": verdicts,
        "seconds": time.perf_counter() - t0,
    }


def restore_and_ready(
    source: World,
    target: World,
    store: str,
    key_ref: Mapping[str, str],
    final: Mapping[str, Any],
    *,
    target_store: str | None = None,
    policy: Mapping[str, str] | None = None,
    fill_from: str | None = None,
) -> dict[str, Any]:
    """The target restores ``final``'s image (``source.final_ranks``' reply) and reports ready once the source's
    verdict allows it (see the module). ``target_store``: where the target reads the image (default ``store``);
    ``fill_from``: the source's rank 0 agent where the target fills from its memory (``fill.py``).

    Returns ``{"restored", "verdict", "follow_up_restored", "ready", "seconds"}``: the first restore's reply,
    the verdict, the follow-up's restore (or None) and the ``ready`` replies (or None)."""
    t0 = time.perf_counter()
    reads = target_store or store
    image = final["image"]["id"]
    if final.get("confirmation") != "pending":  # confirmed before the commit: one restore, ready
        done = target.restore_ranks(reads, image, key_ref, policy=policy, ready=True, source=fill_from)
        judged = verdict(source, store, key_ref, final)
        return {"restored": done, "verdict": judged, "follow_up_restored": None, "ready": None,
                "seconds": time.perf_counter() - t0}  # fmt: skip
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gm-verdict") as pool:
        asked = pool.submit(verdict, source, store, key_ref, final)
        try:
            done = target.restore_ranks(reads, image, key_ref, policy=policy, ready=False, source=fill_from)
        except BaseException:
            with contextlib.suppress(BaseException):
                asked.result()  # the verdict's calls end before the restore's error leaves
            raise
        judged = asked.result()  # a failed verdict raises here: the target stays unready
    follow_up, ready = None, None
    if judged["follow_up"]:  # only the chunks the confirmation caught move: the rest is loaded already
        follow_up = target.restore_ranks(reads, judged["image"]["id"], key_ref, policy=policy, ready=True)
    else:
        ready = target.ready_ranks(image)
    return {"restored": done, "verdict": judged, "follow_up_restored": follow_up, "ready": ready,
            "seconds": time.perf_counter() - t0}  # fmt: skip
