"""What the agent captures: modules, optimizers, named tensors and opaque state, as named regions.

Every tracked item answers three questions: which tensors hold its state now (capture), which
pre-allocated tensors the image's bytes go into (restore, straight onto the right device and dtype),
and what small JSON metadata rides along (optimizer hyper-parameters, step counters). Opaque state
(RNG states, counters) is a getter/setter pair whose value travels as a ``blob`` region.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from gpumigrate.errors import SnapshotError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtensor() -> type[DTensor] | None:
    """torch's DTensor class (FSDP2 and tensor-parallel parameters), None where torch.distributed is absent."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes travel: a DTensor's local shard (the very storage the DTensor uses, so a restore
    into it lands in place), anything else itself. A rank of an FSDP2 job carries its own shards only."""
    dtensor = _dtensor()
    if dtensor is None or not isinstance(t, dtensor):
        return t
    with torch.no_grad():  # the local tensor itself, not an autograd view of it
        local: torch.Tensor = t.to_local()
    return local


def like_shard(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor sharded like ``param`` where ``param`` is one and ``local`` has its local shape (an
    optimizer moment of an FSDP2 parameter); else ``local``."""
    dtensor = _dtensor()
    if dtensor is None or not isinstance(param, dtensor) or local.shape != local_part(param).shape:
        return local
    wrapped: torch.Tensor = dtensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return wrapped


