"""A local stand-in for the Hugging Face hub's file API: serves one folder as repo ``ORG/NAME`` at
``main`` over HTTP, as huggingface_hub reads it (``HEAD``/``GET /ORG/NAME/resolve/REV/FILE`` with
the hub's headers, ``Range`` requests answered with 206), and records every request, so a test
can say how many bytes of which file a command fetched. Point ``HF_ENDPOINT`` at ``url``."""

from __future__ import annotations

import hashlib
import http.server
import pathlib
import re
import threading

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    def __init__(self, folder: pathlib.Path, repo: str):
        self.folder, self.repo = folder, repo
        self.requests: list[tuple[str, str, int]] = []  # (method, file, bytes sent)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _file(self) -> pathlib.Path | None:
                m = re.fullmatch(rf"/{re.escape(server.repo)}/resolve/[^/]+/([^/?]+)", self.path.split("?")[0])
                if not m:
                    return None
                return server.folder / m.group(1)

            def _missing(self) -> None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Error-Message", "Entry not found")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _headers(self, path: pathlib.Path, length: int, status: int, rng: tuple[int, int] | None) -> None:
                self.send_response(status)
                size = path.stat().st_size
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"' + hashlib.sha1(f"{path.name}:{size}".encode()).hexdigest() + '"')
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                if rng:
                    self.send_header("Content-Range", f"bytes {rng[0]}-{rng[1]}/{size}")
                self.end_headers()

            def do_HEAD(self):
                path = self._file()
                if path is None or not path.is_file():
                    return self._missing()
                self._headers(path, path.stat().st_size, 200, None)
                server.requests.append(("HEAD", path.name, 0))

            def do_GET(self):
                path = self._file()
                if path is None or not path.is_file():
                    return self._missing()
                size = path.stat().st_size
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "") or self.headers.get("range", ""))
                start, stop = (int(m.group(1)), min(size - 1, int(m.group(2) or size - 1))) if m else (0, size - 1)
                with open(path, "rb") as f:
                    f.seek(start)
                    body = f.read(stop - start + 1)
                self._headers(path, len(body), 206 if m else 200, (start, stop) if m else None)
                self.wfile.write(body)
                server.requests.append(("GET", path.name, len(body)))

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
