"""What one round learns about the tracked regions is reused by the next (engine/tracking.py, tracked.py) only while
it still describes them: a frozen round and a target's final restore ask a model for its state dict, views and
region descriptions no more, and a tensor replaced, swapped or reshaped between rounds is seen and shipped."""

from __future__ import annotations

from typing import Any

import torch

from gpumigrate.agent.images import make_engine
from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.engine.tracking import Tracker
from gpumigrate.snapshot.server_commands import final_to, precopy_to, restore_from


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.register_buffer("count", torch.zeros(3))
        self.register_buffer("scratch", torch.zeros(5), persistent=False)


def test_unchanged_tensors_keep_their_views_and_descriptions() -> None:
    net = Net()
    kv = {"cache": torch.zeros(64)}
    tracker = Tracker()
    tracker.track_module("model", net)
    tracker.track_tensors("state", lambda: kv)
    _, views, infos = tracker.regions()
    assert "model/scratch" not in views  # a non-persistent buffer is not state, cached or not
    _, again, again_infos = tracker.regions()
    assert all(again[n] is views[n] and again_infos[n] is infos[n] for n in views)


def test_replaced_swapped_and_reshaped_tensors_are_seen() -> None:
    net = Net()
    kv = {"cache": torch.zeros(64)}
    tracker = Tracker()
    tracker.track_module("model", net)
    tracker.track_tensors("state", lambda: kv)
    _, views, _ = tracker.regions()
    net.b.weight = torch.nn.Parameter(torch.ones(4, 16))  # a new parameter object
    net.a.bias.data = torch.full((16,), 2.0)  # the same parameter, new storage
    kv["cache"] = torch.zeros(8, 8)  # the user's dict holds a new tensor
    net.register_buffer("extra", torch.ones(2))  # a new buffer
    _, now, infos = tracker.regions()
    assert (
        now["model/b.weight"].data_ptr() == net.b.weight.data_ptr()
        and now["model/b.weight"] is not views["model/b.weight"]
    )
    assert now["model/a.bias"].data_ptr() == net.a.bias.data_ptr()
    assert infos["state/cache"].shape == (8, 8)
    assert "model/extra" in now
    _, again, _ = tracker.regions()
    assert all(again[n] is now[n] for n in now)  # and the new layout is reused in turn


def test_a_module_whose_state_dict_is_customised_is_asked_every_time() -> None:
    net = Net()
    calls: list[int] = []

    def hook(module: Any, state: dict[str, Any], prefix: str, local: Any) -> None:
        calls.append(1)

    net.register_state_dict_post_hook(lambda m, sd, prefix, local: hook(m, sd, prefix, local))
    item = tr.ModuleItem("model", net)
    item.tensors()
    item.tensors()
    assert len(calls) == 2


def test_a_parameter_replaced_between_rounds_ships_and_restores(key_env: dict[str, str], store_url: str) -> None:
    """Round 1 captures the model; then a parameter is replaced by a new one (new storage) and the workload freezes:
    the final round ships the new bytes, and a target restores them."""
    torch.manual_seed(0)
    src_net, dst_net = Net(), Net()
    src = make_engine()
    src.track_module("model", src_net)
    precopy_to(src, store_url, key_env)
    src_net.b.weight = torch.nn.Parameter(torch.full((4, 16), 7.0))
    src.park()
    final = final_to(src, store_url, key_env)
    assert final["stats"]["chunks_dirty"] >= 1
    dst = make_engine()
    dst.track_module("model", dst_net)
    restore_from(dst, store_url, final["image"]["id"], key_env)
    for (name, a), b in zip(src_net.state_dict().items(), dst_net.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
