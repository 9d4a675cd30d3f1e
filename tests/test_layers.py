"""Each process imports only what it runs: the web process (the chat app, the API) no torch and no
tokenizer, the engine process no web framework (nor app/web, app/api), `model/` neither the app nor a
web framework.

Every check imports in a fresh interpreter (what this test process has loaded does not count) and
names, for each module it imports, what that import brought in, so a failure says who is to blame.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest
from support.servers import ROOT, server_env

import app.files
import model

pytestmark = pytest.mark.timeout(300)

WEB_FRAMEWORKS = {"chainlit", "fastapi", "starlette", "uvicorn", "socketio", "engineio"}
# The model and what only the engine runs: no torch, no tokenizer, no prompt budgets in the web process.
ENGINE_ONLY = {"torch", "tiktoken", "tokenizers", "llguidance", "app.engine", "model.checkpoint", "model.generation",
               "model.decoding", "model.tokenizer"}  # (a package: every module in it)
# The web process: the chat app (which mounts the API), the API alone (`python -m app.api` runs it with
# uvicorn) and the history export; each model's description, read at run time.
WEB = ["app.main", "app.api.routes", "app.web.export", "uvicorn"]
ENGINE = ["app.engine.core", "app.engine.models", "app.engine.sequence", "app.engine.scheduler",
          "app.engine.prefix_cache", "app.engine.kv_disk", "app.engine.outbox", "app.engine.prompt",
          "model.structured", "model.convert.prepare_default"]  # (the last two: imported when first needed)
TORCH_FREE = ["model.config", "model.checkpoint_files", "model.summary", "model.context", "model.unicode",
              "model.tools", "app.messages", "app.engine.prompt"]
# Files in a message: read by the web process and the API, chunked, ranked and rendered by the engine too.
FILES = ["app.files.read", "app.files.chunks", "app.files.prompt"]

PROBE = """
import importlib, json, sys
spec = json.loads(sys.argv[1])
brought = {}
for name in spec["imports"]:
    before = set(sys.modules)
    importlib.import_module(name)
    brought[name] = sorted(set(sys.modules) - before)
before = set(sys.modules)
exec(spec.get("then", ""))
brought["(then)"] = sorted(set(sys.modules) - before)
chat = sys.modules.get("app.web.chat")
if chat is not None:
    chat.BACKEND.close()  # the engine process it started on import
print(json.dumps(brought))
"""


def probe(imports: list[str], then: str = "", **env) -> dict[str, list[str]]:
    """Import the modules in a fresh interpreter, in order, then run `then`: what each step brought in."""
    run = subprocess.run([sys.executable, "-c", PROBE, json.dumps({"imports": imports, "then": then})], cwd=ROOT,
                         env=server_env(**env), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def assert_none_of(forbidden: set[str], brought: dict[str, list[str]]) -> None:
    """No step brought in a forbidden module or a module of a forbidden package; else name, for each step,
    those it did."""
    def of(module: str) -> str | None:  # the forbidden name (a module, or a package it is in) it falls under
        return next((f for f in forbidden if module == f or module.startswith(f + ".")), None)
    found = {step: sorted({of(m) for m in modules if of(m)}) for step, modules in brought.items()}
    found = {step: modules for step, modules in found.items() if modules}
    assert not found, f"imported where they do not belong (importing -> what it brought in): {found}"


def test_the_web_process_imports_no_torch_no_tokenizer_and_nothing_of_the_engine(tiny, tmp_path):
    brought = probe(WEB, then=f"from model.summary import summarize; summarize({str(tiny)!r})",
                    checkpoint=tiny, weights_dir=tiny.parent, history_db=tmp_path / "history.db", threads=1)
    assert "chainlit" in brought["app.main"] and "app.api" in brought["app.main"]  # it did import the app
    assert_none_of(ENGINE_ONLY, brought)


def test_the_engine_process_imports_no_web_framework():
    brought = probe(ENGINE)
    assert "torch" in brought["app.engine.core"]  # (what it does import is seen)
    assert "app.private_files" in brought["app.engine.core"]  # (the KV caches on disk: owner-only files)
    assert_none_of(WEB_FRAMEWORKS | {"app.web", "app.api"}, brought)


def test_no_module_of_model_imports_the_app_or_a_web_framework():
    modules = [m.name for m in pkgutil.walk_packages(model.__path__, "model.")]
    assert {"model.checkpoint", "model.convert.gguf", "model.summary"} <= set(modules)
    brought = probe(modules)
    assert_none_of({"app"} | WEB_FRAMEWORKS, brought)


def test_loading_a_checkpoint_imports_no_compiler(tiny):
    """torch's compiler (1.5 s and 145 MB of imports) only where a compiled step is asked for: torch's normal_ on
    the meta device imported it in every engine process."""
    brought = probe(["model"], then=f"from model import load_checkpoint; load_checkpoint({str(tiny)!r})")
    assert "model.llama" in brought["(then)"]  # (it did load)
    assert_none_of({"torch._dynamo", "torch._inductor"}, brought)


@pytest.mark.parametrize("name", TORCH_FREE)
def test_what_the_web_side_shares_with_the_engine_imports_no_torch(name):
    brought = probe([name])
    assert name in brought[name]
    assert_none_of({"torch", "tiktoken", "tokenizers"}, brought)


def test_the_files_package_imports_no_torch_no_tokenizer_and_no_web_framework():
    modules = [m.name for m in pkgutil.walk_packages(app.files.__path__, "app.files.")]
    assert set(FILES) <= set(modules)
    # what reading and ranking bring in when they run (pypdf, bm25s), not only at import
    brought = probe(modules, then="from app.files.read import read_file; from app.files.chunks import chunks, rank; "
                                  "a = read_file('a.txt', b'one two three'); rank(chunks(a), 'two')")
    assert "bm25s" in brought["(then)"]  # (what it does import is seen)
    assert_none_of({"torch", "tiktoken", "tokenizers", "app.engine", "app.web", "app.api"} | WEB_FRAMEWORKS, brought)
