"""An audit anchor in Prefect: each head a markdown artifact under one key per chain (``prefect``).

The Prefect API keeps every artifact published under a key, newest marked latest, in its own database
(the server's, or Prefect Cloud's): outside the migration's directory, and shown in the UI beside the
flow run that published it. The flow publishes a head at the end of each phase with
``migration.audit.anchor_to(PrefectArtifactAnchor())``; naming ``prefect`` in
``$GPUMIGRATE_AUDIT_ANCHORS`` publishes every head. Prefect is imported on first use only.
Spec of the head: ``gpumigrate/AUDIT.md``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from gpumigrate.audit_anchor import check_chain, ordered_heads

_BLOCK = re.compile(r"```json\n(.*?)\n```", re.S)
_PAGE = 200


def artifact_key(log: str, chain: str | None) -> str:
    """Prefect keys hold lowercase letters, digits and dashes only: a digest of the log name, then the chain."""
    stem = f"audit-{hashlib.sha256(log.encode()).hexdigest()[:16]}-"
    return stem + check_chain(chain) if chain is not None else stem


class PrefectArtifactAnchor:
    @classmethod
    def from_url(cls, url: str) -> PrefectArtifactAnchor:
        return cls()

    def describe(self) -> str:
        return "prefect artifacts"

    def publish(self, log: str, chain: str, head: Mapping[str, Any]) -> None:
        from prefect.artifacts import create_markdown_artifact

        body = json.dumps(dict(head), sort_keys=True, indent=1)
        markdown = (f"Audit chain head of `{log}`: {head.get('count')} records.\n\n"
                    f"```json\n{body}\n```\n")  # fmt: skip
        create_markdown_artifact(markdown=markdown, key=artifact_key(log, chain), description=f"audit head: {log}")

    def _artifacts(self, **key_filter: Any) -> list[Any]:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
        from prefect.client.schemas.sorting import ArtifactSort

        found: list[Any] = []
        with get_client(sync_client=True) as client:
            while True:
                page = client.read_artifacts(
                    artifact_filter=ArtifactFilter(key=ArtifactFilterKey(**key_filter)),
                    sort=ArtifactSort.CREATED_DESC, limit=_PAGE, offset=len(found),
                )  # fmt: skip
                found += page
                if len(page) < _PAGE:
                    return found

    def heads(self, log: str, chain: str) -> list[dict[str, Any]]:
        docs = [_head_of(a.data) for a in self._artifacts(any_=[artifact_key(log, chain)])]
        return ordered_heads(docs)

    def latest(self, log: str, chain: str) -> dict[str, Any] | None:
        found = self.heads(log, chain)
        return found[-1] if found else None

    def chains(self, log: str) -> list[str]:
        stem = artifact_key(log, None)
        keys = {a.key for a in self._artifacts(like_=f"{stem}%") if a.key}
        return sorted(k[len(stem) :] for k in keys)


def _head_of(data: Any) -> dict[str, Any]:
    match = _BLOCK.search(data) if isinstance(data, str) else None
    try:
        doc = json.loads(match.group(1)) if match else None
    except ValueError:
        doc = None
    return doc if isinstance(doc, dict) else {"damaged": "a Prefect artifact that holds no head"}
