"""Both backends keep the contract the web side is written against (app.backend.protocol.Backend)."""

import inspect
import re

import pytest

from app.backend.protocol import Backend, is_remote
from app.backend.engine_client import EngineClient
from app.backend.remote import RemoteClient

MEMBERS = sorted(set(Backend.__annotations__) | {name for name, value in vars(Backend).items()
                                                  if not name.startswith("_") and (callable(value)
                                                                                   or isinstance(value, property))})


def parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()
            if p.kind is not p.VAR_KEYWORD]


@pytest.mark.parametrize("backend", [EngineClient, RemoteClient])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_backend_has_each_member_as_declared(backend, name):
    declared = inspect.getattr_static(Backend, name, None)
    if name in Backend.__annotations__:  # data: set in __init__ (or a class attribute)
        assert name in vars(backend) or re.search(rf"self\.{name}\b(: [^=]+)? =", inspect.getsource(backend.__init__)) \
            or isinstance(inspect.getattr_static(backend, name, None), property), f"{backend.__name__}.{name}"
        return
    found = inspect.getattr_static(backend, name, None)
    assert found is not None, f"{backend.__name__} has no {name}"
    if isinstance(declared, property):
        assert isinstance(found, property), f"{backend.__name__}.{name} is not a property"
        return
    assert inspect.iscoroutinefunction(found) == inspect.iscoroutinefunction(declared), name
    ours, theirs = parameters(found), parameters(declared)
    assert ours[:len(theirs)] == theirs, f"{backend.__name__}.{name}{inspect.signature(found)}"
    assert all(default is not inspect.Parameter.empty for _, default in ours[len(theirs):]), \
        f"{backend.__name__}.{name} needs more than the contract gives"


def test_the_contract_names_what_the_web_side_uses():
    assert {"profiles", "default", "ready", "stats", "observers", "places_taken", "restarts", "start", "load",
            "is_loaded", "in_memory", "context_limit", "reply_defaults", "stream", "complete", "cancel",
            "close"} <= set(MEMBERS)


@pytest.mark.parametrize(("where", "remote"), [("http://gpu:8000/v1", True), ("weights/SmolLM2-135M-Instruct", False),
                                               ("/abs/path", False), ("https://x/v1", True)])
def test_is_remote(where, remote):
    assert is_remote(where) is remote
