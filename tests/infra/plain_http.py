"""``python plain_http.py HOST PORT``: an HTTP server that answers every GET with 200, for tests that need a service
in a network-namespace host.

Not ``python -m http.server``: its HTTPServer looks the bound address's name up (``socket.getfqdn``) before it
listens, and a namespace host reaches no DNS server, so it listened only after the resolver's 10 s timeout.
"""

from __future__ import annotations

import http.server
import socketserver
import sys


class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):  # TCPServer binds without any name lookup
    allow_reuse_address = True
    daemon_threads = True


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"ok\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    Server((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