class Item:
    """Base of tracked items. ``prefix`` namespaces region names (``prefix/...``)."""

    prefix: str

    def tensors(self) -> dict[str, torch.Tensor]:
        """The region names and tensors of this item's state now. Callers never change the mapping: an item may hand
        out the same one while nothing changed (``ModuleItem``), and the tracker then reuses all it made of it."""
        raise NotImplementedError

    def meta(self) -> dict[str, Any]:
        return {}

    def targets(self, regions: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Destination tensors for restore, keyed like :meth:`tensors`. Default: the live tensors."""
        return self.tensors()

    def after_restore(self, meta: Mapping[str, Any], loaded: Mapping[str, torch.Tensor]) -> None:
        return None


class TensorsItem(Item):
    def __init__(self, prefix: str, getter: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self.prefix = prefix
        self._get = getter

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{self.prefix}/{k}" if k else self.prefix: t for k, t in self._get().items()}


def _fully_sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) shards any part of ``module``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


class ModuleItem(Item):
    """Parameters and buffers of an ``nn.Module``, restored in place (same storage the model uses).

    ``state_dict()`` walks every module through its hooks and detaches every tensor: most of a round's bookkeeping
    for a model of 500 tensors, paid again in the frozen final round (downtime) and the target's final restore. Its
    result is kept and handed out again (the same mapping) while :func:`_layout` of the module is the same (the same modules, and
    parameters and buffers of the same objects, storage, dtype, shape and strides), which costs a fraction of it.
    A module whose state dict anything customises (hooks, an extra state, its own ``state_dict``) is asked each time.

    An FSDP2 module's ``state_dict()`` is not a read: its hook puts the sharded parameters back in the module,
    which inside a training step (parameters gathered for the forward or backward) breaks that step. So such a
    module is read only while the workload is parked (``parked``, set by the tracker: frozen, or a target awaiting
    its state) and at attach; a live round in between takes the tensors of that last read. They stay the module's:
    FSDP2 keeps each parameter's local shard in one storage for the module's life, updated in place by the
    optimizer (torch's own comment in ``FSDPParam.reset_sharded_param``), and a frozen round reads afresh.
    """

    def __init__(self, prefix: str, module: torch.nn.Module) -> None:
        self.prefix = prefix
        self.module = module
        self.parked: Callable[[], bool] = lambda: False
        self._layout: tuple[Any, ...] | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._last: dict[str, torch.Tensor] | None = self._read() if _fully_sharded(module) else None

    def _read(self) -> dict[str, torch.Tensor]:
        state = self.module.state_dict()
        return {f"{self.prefix}/{k}": local_part(v) for k, v in state.items() if isinstance(v, torch.Tensor)}

    def tensors(self) -> dict[str, torch.Tensor]:
        if self._last is not None:  # FSDP2: read only while parked (see above)
            if self.parked():
                self._last = self._read()
            return dict(self._last)
        layout = _layout(self.module)
        if layout is not None and layout == self._layout:
            return self._tensors  # the very mapping of the last call: the tracker knows it (Item.tensors)
        found = self._read()
        self._layout, self._tensors = layout, found
        return found


_PLAIN_STATE_DICT = (
    torch.nn.Module.state_dict,
    torch.nn.Module._save_to_state_dict,
    torch.nn.Module.get_extra_state,
)


def _layout(module: torch.nn.Module) -> tuple[Any, ...] | None:
    """What ``module.state_dict()`` is made of, cheaply: each module's identity, then each parameter's and buffer's
    name, identity, address, dtype, shape and strides (and whether a buffer is persistent). None for a module
    whose state dict something customises: its state dict must be asked for. (Asked of a 500-tensor model in
    every frozen round and every restore: hence the local names and no work for what a module lacks.)"""
    parts: list[Any] = []
    append = parts.append
    stack = [module]
    pop = stack.pop
    while stack:
        mod = pop()
        cls = type(mod)
        custom = (cls.state_dict, cls._save_to_state_dict, cls.get_extra_state) != _PLAIN_STATE_DICT
        if custom or mod._state_dict_hooks or mod._state_dict_pre_hooks:
            return None
        append(id(mod))
        for name, p in mod._parameters.items():
            append((name, None) if p is None else (name, id(p), p.data_ptr(), p.dtype, p.shape, p.stride()))
        buffers = mod._buffers
        if buffers:
            skip = mod._non_persistent_buffers_set
            for name, b in buffers.items():
                if b is not None:
                    append((name, id(b), b.data_ptr(), b.dtype, b.shape, b.stride(), name not in skip))
        children = mod._modules
        if children:
            stack.extend([m for m in reversed(children.values()) if m is not None])
        append(len(children))
    return tuple(parts)


class OptimizerItem(Item):
    """An optimizer's per-parameter state tensors plus its param groups (JSON metadata).

    On a fresh target the optimizer has no state yet (Adam allocates lazily): :meth:`targets`
    allocates it on each parameter's device, and :meth:`after_restore` loads it with
    ``load_state_dict`` so the next step continues exactly where the source stopped.
    """

    def __init__(self, prefix: str, optimizer: torch.optim.Optimizer) -> None:
        self.prefix = prefix
        self.optimizer = optimizer
        self._restoring: dict[str, torch.Tensor] = {}  # region -> the state value it becomes (a DTensor's wrapper)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _values(self) -> dict[str, torch.Tensor]:
        """The state tensors by region name, as the optimizer holds them (DTensors for sharded parameters)."""
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self._params()):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{self.prefix}/state/{i}/{key}"] = value
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: local_part(v) for k, v in self._values().items()}

    def meta(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
        scalars = {
            str(i): {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)} for i, st in sd["state"].items()
        }
        return {"param_groups": groups, "scalars": scalars}

    def targets(self, regions: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        live = self._values()
        params = self._params()
        out: dict[str, torch.Tensor] = {}
        self._restoring = {}
        for name, info in regions.items():
            if not name.startswith(self.prefix + "/state/"):
                continue
            if name in live:
                self._restoring[name] = live[name]
                out[name] = local_part(live[name])
                continue
            index = int(name.split("/")[-2])
            if index >= len(params):
                raise SnapshotError(
                    f"image has optimizer state for parameter {index}; this optimizer has {len(params)}"
                )
            # 'step' lives on the CPU in torch's optimizers unless capturable/fused; keep the source's placement.
            device = params[index].device if (info.device or "cpu") != "cpu" else torch.device("cpu")
            out[name] = torch.empty(info.shape or (), dtype=DTYPES[info.dtype], device=device)
            # A moment of an FSDP2 parameter is sharded like it: the bytes land in its local shard.
            self._restoring[name] = like_shard(params[index], out[name])
        return out

    def after_restore(self, meta: Mapping[str, Any], loaded: Mapping[str, torch.Tensor]) -> None:
        state: dict[int, dict[str, Any]] = {}
        for name, tensor in loaded.items():
            _, _, index, key = name.rsplit("/", 3)
            state.setdefault(int(index), {})[key] = self._restoring.get(name, tensor)
        for index, scalars in (meta.get("scalars") or {}).items():
            state.setdefault(int(index), {}).update(scalars)
        groups = [dict(g) for g in meta["param_groups"]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


class BlobItem(Item):
    """Opaque state through a getter/setter pair; the value is bytes on the wire."""

    def __init__(self, name: str, getter: Callable[[], bytes], setter: Callable[[bytes], None]) -> None:
        self.prefix = name
        self._get = getter
        self._set = setter

    def tensors(self) -> dict[str, torch.Tensor]:
        data = bytes(self._get())
        return {
            self.prefix: torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        }

    def targets(self, regions: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        info = regions[self.prefix]
        return {self.prefix: torch.empty(info.nbytes, dtype=torch.uint8)}

    def after_restore(self, meta: Mapping[str, Any], loaded: Mapping[str, torch.Tensor]) -> None:
        self._set(loaded[self.prefix].numpy().tobytes())


def json_blob(name: str, getter: Callable[[], Any], setter: Callable[[Any], None]) -> BlobItem:
    """A BlobItem whose value is JSON (never pickle: restoring must not run code from an image)."""
    return BlobItem(
        name,
        lambda: json.dumps(getter(), sort_keys=True).encode(),
        lambda raw: setter(json.loads(raw.decode())),
    )


def rng_items(prefix: str = "rng", *, cuda_devices: list[int] | None = None) -> list[BlobItem]:
    """Torch CPU/CUDA, numpy and Python ``random`` generator states, so the next step draws the same numbers.

    ``cuda_devices``: carry the CUDA generators of these devices only, by position (a rank's own
    GPU): on the target they go to the devices the target rank uses, which may have other indices
    (a world restored onto GPUs 1,0 instead of 0,1). Default: every device's, by index."""
    items = [
        BlobItem(
            f"{prefix}/torch",
            lambda: torch.get_rng_state().numpy().tobytes(),
            lambda raw: torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8)),
        ),
        json_blob(
            f"{prefix}/python",
            lambda: _py_state_to_json(random.getstate()),
            lambda v: random.setstate((v[0], tuple(v[1]), v[2])),
        ),
    ]
    try:
        import numpy as np

        items.append(
            json_blob(
                f"{prefix}/numpy",
                lambda: _np_state_to_json(np.random.get_state()),
                lambda v: np.random.set_state((v[0], np.array(v[1], dtype=np.uint32), v[2], v[3], v[4])),
            )
        )
    except ImportError:  # numpy is optional for the agent
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = list(range(torch.cuda.device_count())) if cuda_devices is None else list(cuda_devices)

        def get_cuda() -> bytes:
            return b"".join(torch.cuda.get_rng_state(d).numpy().tobytes() for d in devices)

        def set_cuda(raw: bytes) -> None:
            size = len(raw) // max(1, len(devices))
            for i, d in enumerate(devices):
                torch.cuda.set_rng_state(
                    torch.frombuffer(bytearray(raw[i * size : (i + 1) * size]), dtype=torch.uint8), d
                )

        if devices:
            items.append(BlobItem(f"{prefix}/cuda", get_cuda, set_cuda))
    return items


def _np_state_to_json(state: dict[str, Any] | tuple[Any, ...]) -> list[Any]:
    if isinstance(state, dict):  # only for a bit generator other than MT19937, which np.random's own never is
        raise SnapshotError(f"numpy's global random state uses {state.get('bit_generator')}: only MT19937 is tracked")
    name, keys, pos, has_gauss, cached = state
    return [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


def _py_state_to_json(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]
