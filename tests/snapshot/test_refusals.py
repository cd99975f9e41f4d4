"""Restore refuses corrupted, forged and mismatched images, and the target stays unready."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpumigrate.agent.images import make_engine
from gpumigrate.errors import IntegrityError, SnapshotError
from gpumigrate.snapshot.errors import EnvironmentMismatchError, ImageMismatchError
from gpumigrate.snapshot.server import key_ref_arg
from gpumigrate.snapshot.server_commands import final_to, restore_from


class Flag:
    def __init__(self) -> None:
        self.history: list[bool] = []

    def __call__(self, ready: bool) -> None:
        self.history.append(ready)


def _image(store_url: str, key_env: dict[str, str], model: torch.nn.Module) -> str:
    src = make_engine()
    src.track_module("model", model)
    src.park()
    return final_to(src, store_url, key_env)["image"]["id"]


def _target(model: torch.nn.Module) -> tuple:
    flag = Flag()
    agent = make_engine(set_ready=flag)
    agent.track_module("model", model)
    return agent, flag


def _store_dir(store_url: str) -> Path:
    return Path(store_url.removeprefix("file://"))


def test_corrupted_chunk_is_refused(key_env, store_url) -> None:
    torch.manual_seed(0)
    image = _image(store_url, key_env, torch.nn.Linear(256, 256))
    # Flip one byte of every stored chunk object: encrypted + authenticated, so each fails.
    for obj in (_store_dir(store_url) / "chunks").rglob("*"):
        if obj.is_file():
            raw = bytearray(obj.read_bytes())
            raw[-20] ^= 0x01
            obj.write_bytes(bytes(raw))
    dst_model = torch.nn.Linear(256, 256)
    agent, flag = _target(dst_model)
    with pytest.raises(IntegrityError):
        restore_from(agent, store_url, image, key_env)
    assert flag.history == [False] and not agent.ready


def test_forged_manifest_is_refused(key_env, store_url) -> None:
    image = _image(store_url, key_env, torch.nn.Linear(64, 64))
    mpath = _store_dir(store_url) / "manifests" / image
    doc = json.loads(mpath.read_bytes())
    doc_text = json.dumps(doc).replace('"final": true', '"final": false')
    mpath.write_bytes(doc_text.encode())  # altered content under the same id
    agent, flag = _target(torch.nn.Linear(64, 64))
    with pytest.raises(IntegrityError):
        restore_from(agent, store_url, image, key_env)
    assert True not in flag.history


def test_wrong_key_is_refused(key_env, store_url, monkeypatch) -> None:
    from gpumigrate import transfer

    image = _image(store_url, key_env, torch.nn.Linear(64, 64))
    monkeypatch.setenv("OTHER_KEY", transfer.generate_key())
    agent, _ = _target(torch.nn.Linear(64, 64))
    with pytest.raises(IntegrityError):
        restore_from(agent, store_url, image, {"env": "OTHER_KEY"})


def test_shape_and_dtype_mismatch_is_refused(key_env, store_url) -> None:
    image = _image(store_url, key_env, torch.nn.Linear(64, 64))
    agent, flag = _target(torch.nn.Linear(64, 32))
    with pytest.raises(ImageMismatchError, match=r"model/weight: image float32\[64, 64\], model float32\[32, 64\]"):
        restore_from(agent, store_url, image, key_env)
    agent, _ = _target(torch.nn.Linear(64, 64).to(torch.bfloat16))
    with pytest.raises(ImageMismatchError, match="bfloat16"):
        restore_from(agent, store_url, image, key_env)
    agent, _ = _target(torch.nn.Sequential(torch.nn.Linear(64, 64)))
    with pytest.raises(ImageMismatchError, match="missing in image: model/0.bias"):
        restore_from(agent, store_url, image, key_env)
    assert flag.history == []  # refused before anything was touched


def test_environment_policy(key_env, store_url) -> None:
    image = _image(store_url, key_env, torch.nn.Linear(8, 8))
    agent, _ = _target(torch.nn.Linear(8, 8))
    res = restore_from(agent, store_url, image, key_env, policy={"torch": "must_match", "weights_digest": "must_match"})
    assert res["environment"]["checked"] == {"torch": "match"}
    assert res["environment"]["not_checked"] == ["weights_digest"]

    # An image recorded on another torch: refused where the plan says must_match, allowed otherwise.
    from gpumigrate import transfer

    reader = transfer.open_reader(store_url, image, key=transfer.resolve_key(env=key_env["env"]))
    meta = dict(reader.metadata()["snapshot"])
    meta["environment"] = {**meta["environment"], "torch": "1.0.0"}
    # The same chunks under a manifest (signed with the right key) whose facts say another torch.
    writer = transfer.open_writer(store_url, key=transfer.resolve_key(env=key_env["env"]))
    for r in reader.regions():
        writer.add_region(r)
        for i in range(reader.chunk_count(r.name)):
            writer.reuse_chunk(r.name, i, meta["chunks"][r.name][i])
    writer.set_metadata("snapshot", meta)
    other = writer.commit().id
    with pytest.raises(EnvironmentMismatchError, match="torch: image has '1.0.0'"):
        restore_from(agent, store_url, other, key_env, policy={"torch": "must_match"})
    assert restore_from(agent, store_url, other, key_env, policy={"torch": "may_differ"})["ready"]
    with pytest.raises(SnapshotError, match="allowed values"):
        restore_from(agent, store_url, other, key_env, policy={"torch": "sometimes"})


def test_keys_never_cross_the_wire() -> None:
    assert key_ref_arg({"env": "X"}) == {"env": "X"}
    assert key_ref_arg(None) == key_ref_arg({}) == {}  # no encryption key configured for this store
    for bad in ({"key": "00" * 32}, {"env": "X", "key": "y"}, "X", {"file": 3}):
        with pytest.raises(SnapshotError, match="never over the wire"):
            key_ref_arg(bad)
