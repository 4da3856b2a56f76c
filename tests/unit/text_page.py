"""An HTTP endpoint on 127.0.0.1 (or ``host``) that answers every GET with a text a test sets (and may change):
a worker's metrics page, as broken or hostile as the test wants it."""

from __future__ import annotations

import http.server
import threading


class TextPage:
    def __init__(self, text: str, status: int = 200, host: str = "127.0.0.1") -> None:
        self.text = text
        self.status = status
        page = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = page.text.encode()
                self.send_response(page.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="text-page", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)

    def __enter__(self) -> TextPage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
