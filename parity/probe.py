"""Environment probe: ``python -m gpumigrate.parity.probe [--weights FILE ...]`` prints one JSON line.

Run on a host (locally, over ssh, or by a cloud's run-command) when no workload is up yet to ask
through ``/v1/info``. The facts are :func:`gpumigrate.environment.collect_facts` (the one collector,
in the policy's vocabulary); only an allow-list of environment variables is reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpumigrate.environment import REPORTED_ENV, collect_facts

__all__ = ["REPORTED_ENV", "collect", "weights_file_digest"]  # REPORTED_ENV: workloads/environment.py reads it


def weights_file_digest(paths: list[Path]) -> str:
    """BLAKE3 over the files in the order given (name-independent: only bytes count)."""
    import blake3

    h = blake3.blake3()
    for p in paths:
        with p.open("rb") as fh:
            while block := fh.read(8 << 20):
                h.update(block)
    return h.hexdigest()


def collect(weights: list[Path] | None = None, *, with_torch: bool = True) -> dict[str, Any]:
    """This host's facts (the core's one collector) plus, with ``weights``, their digest."""
    facts = collect_facts(with_torch=with_torch)
    if weights:
        facts["weights_digest"] = weights_file_digest(weights)
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpumigrate.parity.probe", description=__doc__.split("\n")[0])
    parser.add_argument("--weights", type=Path, action="append", default=[], help="weights file to digest (repeatable)")
    parser.add_argument("--no-torch", action="store_true", help="do not import torch (faster; no torch facts)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.weights if not p.is_file()]
    if missing:
        print(f"error: no such weights file: {', '.join(missing)}", file=sys.stderr)
        return 2
    print(json.dumps(collect(args.weights, with_torch=not args.no_torch), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
