"""A loopback fake of the few Google Cloud Storage JSON/upload API calls gpumigrate's GcsStore makes.

No GCS emulator ships on PyPI, so the tests serve this: bucket get (for the location), object
get (metadata and media, with Range), list with prefix, and multipart uploads. Objects live in memory.
"""

from __future__ import annotations

import base64
import email.parser
import email.policy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

import google_crc32c


class FakeGcs:
    def __init__(self, buckets: dict[str, str]) -> None:
        self.locations = dict(buckets)  # bucket -> location
        self.objects: dict[tuple[str, str], bytes] = {}
        self.lock = threading.Lock()
        self.requests = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                fake._get(self)

            def do_POST(self) -> None:
                fake._post(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    # -- helpers

    def _resource(self, bucket: str, name: str, data: bytes) -> dict[str, object]:
        crc = base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
        return {
            "kind": "storage#object",
            "bucket": bucket,
            "name": name,
            "size": str(len(data)),
            "id": f"{bucket}/{name}/1",
            "generation": "1",
            "metageneration": "1",
            "crc32c": crc,
            "contentType": "application/octet-stream",
        }

    def _send(
        self,
        h: BaseHTTPRequestHandler,
        code: int,
        body: bytes,
        ctype: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    def _json(self, h: BaseHTTPRequestHandler, code: int, obj: object) -> None:
        self._send(h, code, json.dumps(obj).encode())

    def _not_found(self, h: BaseHTTPRequestHandler, what: str) -> None:
        self._json(h, 404, {"error": {"code": 404, "message": f"{what} not found", "errors": [{"reason": "notFound"}]}})

    # -- handlers

    def _get(self, h: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.requests += 1
        parts = urlsplit(h.path)
        query = parse_qs(parts.query)
        segs = [unquote(s) for s in parts.path.split("/") if s]
        if segs[:1] == ["download"]:
            segs = segs[1:]
        # storage/v1/b/{bucket}[/o[/{name}]]
        if segs[:3] != ["storage", "v1", "b"] or len(segs) < 4:
            return self._not_found(h, h.path)
        bucket = segs[3]
        if bucket not in self.locations:
            return self._not_found(h, f"bucket {bucket}")
        if len(segs) == 4:
            return self._json(
                h,
                200,
                {
                    "kind": "storage#bucket",
                    "name": bucket,
                    "id": bucket,
                    "location": self.locations[bucket],
                    "storageClass": "STANDARD",
                },
            )
        if len(segs) == 5 and segs[4] == "o":
            prefix = query.get("prefix", [""])[0]
            with self.lock:
                items = [
                    self._resource(b, n, d)
                    for (b, n), d in sorted(self.objects.items())
                    if b == bucket and n.startswith(prefix)
                ]
            return self._json(h, 200, {"kind": "storage#objects", "items": items})
        name = "/".join(segs[5:])
        with self.lock:
            data = self.objects.get((bucket, name))
        if data is None:
            return self._not_found(h, f"object {name}")
        if query.get("alt", [""])[0] != "media":
            return self._json(h, 200, self._resource(bucket, name, data))
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start_s, _, end_s = rng[6:].partition("-")
            start, end = int(start_s), min(int(end_s) if end_s else len(data) - 1, len(data) - 1)
            body = data[start : end + 1]
            return self._send(
                h, 206, body, "application/octet-stream", {"Content-Range": f"bytes {start}-{end}/{len(data)}"}
            )
        crc = self._resource(bucket, name, data)["crc32c"]
        return self._send(h, 200, data, "application/octet-stream", {"x-goog-hash": f"crc32c={crc}"})

    def _post(self, h: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.requests += 1
        parts = urlsplit(h.path)
        query = parse_qs(parts.query)
        segs = [unquote(s) for s in parts.path.split("/") if s]
        length = int(h.headers.get("Content-Length", "0"))
        raw = h.rfile.read(length)
        if segs[:4] != ["upload", "storage", "v1", "b"] or query.get("uploadType", [""])[0] != "multipart":
            return self._json(h, 400, {"error": {"code": 400, "message": f"fake GCS does not serve {h.path}"}})
        bucket = segs[4]
        if bucket not in self.locations:
            return self._not_found(h, f"bucket {bucket}")
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + h.headers["Content-Type"].encode() + b"\r\n\r\n" + raw
        )
        meta_part, media_part = list(msg.iter_parts())
        meta = json.loads(meta_part.get_payload(decode=True))
        data = media_part.get_payload(decode=True)
        name = meta.get("name") or query.get("name", [""])[0]
        with self.lock:
            self.objects[(bucket, name)] = data
        return self._json(h, 200, self._resource(bucket, name, data))


def object_url(endpoint: str, bucket: str, name: str) -> str:
    return f"{endpoint}/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
