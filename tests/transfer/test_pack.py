"""pack_paths/unpack: trees, modes, symlinks, content-defined chunking, float sniffing, path safety."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
from transfer_helpers import bf16_weights

from gpumigrate.errors import IntegrityError, NotFoundError
from gpumigrate.interfaces import RegionInfo
from gpumigrate.transfer import open_reader, open_writer, pack_paths, unpack


def make_tree(root: Path) -> Path:
    src = root / "job"
    (src / "criu" / "pages").mkdir(parents=True)
    (src / "empty-dir").mkdir()
    (src / "criu" / "pages" / "pages-1.img").write_bytes(os.urandom(2 << 20) + bytes(1 << 20))
    (src / "criu" / "core.img").write_bytes(b"core" * 1000)
    (src / "weights.bf16").write_bytes(bf16_weights(1 << 20).tobytes())
    (src / "empty").write_bytes(b"")
    run = src / "run.sh"
    run.write_text("#!/bin/sh\necho hi\n")
    run.chmod(0o750)
    os.symlink("weights.bf16", src / "latest")
    return src


def test_pack_unpack_tree_roundtrip(tmp_path: Path, store: str, key: bytes) -> None:
    src = make_tree(tmp_path)
    ref = pack_paths([src], store, key=key)
    out = tmp_path / "out"
    summary = unpack(store, ref.id, out, key=key)
    assert summary["files"] == 5
    for rel in ["criu/pages/pages-1.img", "criu/core.img", "weights.bf16", "empty", "run.sh"]:
        assert (out / "job" / rel).read_bytes() == (src / rel).read_bytes()
    assert stat.S_IMODE((out / "job" / "run.sh").stat().st_mode) == 0o750
    assert (out / "job" / "run.sh").stat().st_mtime_ns == (src / "run.sh").stat().st_mtime_ns
    assert os.readlink(out / "job" / "latest") == "weights.bf16"
    assert (out / "job" / "empty-dir").is_dir()
    assert not [p for p in out.iterdir() if p.name.startswith(".gpumigrate-unpack")]


def test_float_files_are_sniffed_and_byteplane_coded(tmp_path: Path, store: str, key: bytes) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(bf16_weights(2 << 20).tobytes())  # 4 MiB
    ref = pack_paths([f], store, key=key)
    assert ref.bytes_stored / ref.bytes_image <= 0.72
    region = open_reader(store, ref.id, key=key).regions()[0]
    assert region.dtype == "float16"  # the codec hint: 2-byte floats


def test_cdc_insert_only_moves_nearby_chunks(tmp_path: Path, store: str, key: bytes) -> None:
    blob = np.random.default_rng(5).bytes(24 << 20)  # ~12 content-defined chunks; seeded: same cuts every run
    f = tmp_path / "state.img"
    f.write_bytes(blob)
    parent = pack_paths([f], store, key=key)
    f.write_bytes(b"inserted bytes" + blob)  # every fixed-size chunk would shift
    child = pack_paths([f], store, key=key, parent=parent.id)
    assert child.bytes_sent < 0.4 * len(blob)  # a fixed-size chunker would resend everything
    out = tmp_path / "out"
    unpack(store, child.id, out, key=key)
    assert (out / "state.img").read_bytes() == b"inserted bytes" + blob


def test_missing_input_is_a_clear_error(tmp_path: Path, store: str, key: bytes) -> None:
    with pytest.raises(NotFoundError, match="no such file"):
        pack_paths([tmp_path / "absent"], store, key=key)


def test_unpack_refuses_paths_outside_the_output(tmp_path: Path, store: str, key: bytes) -> None:
    w = open_writer(store, key=key)
    w.add_region(RegionInfo(name="../escape", nbytes=4, kind="file"))
    w.put_chunk("../escape", 0, memoryview(b"evil"))
    ref = w.commit()
    out = tmp_path / "out"
    with pytest.raises(IntegrityError, match="outside the output"):
        unpack(store, ref.id, out, key=key)
    assert not (tmp_path / "escape").exists()


def test_unpack_never_writes_through_an_existing_symlink(tmp_path: Path, store: str, key: bytes) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    (out / "job").mkdir(parents=True)
    os.symlink(outside, out / "job" / "link")  # left by an earlier unpack, or planted
    w = open_writer(store, key=key)
    w.add_region(RegionInfo(name="job/link/passwd", nbytes=4, kind="file"))
    w.put_chunk("job/link/passwd", 0, memoryview(b"evil"))
    ref = w.commit()
    with pytest.raises(IntegrityError, match="through the symlink"):
        unpack(store, ref.id, out, key=key)
    assert list(outside.iterdir()) == []


def test_small_files_share_bundle_objects(tmp_path: Path, store: str, key: bytes) -> None:
    src = tmp_path / "cfg"
    src.mkdir()
    for i in range(300):
        (src / f"c{i:03d}.yaml").write_text(f"layer: {i}\n" * (i % 50))  # includes empty files
    ref = pack_paths([src], store, key=key)
    reader = open_reader(store, ref.id, key=key)
    assert len(reader.objects) <= 2  # 300 files, one or two objects
    out = tmp_path / "out"
    unpack(store, ref.id, out, key=key)
    for i in range(300):
        assert (out / "cfg" / f"c{i:03d}.yaml").read_text() == f"layer: {i}\n" * (i % 50)


def test_unchanged_files_are_taken_from_the_parent_without_reading(tmp_path: Path, store: str, key: bytes) -> None:
    f = tmp_path / "pages.img"
    original = os.urandom(6 << 20)
    f.write_bytes(original)
    parent = pack_paths([f], store, key=key)
    st = f.stat()
    changed = bytearray(original)
    changed[100] ^= 0xFF
    f.write_bytes(changed)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: looks unchanged
    trusting = pack_paths([f], store, key=key, parent=parent.id)
    reading = pack_paths([f], store, key=key, parent=parent.id, reuse_unchanged=False)
    assert trusting.bytes_sent < 4096  # nothing read, nothing sent
    unpack(store, trusting.id, tmp_path / "a", key=key)
    unpack(store, reading.id, tmp_path / "b", key=key)
    assert (tmp_path / "a" / "pages.img").read_bytes() == original
    assert (tmp_path / "b" / "pages.img").read_bytes() == bytes(changed)
