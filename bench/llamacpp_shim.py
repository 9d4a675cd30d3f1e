"""A pytest plugin that runs llama.cpp's server tests (`tools/server/tests`) against our API server.

Their harness (`utils.py`, `ServerProcess.start`) starts a `llama-server` binary with the settings a test gave
it; here `start` points the test at `python -m app.api` instead, started with the settings of theirs that we
have (API key, context size, reply length) and kept for the next test that asks for the same ones. llama-server
also answers some OpenAI routes without their /v1 (`/chat/completions`), which their tests mostly call: those
paths get the /v1 here; its own routes (`/completion`, `/slots`, `/props`, `/tokenize`, ...) go as they are. The model
is the random Llama 3 checkpoint that `COMPAT_WEIGHTS` (a weights folder) holds, named as their preset's
alias, so a test that names its model finds it. Load it with `-p llamacpp_shim`, with this folder and the
project's `tests/` on the path.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import utils  # theirs: the tests' folder is the rootdir, first on the path
from support.servers import ApiServer, server_env

WEIGHTS = Path(os.environ["COMPAT_WEIGHTS"])
LOGS = Path(os.environ.get("COMPAT_LOGS", WEIGHTS.parent))
servers: dict[tuple, ApiServer] = {}


def ours(settings: tuple) -> ApiServer:
    """Our server for these settings, the one running for other settings stopped first (2 cores)."""
    if settings not in servers:
        for server in servers.values():
            server.stop()
        servers.clear()
        api_key, n_ctx, n_predict, alias = settings
        llama = {"checkpoint": WEIGHTS / alias, "weights_dir": WEIGHTS, "dtype": "fp32", "threads": 1}
        llama |= {"api_key": api_key} if api_key else {}
        llama |= {"max_context": n_ctx} if n_ctx else {}
        llama |= {"max_new_tokens": n_predict} if n_predict and n_predict > 0 else {}
        server = ApiServer(server_env(**llama), log=LOGS / f"api-{len(list(LOGS.glob('api-*.log')))}.log")
        server.wait_ready()
        servers[settings] = server
    return servers[settings]


def start(self, timeout_seconds: int = utils.DEFAULT_HTTP_TIMEOUT) -> None:
    alias = self.model_alias if self.model_alias and (WEIGHTS / self.model_alias).is_dir() else "tinyllama-2"
    server = ours((self.api_key, self.n_ctx, self.n_predict, alias))
    self.server_host, self.server_port = "127.0.0.1", server.port
    utils.server_instances.add(self)


OPENAI_PATHS = ("/chat/completions", "/models", "/responses", "/embeddings")  # (/completions is its own route there)
their_url = utils.ServerProcess.make_url


def make_url(self, path: str, host: str | None = None) -> str:
    return their_url(self, f"/v1{path}" if path.startswith(OPENAI_PATHS) else path, host)


def stop(self) -> None:
    utils.server_instances.discard(self)


utils.ServerProcess.start = start
utils.ServerProcess.stop = stop
utils.ServerProcess.make_url = make_url
utils.ServerPreset.load_all = staticmethod(lambda: None)  # (downloads their models)
atexit.register(lambda: [server.stop() for server in servers.values()])
