"""A local HTTP server standing in for the Hugging Face Hub, for `python -m model.fetch <owner/name>`.

It answers the four requests huggingface_hub's `model_info`, `snapshot_download` and
`hf_hub_download` make (read from huggingface_hub 2.4: hf_api.py, _snapshot_download.py,
file_download.py), with the headers and error codes the real Hub sends:

    GET  /api/models/{repo}[/revision/{rev}]      repo info; siblings with sizes when ?blobs=True
    GET  /api/models/{repo}/tree/{rev}            the file list (recursive; one page)
    HEAD /{repo}/resolve/{rev}/{path}             X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{path}             the bytes; 206 for a Range request

A missing repo is 404 RepoNotFound; a gated repo answers its files with 401 GatedRepo without a token
and 403 GatedRepo for a token not granted. `drop_after[path] = n` cuts the first download of that
file after n bytes; `gone_after_drop` then stops the server, as a network that goes away (from the
moment of the drop: a request that comes before the server has stopped is hung up on unanswered).
With `held` (a threading.Event), each file's second half waits until it is set: a download stays under way
(with `held_files`, only those files' halves wait; the others come whole).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    granted_tokens: set[str] = field(default_factory=set)


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.drop_after: dict[str, int] = {}
        self.gone_after_drop = False
        self.gone = False  # set at a drop with gone_after_drop: no request is answered any more
        self.held: threading.Event | None = None  # set: the files' second halves go
        self.held_files: set[str] | None = None  # those held (None: every file)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add_folder(self, repo_id: str, folder: Path, **options) -> Repo:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.repos[repo_id] = Repo(files, **options)
        return self.repos[repo_id]

    def gets(self, path_end: str) -> list[str | None]:
        """The Range header of every GET of a file whose path ends with `path_end`."""
        return [r for method, path, r in self.requests if method == "GET" and path.endswith("/" + path_end)]

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def _handler(hub):  # the handler class closes over the hub
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.requests.append(("GET", self.path, self.headers.get("Range")))
                self.route(send_body=True)

            def do_HEAD(self):
                hub.requests.append(("HEAD", self.path, None))
                self.route(send_body=False)

            def route(self, send_body: bool):
                if hub.gone:  # the server stops in another thread (shutdown waits up to 0.5 s for its loop)
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                path, _, query = self.path.partition("?")
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
                tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/[^/]+", path)
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
                repo_id = (api or tree or resolve).group(1) if (api or tree or resolve) else None
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self.error(404, "RepoNotFound", "Repository not found")
                if api:
                    blobs = "blobs=True" in query or "blobs=true" in query
                    return self.json({"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                                      "gated": "manual" if repo.gated else False,
                                      "siblings": [{"rfilename": name, **({"size": len(data)} if blobs else {})}
                                                   for name, data in repo.files.items()]})
                if tree:
                    return self.json([{"type": "file", "path": name, "size": len(data),
                                       "oid": hashlib.sha1(data).hexdigest()} for name, data in repo.files.items()])
                if repo.gated:
                    token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                    if not token:
                        return self.error(401, "GatedRepo", "Access to this model is restricted: log in")
                    if token not in repo.granted_tokens:
                        return self.error(403, "GatedRepo", "Access to this model is restricted: not granted")
                data = repo.files.get(resolve.group(2))
                if data is None:
                    return self.error(404, "EntryNotFound", "Entry not found")
                self.file(repo, resolve.group(2), data, send_body)

            def file(self, repo: Repo, name: str, data: bytes, send_body: bool):
                start = 0
                if send_body and (wanted := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")):
                    start = int(wanted.group(1))
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", repo.sha)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not send_body:
                    return
                cut = hub.drop_after.pop(name, None)
                if cut is None and hub.held is not None and (hub.held_files is None or name in hub.held_files):
                    half = start + (len(data) - start) // 2
                    self.wfile.write(data[start:half])
                    self.wfile.flush()
                    hub.held.wait(120)
                    self.wfile.write(data[half:])
                    return
                if cut is None:
                    self.wfile.write(data[start:])
                    return
                self.wfile.write(data[start:start + cut])
                self.wfile.flush()
                hub.gone = hub.gone_after_drop  # before the peer sees the cut and asks again
                self.close_connection = True
                self.connection.shutdown(2)  # the peer sees the stream end early
                if hub.gone:
                    threading.Thread(target=hub.stop, daemon=True).start()

            def json(self, value):
                body = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def error(self, status: int, code: str, message: str):
                body = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

        return Handler
