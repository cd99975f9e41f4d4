"""Attacks by someone who can write into a store or an output directory, never holding the key: links planted
where the store's directories and objects belong, a link in an unpack's output, and image ids that walk out of
the store. Each runs the real CLI (or the receiver) as a user would; nothing outside may change."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import blake3
import pytest

from gpumigrate.errors import IntegrityError
from gpumigrate.transfer import generate_key, open_reader, pack_paths, push, serve_stream
from gpumigrate.transfer.stores import InvalidIdError, open_store

KEY_ENV = "GM_TEST_IMAGE_KEY"
HEX = "0123456789abcdef"


@pytest.fixture
def env(gm_home: Path) -> dict[str, str]:
    e = dict(os.environ)
    e[KEY_ENV] = generate_key()
    e.pop("GPUMIGRATE_IMAGE_KEY", None)
    return e


def image(cli: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli, "image", *args], env=env, capture_output=True, text=True, timeout=120)


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file below ``root`` (not following links) with its mode and content: what an attack must not change."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = (st.st_mode, b"" if stat.S_ISDIR(st.st_mode) else path.read_bytes())
    return out


def victim_dir(tmp_path: Path) -> Path:
    """A directory outside every store, holding files named like chunks and like a writer's leftovers."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for prefix in ("00", "3f", "a7", "ff"):
        (outside / (prefix + "1" * 62)).write_bytes(b"not a chunk: the owner's file")
    (outside / ".keep.123.tmp").write_bytes(b"looks like a temp file a writer left")
    outside.chmod(0o700)
    return outside


def small_tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(3 << 20))
    (src / "config.json").write_text('{"layers": 2}\n')
    return src


@pytest.mark.parametrize("planted", ["every chunks/XX", "manifests"])
def test_pack_into_a_store_with_planted_links_writes_nothing_outside(
    cli_cmd: list[str], env: dict[str, str], tmp_path: Path, planted: str
) -> None:
    outside = victim_dir(tmp_path)
    before = snapshot(outside)
    store = tmp_path / "store"
    (store / "chunks").mkdir(parents=True)
    if planted == "manifests":
        os.symlink(outside, store / "manifests")
    else:  # the attacker cannot know the ids, so every fan-out directory leads out
        for a in HEX:
            for b in HEX:
                os.symlink(outside, store / "chunks" / (a + b))
    res = image(cli_cmd, env, "pack", str(small_tree(tmp_path)), "--out", f"file://{store}", "--key-env", KEY_ENV)
    assert res.returncode == 1, res.stderr
    assert "symbolic link" in res.stderr and "refusing to follow it" in res.stderr
    assert "Traceback" not in res.stderr
    assert snapshot(outside) == before
    assert not (store / "manifests").is_dir() or planted == "manifests"  # no image was made


