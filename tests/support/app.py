"""app.main imported as `chainlit run` imports it (yielding its handlers, app.web.chat), with the LLAMA_* variables a test chooses."""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from contextlib import contextmanager


@contextmanager
def imported_app(**llama):
    """Yield app.main imported with LLAMA_<NAME>=value for each name=value (every other LLAMA_* unset);
    afterwards the module is forgotten, the environment restored and its service closed."""
    env = {name: "" for name in os.environ  # e.g. from a developer's .env; the machine's cache folder stays
           if name.startswith("LLAMA_") and name != "LLAMA_CACHE_DIR"}
    env |= {f"LLAMA_{name.upper()}": str(value) for name, value in llama.items()}
    if "kv_disk_dir" not in llama:  # not the KV caches of the developer's chats
        env["LLAMA_KV_DISK_DIR"] = tempfile.mkdtemp(prefix="llama-kv-")
    if "max_context" not in llama:  # the tiny models' own 131,072 would take hostile input in (support/servers.py)
        env["LLAMA_MAX_CONTEXT"] = "8192"
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    forget()
    main = None
    try:
        importlib.import_module("app.main")
        main = sys.modules["app.web.chat"]  # the handlers, started as `chainlit run app/main.py` starts them
        yield main
    finally:
        forget()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if main is not None:
            main.BACKEND.close()


def forget() -> None:
    """The next import of app.main runs it again, and imports app.web.chat again (`from app.web import chat`
    would take the package's attribute, left from the last import, without running it)."""
    for module in ("app.main", "app.web.chat"):
        sys.modules.pop(module, None)
    web = sys.modules.get("app.web")
    if web is not None and hasattr(web, "chat"):
        delattr(web, "chat")
