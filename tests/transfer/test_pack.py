"""pack_paths/unpack: trees, modes, symlinks, content-defined chunking, float sniffing, path safety."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from conftest import bf16_weights
from gpumigrate.transfer import open_reader, open_writer, pack_paths, unpack

from gpumigrate.errors import IntegrityError, NotFoundError
from gpumigrate.interfaces import RegionInfo


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
    blob = os.urandom(8 << 20)
    f = tmp_path / "state.img"
    f.write_bytes(blob)
    parent = pack_paths([f], store, key=key)
    f.write_bytes(b"inserted bytes" + blob)  # every fixed-size chunk would shift
    child = pack_paths([f], store, key=key, parent=parent.id)
    assert child.bytes_sent < 0.4 * len(blob)
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