def test_a_link_planted_at_an_object_name_is_replaced_never_written_through(tmp_path: Path, key: bytes) -> None:
    """The attacker plants a link where a chunk will land (ids of known content can be computed): the writer
    treats it as absent, and the rename that installs the chunk replaces the link itself."""
    from gpumigrate.transfer.format.chunkobj import chunk_id_of
    from gpumigrate.transfer.pack import CDC_MIN

    outside = victim_dir(tmp_path)
    before = snapshot(outside)
    # Below FastCDC's minimum the file is exactly one chunk whose id the attacker computes; a 1 MiB file could
    # be cut in two (random content), and then no chunk lands on the planted name at all.
    data = os.urandom(CDC_MIN // 2)
    cid = chunk_id_of(data)
    store = tmp_path / "store"
    (store / "chunks" / cid[:2]).mkdir(parents=True)
    os.symlink(outside / ("00" + "1" * 62), store / "chunks" / cid[:2] / cid)
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    ref = pack_paths([f], f"file://{store}", key=key)
    assert snapshot(outside) == before
    assert not (store / "chunks" / cid[:2] / cid).is_symlink()
    assert bytes(open_reader(f"file://{store}", ref.id, key=key).read_region("f.bin")) == data
    # a read through a link is refused too: the same link planted again, then read
    os.replace(store / "chunks" / cid[:2] / cid, tmp_path / "moved")
    os.symlink(tmp_path / "moved", store / "chunks" / cid[:2] / cid)
    with pytest.raises(IntegrityError, match="symbolic link"):
        open_store(f"file://{store}").get_chunk(cid)


def test_a_receiver_never_deletes_or_writes_through_a_link_in_its_store(
    gm_home: Path, tmp_path: Path, key: bytes
) -> None:
    """The receiver's start-up check removes leftovers and chunks that fail verification; with every fan-out
    directory of its store linked outside, it must delete nothing there, and a push must write nothing there."""
    outside = victim_dir(tmp_path)
    before = snapshot(outside)
    store = tmp_path / "recv" / "store"
    (store / "chunks").mkdir(parents=True)
    for a in HEX:
        for b in HEX:
            os.symlink(outside, store / "chunks" / (a + b))
    local = f"file://{tmp_path / 'local'}"
    ref = pack_paths([small_tree(tmp_path)], local, key=key)
    receiver = serve_stream("127.0.0.1:0", f"file://{store}", key=key)
    try:
        with pytest.raises(IntegrityError, match="symbolic link"):
            push(local, receiver.url, ref.id, key=key)  # the receiver rejects every chunk, naming the link
        assert receiver.stats()["chunks_present"] == 0  # its check ran (the push waited for it) and listed nothing
    finally:
        receiver.close()
    assert snapshot(outside) == before


def test_unpack_never_chmods_or_writes_through_a_link_in_the_output(
    cli_cmd: list[str], env: dict[str, str], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    (src / "data" / "empty").mkdir(parents=True)
    (src / "data" / "w.bin").write_bytes(os.urandom(1 << 16))
    (src / "data" / "empty").chmod(0o777)
    store = f"file://{tmp_path / 'store'}"
    packed = image(cli_cmd, env, "pack", str(src / "data"), "--out", store, "--key-env", KEY_ENV, "--json", "-q")
    assert packed.returncode == 0, packed.stderr
    image_id = json.loads(packed.stdout.splitlines()[-1])["image_id"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / "owned").write_text("the owner's")
    before = snapshot(elsewhere)
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    os.symlink(elsewhere, out / "data" / "empty")
    res = image(cli_cmd, env, "unpack", f"{store}#{image_id}", str(out), "--key-env", KEY_ENV, "-q")
    assert res.returncode == 1 and "through the symlink" in res.stderr and "Traceback" not in res.stderr
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o700 and snapshot(elsewhere) == before
    assert sorted(p.name for p in (out / "data").iterdir()) == ["empty"]  # refused before anything moved


def test_unpack_gives_modes_only_to_what_it_created(cli_cmd: list[str], env: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "data" / "sub").mkdir(parents=True)
    (src / "data" / "sub" / "w.bin").write_bytes(os.urandom(1 << 12))
    (src / "data").chmod(0o777)
    (src / "data" / "sub").chmod(0o750)
    store = f"file://{tmp_path / 'store'}"
    packed = image(cli_cmd, env, "pack", str(src / "data"), "--out", store, "--key-env", KEY_ENV, "--json", "-q")
    image_id = json.loads(packed.stdout.splitlines()[-1])["image_id"]
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True, mode=0o700)  # the operator's own directory, private
    (out / "data").chmod(0o700)
    res = image(cli_cmd, env, "unpack", f"{store}#{image_id}", str(out), "--key-env", KEY_ENV, "-q")
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE((out / "data").stat().st_mode) == 0o700  # not opened to 0777
    assert stat.S_IMODE((out / "data" / "sub").stat().st_mode) == 0o750  # made by the unpack: the image's mode
    assert (out / "data" / "sub" / "w.bin").read_bytes() == (src / "data" / "sub" / "w.bin").read_bytes()


def test_an_image_id_that_walks_out_of_the_store_is_refused_naming_the_rule(
    cli_cmd: list[str], env: dict[str, str], tmp_path: Path, key: bytes
) -> None:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("the owner's secret\n")
    store = tmp_path / "store"
    pack_paths([small_tree(tmp_path)], f"file://{store}", key=key)
    walk = "./" * 20 + "../../outside/secret.txt"  # 64 characters, from store/manifests/ to the secret
    assert len(walk) == 64 and (store / "manifests" / walk).resolve() == secret.resolve()
    digest = blake3.blake3(secret.read_bytes()).hexdigest()
    for args in (
        ["verify", f"file://{store}#{walk}", "--key-env", KEY_ENV],
        ["unpack", f"file://{store}#{walk}", str(tmp_path / "out"), "--key-env", KEY_ENV],
        ["push", f"file://{store}#{walk}", f"file://{tmp_path / 'dst'}", "--key-env", KEY_ENV],
        ["pack", str(tmp_path / "src"), "--out", f"file://{store}", "--parent", walk, "--key-env", KEY_ENV],
    ):
        res = image(cli_cmd, env, *args)
        assert res.returncode == 2, (args, res.stderr)
        assert "^[0-9a-f]{64}$" in res.stderr and "Traceback" not in res.stderr
        assert digest[:8] not in res.stderr and "secret" not in res.stderr.replace("secret.txt", "")
    assert not (tmp_path / "out").exists() and not (tmp_path / "dst").exists()
    # the library's entry points refuse it the same way, before any path is touched
    for call in (
        lambda: open_reader(f"file://{store}", walk, key=key),
        lambda: open_store(f"file://{store}").get_manifest(walk),
        lambda: open_store(f"file://{store}").chunk_size(walk),
        lambda: open_store(f"file://{store}").put_manifest(walk, b"{}"),
    ):
        with pytest.raises(InvalidIdError, match=r"\^\[0-9a-f\]\{64\}\$"):
            call()
    assert secret.read_text() == "the owner's secret\n"
