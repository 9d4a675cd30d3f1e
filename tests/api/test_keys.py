"""API keys per user (app.api.keys): each key acts as its user, stored responses stay that user's, and only
LLAMA_MODEL_ADMINS' users pull, delete or unload models through the API. In process, over a scripted backend."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from support.scripted_backend import ScriptedBackend

from app.api import keys
from app.api.keys import KEY_USER, ApiKeys, KeysFile
from app.messages import Done, Stats, Text
from app.settings import Settings, SettingsError

SINGLE = "the-one-shared-key"


def test_the_keys_file_keeps_digests_names_its_mistakes_and_is_read_again_when_it_changes(tmp_path, capsys):
    path = tmp_path / "keys"
    assert keys.main(["add", "alice", "--file", str(path)]) == 0
    alice = capsys.readouterr().out.strip().splitlines()[-1]
    assert keys.main(["add", "bob", "--file", str(path)]) == 0
    bob = capsys.readouterr().out.strip().splitlines()[-1]
    text = path.read_text()
    assert alice not in text and bob not in text and text.count(":sha256:") == 2  # digests only
    assert path.stat().st_mode & 0o077 == 0  # readable by its owner only
    given = ApiKeys(SINGLE, path)
    assert (given.user(alice), given.user(bob), given.user(SINGLE)) == ("alice", "bob", KEY_USER)
    assert given.user("llama-" + "x" * 43) is None and given.user("") is None and given.user("\xff\u00e9") is None

    assert keys.main(["remove", "bob", "--file", str(path)]) == 0
    assert given.user(bob) is None and given.user(alice) == "alice"  # read again: bob's key went at once
    for bad in ("a:b", " a", "#a", "a\nb"):
        assert keys.main(["add", bad, "--file", str(path)]) == 2
    assert "cannot be stored" in capsys.readouterr().err

    path.write_text(path.read_text() + "carol:my-plain-key\n")  # written by hand, wrongly: no key of the file works
    assert given.user(alice) is None and given.user(SINGLE) == KEY_USER
    with pytest.raises(SettingsError, match=r"LLAMA_API_KEYS=.*line 2: 'carol''s key is not a sha256:HEX digest.*"
                                            r"python -m app.api.keys add carol"):
        KeysFile(path)
    with pytest.raises(SettingsError, match=r"LLAMA_API_KEYS=.*cannot read the file"):
        KeysFile(tmp_path / "missing")


class Models(ScriptedBackend):
    """Two models: the default "tiny" (in memory), and "Other", a folder of the weights folder."""

    def __init__(self, folder: Path):
        super().__init__([Text("scripted", "Noted."), Done("scripted", "Noted.", "stop", Stats(new_tokens=2))])
        self.profiles = {"tiny": str(folder / "tiny"), "Other": str(folder / "Other")}

    def in_memory(self, name):
        return name == "tiny" and ("tiny", 0) not in self.kept  # (unloaded by a keep_alive of 0)

    async def find_models(self):
        self.profiles = {name: where for name, where in self.profiles.items() if Path(where).is_dir()}


def test_each_key_is_its_user_and_only_model_admins_manage_models(tmp_path, monkeypatch):
    """Two keys of the file (alice, a model admin, and bob) and the single key (the user api-key): a stored
    response is its user's alone (another's id is a 404), and bob's and api-key's pull, delete and unload are 403s
    naming the rule (and so is a keep_alive, which says how long a model stays loaded for everyone), where alice's
    are done; asking for a model here already, and using one, is anyone's."""
    from app.api.routes import create_app
    from app.weights import Weights

    def downloaded(self, pull, loop):  # a pull that ends at once (the fetch itself is tested elsewhere)
        loop.call_soon_threadsafe(self._finish, pull)
    monkeypatch.setattr(Weights, "_download", downloaded)
    weights_dir = tmp_path / "weights"
    for name in ("tiny", "Other"):
        (weights_dir / name).mkdir(parents=True)
    key_of = {name: keys.add(tmp_path / "keys", name) for name in ("alice", "bob")} | {KEY_USER: SINGLE}
    settings = Settings(auth="password", password="x", api_key=SINGLE, api_keys_file=tmp_path / "keys",
                        model_admins=("alice",))
    backend = Models(weights_dir)
    app = create_app(backend, ApiKeys.from_settings(settings), weights_dir=weights_dir,
                     may_manage=settings.may_manage_models)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            def as_(user):
                return {"Authorization": f"Bearer {key_of[user]}"}

            said = {}
            stored = (await http.post("/v1/responses", json={"model": "tiny", "input": "Hi"}, headers=as_("alice"))).json()
            said["read"] = {user: (await http.get(f"/v1/responses/{stored['id']}", headers=as_(user))).status_code
                            for user in key_of}
            said["continued"] = {user: (await http.post("/v1/responses", headers=as_(user), json={
                "model": "tiny", "input": "And?", "previous_response_id": stored["id"]})).status_code for user in key_of}
            said["deleted by others"] = {user: (await http.delete(f"/v1/responses/{stored['id']}", headers=as_(user))).status_code
                                         for user in ("bob", KEY_USER)}
            for user in ("bob", KEY_USER):
                said[user] = [await http.request("DELETE", "/api/delete", json={"model": "Other"}, headers=as_(user)),
                              await http.post("/api/pull", json={"model": "acme/New", "stream": False}, headers=as_(user)),
                              await http.post("/api/generate", json={"model": "tiny", "keep_alive": 0}, headers=as_(user)),
                              await http.post("/api/chat", json={"model": "tiny", "keep_alive": "-1", "stream": False,
                                                                 "messages": [{"role": "user", "content": "Hi"}]},
                                              headers=as_(user)),
                              await http.post("/api/pull", json={"model": "tiny", "stream": False}, headers=as_(user)),
                              await http.post("/api/chat", json={"model": "tiny", "stream": False, "messages": [
                                  {"role": "user", "content": "Hi"}]}, headers=as_(user))]
            said["users"] = [options["user"] for _, _, options in backend.asked]
            said["alice"] = [await http.request("DELETE", "/api/delete", json={"model": "Other"}, headers=as_("alice")),
                             await http.post("/api/pull", json={"model": "acme/New", "stream": False}, headers=as_("alice")),
                             await http.post("/api/generate", json={"model": "tiny", "keep_alive": 0}, headers=as_("alice"))]
            return said

    said = asyncio.run(scenario())
    assert said["read"] == {"alice": 200, "bob": 404, KEY_USER: 404}
    assert said["continued"] == {"alice": 200, "bob": 404, KEY_USER: 404}
    assert said["deleted by others"] == {"bob": 404, KEY_USER: 404}
    assert [user for user in said["users"]] == ["alice", "alice", "bob", KEY_USER]  # (whose request: KV cache reuse)
    for user in ("bob", KEY_USER):
        delete, pull, unload, pinned, here, used = said[user]
        for refused in (delete, pull, unload, pinned):
            assert refused.status_code == 403, refused.text
            assert "Only the users named in LLAMA_MODEL_ADMINS" in refused.json()["error"] and repr(user) in refused.json()["error"]
        assert here.status_code == 200 and here.json() == {"status": "success"}
        assert used.status_code == 200 and used.json()["message"]["content"] == "Noted."  # using a model is anyone's
    assert [r.status_code for r in said["alice"]] == [200, 200, 200], [r.text for r in said["alice"]]
    assert not (weights_dir / "Other").exists()
    assert [kept for kept in backend.kept if kept[1] is not None] == [("tiny", 0)]  # alice's unload, none of the others'



def test_without_model_admins_keys_manage_models_only_where_nobody_signs_in():
    """LLAMA_MODEL_ADMINS unset: every key's user manages models on a server without sign-in (one person's
    machine), none where sign-in is on; set, exactly the users it names, the single key's by its name."""
    assert Settings(api_key=SINGLE).may_manage_models(KEY_USER)
    signed_in = dict(auth="password", password="x", api_key=SINGLE)
    assert not Settings(**signed_in).may_manage_models(KEY_USER) and not Settings(**signed_in).may_manage_models("alice")
    assert Settings(**signed_in, model_admins=(KEY_USER,)).may_manage_models(KEY_USER)
    assert not Settings(**signed_in, model_admins=("alice",)).may_manage_models(KEY_USER)
