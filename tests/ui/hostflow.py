"""A flow that says where it ran, for the multi-host test: its network namespace and its address.

Deployed once per host, on that host's queue (``host-<name>``), like the project's host-action
deployments (flows/MULTIHOST.md); the answer is a markdown artifact ``where-<tag>`` holding JSON.
"""

from __future__ import annotations

import json
import os
import socket
from urllib.parse import urlsplit

from prefect import flow
from prefect.artifacts import create_markdown_artifact


def _source_address() -> str:
    """The address this process's packets to the Prefect server leave from (no packet is sent)."""
    api = urlsplit(os.environ["PREFECT_API_URL"])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((api.hostname or "127.0.0.1", api.port or 4200))
        return str(s.getsockname()[0])


@flow(name="where-am-i")
def where_am_i(tag: str) -> None:
    facts = {
        "tag": tag,
        "netns_inode": os.stat("/proc/self/ns/net").st_ino,
        "address": _source_address(),
        "host": os.environ.get("GPUMIGRATE_HOST_NAME"),
        "pid": os.getpid(),
    }
    create_markdown_artifact(markdown=json.dumps(facts), key=f"where-{tag}", description="where this run ran")
