"""Where a pull writes: every folder a GGUF address, a Hub id or --name leads to is directly inside the weights
folder (model/convert/folder.py model_folder), whatever the address's percent-encoding says; a refused or failed
pull leaves nothing behind but a download worth resuming; the free space is checked as the file is written, also
when the server sends no Content-Length. Against a local HTTP server standing in for a GGUF's host."""

from __future__ import annotations

import os
import threading
from collections import namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import model.convert.folder as folder_module
import model.convert.url as url_module
from model.convert.folder import ConversionError, model_folder
from model.convert.hub import download, is_repo_id
from model.convert.url import fetch_gguf_url, gguf_file_name


class Host:
    """Answers every GET with `body` (with a Content-Length unless `sized` is False), or with `status`."""

    def __init__(self):
        self.body, self.sized, self.status, self.paths = b"not a GGUF file at all", True, 200, []
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                host.paths.append(self.path)
                self.send_response(host.status)
                if host.sized:
                    self.send_header("Content-Length", str(len(host.body) if host.status == 200 else 0))
                self.end_headers()
                if host.status == 200:
                    self.wfile.write(host.body)
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def host():
    host = Host()
    yield host
    host.server.shutdown()


@pytest.fixture
def places(tmp_path, host):
    """(weights folder, a folder beside it that nothing may be written into); the host answers as at first."""
    host.body, host.sized, host.status = b"not a GGUF file at all", True, 200
    weights, outside = tmp_path / "weights", tmp_path / "outside"
    weights.mkdir()
    outside.mkdir()
    return namedtuple("Places", "weights outside")(weights, outside)


def everything(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_an_address_whose_name_decodes_to_a_path_writes_only_inside_the_weights_folder(host, places):
    """The name is the address's last path part after percent-decoding (%2F is a '/'): an absolute path, a path up
    and out, backslashes; the download is then refused (not a GGUF) and its folder removed."""
    escapes = [f"/g/{str(places.outside / 'pwned.gguf').replace('/', '%2F')}",
               "/g/sub%2F..%2F..%2Foutside%2Fescaped.gguf", "/g/..%2F..%2Foutside%2Fup.gguf"]
    for path in escapes:
        with pytest.raises(ConversionError, match="not a GGUF file"):
            fetch_gguf_url(host.url + path, places.weights)
    assert everything(places.outside) == [] and everything(places.weights) == []
    for path, says in (("/g/a%5Cb.gguf", "is not a file name"), ("/g/%2E%2E.gguf", "is not a file name"),
                       ("/g/..%2F.gguf", "not the address of a .gguf file"),
                       ("/g/x%00y.gguf", "is not a file name")):
        seen = len(host.paths)
        with pytest.raises(ConversionError, match=says):
            fetch_gguf_url(host.url + path, places.weights)
        assert len(host.paths) == seen  # refused before asking the host
    assert everything(places.weights) == []
    assert gguf_file_name("http://h/a/%2Fetc%2Fmodel.Q4_K_M.gguf") == "model.Q4_K_M.gguf"


@pytest.mark.parametrize("name", ["../outside/x", "/tmp/x", "..", ".hidden", "a/b", "a\\b", "x\x00y", "x\ny", "é" * 128])
def test_a_chosen_name_that_is_not_one_folder_inside_is_refused_before_anything_is_written(host, places, name):
    seen = len(host.paths)
    with pytest.raises(ConversionError, match="is not a model folder's name"):
        fetch_gguf_url(f"{host.url}/g/model.gguf", places.weights, name=name)
    with pytest.raises(ConversionError, match="is not a model folder's name"):
        download("owner/model", places.weights, name=name, endpoint=host.url)
    assert len(host.paths) == seen and everything(places.weights) == [] and everything(places.outside) == []


def test_a_folder_name_that_is_a_link_out_of_the_weights_folder_is_refused(places):
    os.symlink(places.outside, places.weights / "linked")
    with pytest.raises(ConversionError, match="leads outside"):
        model_folder(places.weights, "linked")
    assert model_folder(places.weights, "Llama-3.2-1B-Instruct-Q4_K_M") == places.weights / "Llama-3.2-1B-Instruct-Q4_K_M"


def test_hub_ids_follow_the_hubs_own_rule():
    assert is_repo_id("meta-llama/Llama-3.2-1B-Instruct") and is_repo_id("bartowski/Llama-3.2-3B-Instruct-GGUF")
    for bad in ("ownér/módel", "a--b/c", "a/b..c", "a/..", "a/.b", "-a/b", "a/b/c", "a", "x" * 97 + "/y", "a/b\n"):
        assert not is_repo_id(bad), bad


def test_a_refused_download_leaves_nothing_and_a_cut_one_is_kept_to_resume(host, places):
    host.status = 404
    with pytest.raises(ConversionError, match="answered 404"):
        fetch_gguf_url(f"{host.url}/g/missing.gguf", places.weights)
    assert everything(places.weights) == []
    host.status, host.body = 200, b"GGUF" + bytes(3000)  # a GGUF the import refuses: its download goes too
    with pytest.raises(ConversionError, match="corrupt GGUF"):
        fetch_gguf_url(f"{host.url}/g/broken.gguf", places.weights)
    assert everything(places.weights) == []
    partial = places.weights / ".kept.download"
    partial.mkdir()
    (partial / "kept.gguf").write_bytes(b"GGUF" + bytes(100))  # an earlier try's bytes: worth going on from
    host.status = 500
    with pytest.raises(ConversionError, match="answered 500"):
        fetch_gguf_url(f"{host.url}/g/kept.gguf", places.weights)
    assert (partial / "kept.gguf").stat().st_size == 104


@pytest.mark.parametrize("sized", [True, False], ids=["with-length", "without-length"])
def test_the_free_space_is_checked_as_the_file_is_written(host, places, monkeypatch, sized):
    """A disk that fills while the file comes (the server's Content-Length, when it sends one, fit at first):
    the download stops saying so and keeps nothing of a download that began here."""
    host.body, host.sized = b"GGUF" + bytes(3 * url_module.CHUNK_BYTES), sized
    real = folder_module.shutil.disk_usage
    checks = []

    def filling(path):
        checks.append(path)
        usage = real(path)
        free = url_module.SPARE_BYTES + 4 * url_module.CHUNK_BYTES if len(checks) == 1 else url_module.SPARE_BYTES // 2
        return usage._replace(free=free)

    monkeypatch.setattr(folder_module.shutil, "disk_usage", filling)
    monkeypatch.setattr(url_module, "CHECK_EVERY", 1)
    with pytest.raises(ConversionError, match="not enough disk space"):
        fetch_gguf_url(f"{host.url}/g/big.gguf", places.weights)
    assert len(checks) == 2 and everything(places.weights) == []


def test_an_address_whose_model_is_here_already_is_refused_before_the_download(host, places):
    (places.weights / "here").mkdir()
    seen = len(host.paths)
    with pytest.raises(ConversionError, match="already exists; pass --force"):
        fetch_gguf_url(f"{host.url}/g/here.gguf", places.weights)
    assert len(host.paths) == seen and everything(places.weights) == ["here"]
