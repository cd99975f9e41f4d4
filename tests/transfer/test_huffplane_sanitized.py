"""The huff coder's C under AddressSanitizer and UndefinedBehaviorSanitizer: round trips, then damaged
and random payloads of every length, with mismatched plane sizes. Any out-of-bounds access or
undefined behaviour aborts the child process, which fails this test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FUZZ = r"""
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("_huffplane", sys.argv[1])
H = importlib.util.module_from_spec(spec); spec.loader.exec_module(H)
rng = np.random.default_rng(1)
for trial in range(6000):
    n = int(rng.integers(1, 5000))
    kind = trial % 3
    if kind == 0:
        plane = rng.integers(0, 256, n, dtype=np.uint8)
    elif kind == 1:
        plane = np.minimum(rng.geometric(0.4, n), 255).astype(np.uint8)
    else:
        plane = np.full(n, 3, np.uint8)
    out = bytearray(2 * n + 300)
    m = H.encode(plane, out)
    dec = bytearray(n)
    H.decode(bytes(out[:m]), dec)
    assert bytes(dec) == plane.tobytes(), trial
    split = np.empty(n - n % 2, np.uint8)
    H.split(memoryview(plane[: n - n % 2]), 2, split)
    merged = bytearray(len(split))
    H.merge([split[: len(split) // 2], split[len(split) // 2 :]], memoryview(merged))
    assert bytes(merged) == plane[: n - n % 2].tobytes()
    damaged = bytearray(out[:m])
    for _ in range(int(rng.integers(1, 6))):
        damaged[int(rng.integers(0, len(damaged)))] ^= int(rng.integers(1, 256))
    if trial % 5 == 0:
        damaged = damaged[: int(rng.integers(0, len(damaged) + 1))]
    size = n if trial % 7 else int(rng.integers(0, 3 * n + 20))
    for payload, length in ((bytes(damaged), size),
                            (rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8).tobytes(), int(rng.integers(0, 2000)))):
        try:
            H.decode(payload, bytearray(length))
        except ValueError:
            pass
print("fuzzed")
"""


def _runtime(name: str) -> str | None:
    found = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


@pytest.mark.slow
def test_coder_is_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    asan, ubsan = _runtime("libasan.so"), _runtime("libubsan.so")
    if not (asan and ubsan):
        pytest.skip("gcc's sanitizer runtimes (libasan, libubsan) are not installed")
    lib = tmp_path / "_huffplane_sanitized.so"
    subprocess.run(
        [
            "gcc",
            "-O1",
            "-g",
            "-std=c11",
            "-fPIC",
            "-shared",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer",
            f"-I{sysconfig.get_paths()['include']}",
            str(REPO / "transfer" / "format" / "_huffplane.c"),
            "-o",
            str(lib),
        ],
        check=True,
        timeout=120,
    )
    env = {**os.environ, "LD_PRELOAD": f"{asan} {ubsan}", "ASAN_OPTIONS": "detect_leaks=0"}
    run = subprocess.run([sys.executable, "-c", FUZZ, str(lib)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fuzzed" in run.stdout
