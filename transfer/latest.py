"""Which image an image URL means: a full id, a unique prefix of one, or (no id) the newest signed image.

"Newest" is the largest ``sequence`` in the signed bodies of the manifests that verify with the reader's key
(FORMAT.md, Manifest), never a file's mtime: an older manifest put back in the store cannot pass for the newest.
Manifests without a sequence (written before it existed) rank below every one that has it, by their signed
``created`` time. This machine keeps, per store and key, the sequence of the newest image a URL without an id took
(``$XDG_STATE_HOME/gpumigrate/images-served/``, outside every store: whoever can write a store cannot rewind it);
a store whose newest image is older than that (a newer one removed, an older one put back) is refused, unless the
image is named by id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import EXIT_INVALID, GpumigrateError, IntegrityError, InvalidInputError, NotFoundError
from gpumigrate.settings import user_state_dir
from gpumigrate.transfer.format.chunkobj import Sealer
from gpumigrate.transfer.format.manifest import open_manifest
from gpumigrate.transfer.stores import ID_PATTERN, Store, check_image_id

log = logging.getLogger(__name__)

SERVED_DIR = "images-served"
NEWEST = ("", "latest")  # what an image URL without an id says
_PREFIX = re.compile(r"[0-9a-f]{1,63}")


class OlderImageError(IntegrityError):
    """The newest image a store holds is older than one a URL without an id already took from it: a newer image
    was removed or an older one put back. Refused before anything is read (exit 2); naming the image by id takes it."""

    exit_code = EXIT_INVALID


@dataclass(frozen=True)
class Resolved:
    """The image an image URL meant, and how it was chosen (``how``: "id", "prefix" or "newest")."""

    image_id: str
    how: str
    sequence: int | None = None
    created: str | None = None
    candidates: int = 0  # manifests that verified with the key (how == "newest")
    skipped: int = 0  # manifests that did not (another key, unsigned, damaged): never chosen

    def describe(self, store_url: str) -> str:
        """One line for the operator: which image a URL without an id took, and why that one."""
        seq = "no sequence (an older writer)" if self.sequence is None else f"sequence {self.sequence}"
        others = f"; {self.skipped} other manifests did not verify with this key and were passed over" * bool(
            self.skipped
        )
        return (
            f"no image id given: took {self.image_id} from {store_url}, the newest of {self.candidates} signed "
            f"images ({seq}, created {self.created}){others}"
        )

    def as_json(self) -> dict[str, Any]:
        return {"image_id": self.image_id, "how": self.how, "sequence": self.sequence, "created": self.created}


def image_sequence(body: dict[str, Any]) -> int | None:
    """The manifest body's signed ``sequence``; None when it has none (or not a whole number)."""
    seq = body.get("sequence")
    return seq if type(seq) is int and seq >= 0 else None


def _rank(body: dict[str, Any], image_id: str) -> tuple[int, int, str, str]:
    seq = image_sequence(body)
    created = body.get("created")
    return (seq is not None, seq or 0, created if isinstance(created, str) else "", image_id)


def check_image_ref(image: str | None) -> str | None:
    """``image`` when an image URL may carry it: nothing or "latest" (the newest), a full id, or a prefix of one
    (``^[0-9a-f]{1,63}$``); else :class:`~gpumigrate.transfer.stores.InvalidIdError` naming the rule."""
    if image and image not in NEWEST and not _PREFIX.fullmatch(image):
        check_image_id(image)  # a full id passes; anything else raises, naming the rule and nothing of the text
    return image


def resolve_image(store: Store, image: str | None, sealer: Sealer) -> Resolved:
    """The image ``image`` names in ``store`` (see the module's docstring); typed errors for everything else."""
    if check_image_ref(image) and image not in NEWEST:
        assert image is not None  # checked just above
        if ID_PATTERN.fullmatch(image):
            return Resolved(image, "id")
        ids = _listed(store)
        matches = [i for i in ids if i.startswith(image)]
        if len(matches) != 1:
            raise NotFoundError(
                f"{'no' if not matches else 'more than one'} image in {store.url} matches the prefix {image!r}"
            )
        return Resolved(matches[0], "prefix")
    return _newest(store, sealer)


def resolve_image_id(store: Store, image: str | None, sealer: Sealer | None = None) -> str:
    """:func:`resolve_image`'s image id; a URL without an id logs which image it took."""
    found = resolve_image(store, image, sealer or Sealer(None))
    if found.how == "newest":
        log.info("%s", found.describe(store.url))
    return found.image_id


def _listed(store: Store) -> list[str]:
    ids = store.list_manifests()
    if not ids and (missing := store.missing()) is not None:
        raise missing
    return ids


def _newest(store: Store, sealer: Sealer) -> Resolved:
    ids = _listed(store)
    if not ids:
        raise NotFoundError(f"{store.url} holds no images")
    best: tuple[tuple[int, int, str, str], dict[str, Any]] | None = None
    skipped: list[str] = []
    for image_id in ids:
        try:
            body = open_manifest(store.get_manifest(image_id), image_id, sealer)
        except GpumigrateError as exc:
            skipped.append(f"{image_id[:12]}: {exc.message}")
            continue
        rank = _rank(body, image_id)
        if best is None or rank > best[0]:
            best = rank, body
    if best is None:
        raise InvalidInputError(
            f"none of the {len(ids)} images in {store.url} verifies with this key, so none can be taken as the newest",
            hint="; ".join(skipped[:3]) + (f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""),
        )
    (_, _, created, image_id), body = best
    found = Resolved(
        image_id,
        "newest",
        sequence=image_sequence(body),
        created=created or None,
        candidates=len(ids) - len(skipped),
        skipped=len(skipped),
    )
    _check_not_older(store, sealer, found)
    return found


# ----------------------------------------------------------------------------- the record of what was served
def _record_path(store: Store, sealer: Sealer) -> Path:
    name = hashlib.sha256(f"{store.location()}\0{sealer.key_id}".encode()).hexdigest()[:32]
    return user_state_dir() / SERVED_DIR / f"{name}.json"


def _served(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("the record of the images served %s is unreadable (%s): starting it again", path, exc)
        return None
    return doc if isinstance(doc, dict) and type(doc.get("sequence")) is int else None


def _check_not_older(store: Store, sealer: Sealer, found: Resolved) -> None:
    """Refuse ``found`` when it is older than the newest image this store served; else remember it."""
    path = _record_path(store, sealer)
    served = _served(path)
    if served is not None and (found.sequence is None or found.sequence < served["sequence"]):
        raise OlderImageError(
            f"the newest image in {store.url} is {found.image_id} "
            f"({'no sequence' if found.sequence is None else f'sequence {found.sequence}'}), older than "
            f"{str(served.get('image_id'))[:16]} (sequence {served['sequence']}) that a URL without an id took from "
            f"this store before: a newer image was removed or an older one put back, so it is not taken as the newest",
            hint="to take this older image on purpose, name it by id: STORE_URL#IMAGE_ID",
        )
    if found.sequence is not None and (served is None or found.sequence > served["sequence"]):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        doc = {"store": store.location(), "key_id": sealer.key_id, "sequence": found.sequence}
        atomic_write_json(path, {**doc, "image_id": found.image_id}, mode=0o600)
