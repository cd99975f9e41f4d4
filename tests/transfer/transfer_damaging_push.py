"""Push with a fault between the source's disk and the wire: the first read of one chunk has a flipped bit.

Run as a script on a host: ``python transfer_damaging_push.py STORE_URL IMAGE_ID DST_URL VICTIM_ID``, the
image key in GM_TEST_IMAGE_KEY; prints push's stats as JSON. (A process of its own: UCX reads the routing
table once per process, and the test process outlives the namespaces of earlier tests.)
"""

from __future__ import annotations

import json
import os
import sys

from gpumigrate.transfer import push
from gpumigrate.transfer.stores.file import FileStore, file_root


class DamagingStore(FileStore):
    def __init__(self, url: str, victim: str) -> None:
        super().__init__(file_root(url), url)
        self.victim, self.damaged = victim, 0

    def get_chunk(self, chunk_id: str) -> bytes:
        blob = super().get_chunk(chunk_id)
        if chunk_id == self.victim and not self.damaged:
            self.damaged += 1
            return blob[:-20] + bytes([blob[-20] ^ 0x10]) + blob[-19:]
        return blob


if __name__ == "__main__":
    store, image_id, dst, victim = sys.argv[1:5]
    source = DamagingStore(store, victim)
    stats = push(source, dst, image_id, key=bytes.fromhex(os.environ["GM_TEST_IMAGE_KEY"]))
    print(json.dumps({**stats.as_dict(), "damaged_reads": source.damaged}))
