"""An HTTP endpoint on 127.0.0.1 (or ``host``) that answers every GET with a text a test sets (and may change),
or with what a function returns at each request: a worker's or the store's metrics page, as broken or hostile
as the test wants it."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable


class TextPage:
    def __init__(
        self, text: str | Callable[[], str], status: int = 200, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.text = text
        self.status = status
        page = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = (page.text if isinstance(page.text, str) else page.text()).encode()
                self.send_response(page.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
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
