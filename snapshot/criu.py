"""CRIU backend: dump a process tree (with its GPU state, through CRIU's CUDA plugin) and restore it.

Needs CRIU 4.0+ and its CUDA plugin (``cuda_plugin.so``) for GPU processes. A dump always leaves
the source running (``--leave-running``): it serves until the cut-over, and a failed dump harms
nothing. The dump directory is packed by the transfer engine through the ``pack`` callable the
caller passes in (e.g. ``gpumigrate.transfer.pack_paths``, content-defined chunking), because
``snapshot/`` never moves bytes itself. Every refusal names what is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import ImageRef

MIN_VERSION = (4, 0)
PLUGIN_NAMES = ("cuda_plugin.so",)
PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu", "/usr/lib64/criu", "/usr/lib/x86_64-linux-gnu/criu")


class CriuUnavailable(SnapshotError):
    """CRIU, the right CRIU version, its CUDA plugin, or the kernel features it needs are missing."""


@dataclass(frozen=True)
class CriuInfo:
    binary: str
    version: tuple[int, ...]
    plugin: str | None


def parse_version(text: str) -> tuple[int, ...]:
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", text) or re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise CriuUnavailable(f"cannot read CRIU's version from {text.strip()[:80]!r}")
    return tuple(int(g) for g in m.groups() if g is not None)


def find_plugin(dirs: Sequence[str] | None = None) -> str | None:
    search = [os.environ["CRIU_LIBS_DIR"]] if os.environ.get("CRIU_LIBS_DIR") else []
    for d in [*search, *(dirs or PLUGIN_DIRS)]:
        for name in PLUGIN_NAMES:
            p = Path(d) / name
            if p.is_file():
                return str(p)
    return None


def detect(binary: str | None = None, *, need_cuda: bool = True) -> CriuInfo:
    """Find CRIU, check it is 4+ and (for GPU processes) that its CUDA plugin is installed."""
    path = shutil.which(binary or "criu")
    if not path:
        raise CriuUnavailable(
            f"CRIU is not installed on this host (no {binary or 'criu'!r} found)",
            hint=f"install CRIU {MIN_VERSION[0]}.{MIN_VERSION[1]}+ with its CUDA plugin, or use snapshot backend 'agent'",
        )
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CriuUnavailable(f"cannot run {path} --version: {exc}") from None
    version = parse_version(out.stdout + out.stderr)
    if version[:2] < MIN_VERSION:
        raise CriuUnavailable(
            f"CRIU {'.'.join(map(str, version))} at {path} is too old: GPU checkpoints need CRIU "
            f"{MIN_VERSION[0]}.{MIN_VERSION[1]}+ with its CUDA plugin"
        )
    plugin = find_plugin()
    if need_cuda and plugin is None:
        raise CriuUnavailable(
            f"CRIU {'.'.join(map(str, version))} has no CUDA plugin ({PLUGIN_NAMES[0]} not found in "
            f"{', '.join(PLUGIN_DIRS)} or $CRIU_LIBS_DIR)"
        )
    return CriuInfo(path, version, plugin)


def check_kernel(binary: str | None = None) -> None:
    """``criu check``: refuse with CRIU's own words when this kernel lacks what it needs."""
    path = shutil.which(binary or "criu")
    if not path:
        raise CriuUnavailable("CRIU is not installed on this host (no 'criu' on PATH)")
    out = subprocess.run([path, "check"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
        raise CriuUnavailable("criu check failed on this kernel: " + "; ".join(lines[-3:]))


def dump_command(pid: int, images_dir: Path, info: CriuInfo, *, timeout_s: int = 10) -> list[str]:
    """``criu dump`` of the tree at ``pid``, always with ``--leave-running``: the source serves on after
    its dump, until the cut-over (and again at once if the dump fails)."""
    cmd = [info.binary, "dump", "--shell-job", "--leave-running", "--images-dir", str(images_dir)]
    cmd += ["--tree", str(int(pid)), "--timeout", str(timeout_s)]
    if info.plugin:
        cmd += ["--libdir", str(Path(info.plugin).parent)]
    return cmd


def restore_command(images_dir: Path, info: CriuInfo) -> list[str]:
    """``criu restore`` of a dumped tree, detached, its new root pid written to ``restored.pid``."""
    cmd = [info.binary, "restore", "--shell-job", "--restore-detached", "--images-dir", str(images_dir)]
    cmd += ["--pidfile", str(images_dir / "restored.pid")]
    if info.plugin:
        cmd += ["--libdir", str(Path(info.plugin).parent)]
    return cmd


def dump(pid: int, images_dir: str | Path, *, info: CriuInfo | None = None, timeout_s: int = 10) -> Path:
    """Dump the process tree rooted at ``pid`` into ``images_dir``; the source keeps running."""
    info = info or detect()
    d = Path(images_dir)
    d.mkdir(parents=True, exist_ok=True)
    _run(dump_command(pid, d, info, timeout_s=timeout_s), "dump", d)
    return d


def restore(images_dir: str | Path, *, info: CriuInfo | None = None) -> int:
    """Restore a dumped tree detached; return the restored root pid."""
    info = info or detect()
    d = Path(images_dir)
    _run(restore_command(d, info), "restore", d)
    return int((d / "restored.pid").read_text().strip())


def _run(cmd: list[str], what: str, d: Path) -> None:
    log = d / f"{what}.log"
    out = subprocess.run([*cmd, "-o", str(log), "-v4"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        tail = (
            log.read_text(errors="replace").splitlines()[-5:] if log.exists() else (out.stderr or "").splitlines()[-5:]
        )
        raise SnapshotError(f"criu {what} failed (exit {out.returncode}): " + " | ".join(tail))


def dump_and_pack(
    pid: int,
    images_dir: str | Path,
    pack: Callable[[list[str]], ImageRef],
    *,
    info: CriuInfo | None = None,
    timeout_s: int = 10,
) -> ImageRef:
    """Dump, then hand the directory's files to ``pack`` (the transfer engine's content-defined packer)."""
    d = dump(pid, images_dir, info=info, timeout_s=timeout_s)
    return pack(sorted(str(p) for p in d.iterdir() if p.is_file()))
