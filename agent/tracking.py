"""What ``attach()`` tracks: the user's model or tensors, optimizer(s), LR scheduler(s) and ``state`` dict,
as agent items.

Everything is captured from, and restored into, the user's own objects: a module's parameters and
buffers are copied into in place (same storage), an optimizer and an LR scheduler are loaded with
``load_state_dict`` (same object), the tensors of ``state`` are copied into in place and its plain
values are put back into that very dict. So every reference the user's program holds stays valid
across a restore.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot import tracked as tr

ALLOWED_OBJECTS = "a torch.nn.Module (a Hugging Face model or a LightningModule included) or a dict[str, torch.Tensor]"
ALLOWED_VALUES = "torch.Tensor, torch.Generator, or a JSON value (number, string, bool, None, list, dict)"
RESERVED = ("optimizer", "lr_scheduler", "state", "state.plain", "rng", "progress", "lightning", "work")
ALLOWED_SCHEDULERS = "a torch.optim.lr_scheduler scheduler (an LRScheduler or ReduceLROnPlateau) or a list of them"


def model_item(obj: Any, name: str) -> tr.Item:
    """The tracked item for ``attach()``'s first argument; TypeError names what is allowed."""
    if isinstance(obj, torch.nn.Module):
        return tr.ModuleItem(name, obj)
    if isinstance(obj, dict):
        bad = [k for k, v in obj.items() if not isinstance(k, str) or not k or not isinstance(v, torch.Tensor)]
        if not bad:
            return tr.TensorsItem(name, lambda: obj)  # read at each capture: the user's very dict
        raise TypeError(
            f"attach() takes {ALLOWED_OBJECTS}; this dict has entries that are not str -> torch.Tensor: "
            + ", ".join(repr(k)[:40] for k in bad[:5])
        )
    raise TypeError(f"attach() takes {ALLOWED_OBJECTS}; got {type(obj).__module__}.{type(obj).__qualname__}")


def optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, Sequence) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer):
        return list(optimizer)
    raise TypeError(
        f"attach(optimizer=...) takes a torch.optim.Optimizer or a list of them; got {type(optimizer).__qualname__}"
    )


def optimizer_items(opts: list[torch.optim.Optimizer]) -> list[tr.Item]:
    if len(opts) == 1:
        return [tr.OptimizerItem("optimizer", opts[0])]
    return [tr.OptimizerItem(f"optimizer{i}", opt) for i, opt in enumerate(opts)]


def _is_scheduler(obj: Any) -> bool:
    from torch.optim import lr_scheduler

    return isinstance(obj, lr_scheduler.LRScheduler | lr_scheduler.ReduceLROnPlateau)


def schedulers(lr_scheduler: Any) -> list[Any]:
    """``attach(lr_scheduler=...)`` as a list; TypeError names what is allowed."""
    if lr_scheduler is None:
        return []
    found = list(lr_scheduler) if isinstance(lr_scheduler, Sequence) else [lr_scheduler]
    bad = [s for s in found if not _is_scheduler(s)]
    if bad or not found:
        got = type(bad[0]).__qualname__ if bad else "an empty list"
        raise TypeError(f"attach(lr_scheduler=...) takes {ALLOWED_SCHEDULERS}; got {got}")
    return found


def scheduler_items(scheds: list[Any]) -> list[tr.Item]:
    """A scheduler's ``state_dict`` as JSON (its step count, last LRs, a plateau's best value...): without it a
    moved job's schedule restarts from epoch 0 while its optimizer carries the decayed LR (a silent change)."""
    if len(scheds) == 1:
        return [_scheduler_item("lr_scheduler", scheds[0])]
    return [_scheduler_item(f"lr_scheduler{i}", s) for i, s in enumerate(scheds)]


def _scheduler_item(name: str, sched: Any) -> tr.Item:
    def get() -> dict[str, Any]:
        state = sched.state_dict()
        for key, value in state.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise SnapshotError(
                    f"{name} ({type(sched).__qualname__}) holds {key!r} = a {type(value).__qualname__}: a scheduler's "
                    "state travels as JSON values only (numbers, strings, bools, None, lists, dicts)"
                ) from None
        return dict(state)

    return tr.json_blob(name, get, sched.load_state_dict)


def _check_value(key: str, value: Any) -> None:
    if isinstance(value, torch.Tensor | torch.Generator):
        return
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"state[{key!r}] is a {type(value).__qualname__}: values in state are {ALLOWED_VALUES}"
        ) from None


def state_items(state: Any) -> list[tr.Item]:
    """Items for the ``state`` dict: its tensors (restored in place) and its plain values and
    generators (one JSON blob, put back into the same dict)."""
    if state is None:
        return []
    if not isinstance(state, MutableMapping):
        raise TypeError(f"attach(state=...) takes a dict; got {type(state).__qualname__}")
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"state keys are non-empty strings; got {key!r}")
        _check_value(key, value)
    tensors = tr.TensorsItem("state", lambda: {k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return [tensors, tr.json_blob("state.plain", _plain_getter(state), _plain_setter(state))]


def _plain_getter(state: MutableMapping[str, Any]) -> Callable[[], dict[str, Any]]:
    def get() -> dict[str, Any]:
        values: dict[str, Any] = {}
        generators: dict[str, dict[str, str]] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                continue
            if isinstance(value, torch.Generator):
                generators[key] = {"device": str(value.device), "state": value.get_state().numpy().tobytes().hex()}
                continue
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise SnapshotError(
                    f"state[{key!r}] became a {type(value).__qualname__}: values in state are {ALLOWED_VALUES}"
                ) from None
            values[key] = value
        return {"values": values, "generators": generators}

    return get


def _plain_setter(state: MutableMapping[str, Any]) -> Callable[[Any], None]:
    def put(blob: Any) -> None:
        values, generators = blob["values"], blob["generators"]
        for key in [k for k, v in state.items() if not isinstance(v, torch.Tensor | torch.Generator)]:
            if key not in values:
                del state[key]
        state.update(values)
        for key, g in generators.items():
            raw = torch.frombuffer(bytearray(bytes.fromhex(g["state"])), dtype=torch.uint8)
            gen = state.get(key)
            if not isinstance(gen, torch.Generator):
                gen = state[key] = torch.Generator(device=g["device"])
            gen.set_state(raw)

    return put


def written_regions(state: Any, written: Any) -> dict[str, Callable[[], Any]]:
    """``attach(written=...)`` as region -> report: each key a tensor of ``state``, each value callable."""
    if written is None:
        return {}
    if not isinstance(written, Mapping):
        raise TypeError(f"attach(written=...) takes a dict of state key -> callable; got {type(written).__qualname__}")
    tensors = sorted(k for k, v in (state or {}).items() if isinstance(v, torch.Tensor))
    out: dict[str, Callable[[], Any]] = {}
    for key, report in written.items():
        if key not in tensors:
            raise TypeError(
                f"attach(written={{{key!r}: ...}}): {key!r} is not a tensor of state; its tensors are: "
                + (", ".join(tensors) or "none")
            )
        if not callable(report):
            raise TypeError(f"attach(written={{{key!r}: ...}}) takes a callable returning (offset, length) ranges")
        out[f"state/{key}"] = report
    return out
