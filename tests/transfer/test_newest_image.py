"""An image URL without an id: the newest image by the signed sequence in the manifests, never by a file's mtime,
said on stderr; an older manifest put back, or a newer one removed, never passes for the newest."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from gpumigrate.errors import InvalidInputError
from gpumigrate.transfer import generate_key, pack_paths
from gpumigrate.transfer.format.chunkobj import Sealer
from gpumigrate.transfer.format.manifest import seal_manifest
from gpumigrate.transfer.latest import OlderImageError, resolve_image
from gpumigrate.transfer.stores import open_store

KEY_ENV = "GM_TEST_IMAGE_KEY"


@pytest.fixture
def env() -> dict[str, str]:
    e = dict(os.environ)  # XDG_STATE_HOME is this test's own (conftest): the record of what was served lives there
    e[KEY_ENV] = generate_key()
    e.pop("GPUMIGRATE_IMAGE_KEY", None)
    return e


def image(cli: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli, "image", *args], env=env, capture_output=True, text=True, timeout=120)


def pack_version(cli: list[str], env: dict[str, str], tmp_path: Path, store: str, text: str) -> str:
    src = tmp_path / f"weights-{text}"
    src.mkdir()
    (src / "w.txt").write_text(text)
    res = image(cli, env, "pack", str(src), "--out", store, "--key-env", KEY_ENV, "--json", "-q")
    assert res.returncode == 0, res.stderr
    return str(json.loads(res.stdout.splitlines()[-1])["image_id"])


def test_a_rollback_put_back_in_the_store_is_never_taken_as_the_newest(
    cli_cmd: list[str], env: dict[str, str], tmp_path: Path
) -> None:
    root = tmp_path / "store"
    store = f"file://{root}"
    v1 = pack_version(cli_cmd, env, tmp_path, store, "v1")
    v2 = pack_version(cli_cmd, env, tmp_path, store, "v2")

    def unpack(into: str, url: str = store) -> subprocess.CompletedProcess[str]:
        return image(cli_cmd, env, "unpack", url, str(tmp_path / into), "--key-env", KEY_ENV, "--json", "-q")

    took = unpack("a")
    assert took.returncode == 0, took.stderr
    assert f"no image id given: took {v2}" in took.stderr  # says which one it took
    assert json.loads(took.stdout.splitlines()[-1])["resolved"]["image_id"] == v2
    assert (tmp_path / "a" / "weights-v2" / "w.txt").read_text() == "v2"

    # The attacker writes v1's manifest back, newer than anything by mtime.
    old = root / "manifests" / v1
    data = old.read_bytes()
    old.unlink()
    old.write_bytes(data)
    future = time.time() + 3600
    os.utime(old, (future, future))
    again = unpack("b")
    assert again.returncode == 0 and f"took {v2}" in again.stderr
    assert (tmp_path / "b" / "weights-v2" / "w.txt").read_text() == "v2"

    # ... and removes v2: the store's newest is now older than one it already served.
    (root / "manifests" / v2).unlink()
    refused = unpack("c")
    assert refused.returncode == 2, refused.stderr
    assert "older than" in refused.stderr and v1[:16] in refused.stderr and "by id" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "c").exists()
    for verb in (["verify", store], ["push", store, f"file://{tmp_path / 'dst'}"]):
        res = image(cli_cmd, env, *verb, "--key-env", KEY_ENV, "-q")
        assert res.returncode == 2 and "older than" in res.stderr, (verb, res.stderr)

    # Named by id, the older image is an explicit choice, and is taken.
    chosen = unpack("d", f"{store}#{v1}")
    assert chosen.returncode == 0, chosen.stderr
    assert (tmp_path / "d" / "weights-v1" / "w.txt").read_text() == "v1"


def _legacy(store: str, key: bytes, created: str, text: str, tmp_path: Path) -> str:
    """An image as a writer before ``sequence`` made it: its body re-signed without the field."""
    src = tmp_path / f"legacy-{text}"
    src.mkdir()
    (src / "w.txt").write_text(text)
    ref = pack_paths([src], store, key=key)
    st = open_store(store)
    body = json.loads(st.get_manifest(ref.id))["body"]
    del body["sequence"]
    body["created"] = created
    image_id, data = seal_manifest(body, Sealer(key))
    st.put_manifest(image_id, data)
    (Path(store[len("file://") :]) / "manifests" / ref.id).unlink()
    return image_id


def test_older_manifests_without_a_sequence_rank_below_every_one_with_it(tmp_path: Path, key: bytes) -> None:
    store = f"file://{tmp_path / 'store'}"
    old = _legacy(store, key, "2001-01-01T00:00:00Z", "old", tmp_path)
    older_but_late = _legacy(store, key, "2099-01-01T00:00:00Z", "late", tmp_path)
    st = open_store(store)
    found = resolve_image(st, None, Sealer(key))  # only legacy manifests: the newest signed `created` wins
    assert (found.image_id, found.sequence, found.how) == (older_but_late, None, "newest")
    src = tmp_path / "now"
    src.mkdir()
    (src / "w.txt").write_text("now")
    current = pack_paths([src], store, key=key).id
    found = resolve_image(st, "latest", Sealer(key))
    assert found.image_id == current and found.sequence is not None and found.candidates == 3
    assert old != current


def test_manifests_that_do_not_verify_are_passed_over_and_counted(tmp_path: Path, key: bytes) -> None:
    store = f"file://{tmp_path / 'store'}"
    src = tmp_path / "in"
    src.mkdir()
    (src / "w.txt").write_text("mine")
    mine = pack_paths([src], store, key=key).id
    st = open_store(store)
    forged = json.loads(st.get_manifest(mine))["body"]
    forged["sequence"] = 1 << 62  # the largest sequence in the store, signed with someone else's key
    forged_id, data = seal_manifest(forged, Sealer(os.urandom(32)))
    st.put_manifest(forged_id, data)
    found = resolve_image(st, None, Sealer(key))
    assert (found.image_id, found.skipped, found.candidates) == (mine, 1, 1)
    with pytest.raises(InvalidInputError, match="none of the 2 images"):
        resolve_image(st, None, Sealer(os.urandom(32)))  # a key that verifies nothing takes nothing


def test_a_store_that_lost_its_newest_image_is_refused_in_process_too(tmp_path: Path, key: bytes) -> None:
    store = f"file://{tmp_path / 'store'}"
    ids = []
    for text in ("one", "two"):
        src = tmp_path / text
        src.mkdir()
        (src / "w.txt").write_text(text)
        ids.append(pack_paths([src], store, key=key).id)
    st = open_store(store)
    assert resolve_image(st, None, Sealer(key)).image_id == ids[1]
    (tmp_path / "store" / "manifests" / ids[1]).unlink()
    with pytest.raises(OlderImageError) as refused:
        resolve_image(st, None, Sealer(key))
    assert refused.value.exit_code == 2
    assert resolve_image(st, ids[0], Sealer(key)).how == "id"  # by id: taken
    assert resolve_image(st, ids[0][:8], Sealer(key)).how == "prefix"
