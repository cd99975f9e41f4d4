"""The reference workloads' command-line flags over gpumigrate's environment contract.

The workloads read their agent address and await-restore from the environment, as the public SDK
does in any user's program (``GPUMIGRATE_AGENT_ADDR``, ``GPUMIGRATE_AWAIT_RESTORE``). The flags
here are thin overrides that set those variables before the SDK reads them.
"""

from __future__ import annotations

import argparse
import os

from gpumigrate.launch import AGENT_ADDR_ENV, AWAIT_RESTORE_ENV


def add_contract_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent-port", type=int, default=None, help=f"agent port on --host (overrides ${AGENT_ADDR_ENV})")
    p.add_argument(
        "--await-restore", action="store_true", help=f"start unready and wait for a restore (${AWAIT_RESTORE_ENV}=1)"
    )


def apply_contract_overrides(args: argparse.Namespace) -> None:
    """``--agent-port P``: the agent listens on ``--host``:P (where the workload does: inside a host's
    namespace 127.0.0.1 is not reachable). Neither the flag nor ``GPUMIGRATE_AGENT_ADDR``: a free port
    on ``--host``, so that several reference workloads run side by side (the SDK's own default,
    127.0.0.1:7070, is for one service per host). ``--await-restore``: ``GPUMIGRATE_AWAIT_RESTORE=1``.
    """
    if args.agent_port is not None:
        os.environ[AGENT_ADDR_ENV] = f"{args.host}:{args.agent_port}"
    elif not os.environ.get(AGENT_ADDR_ENV):
        os.environ[AGENT_ADDR_ENV] = f"{args.host}:0"
    if args.await_restore:
        os.environ[AWAIT_RESTORE_ENV] = "1"
