"""A GGUF file named by its address (https://host/.../model.gguf): downloaded into a hidden folder beside the
models (weights/.NAME.download/, as a Hugging Face download is), going on from the bytes already there when an
earlier try was cut, then imported as a GGUF file on disk is (model.convert.gguf), and the download deleted.

Plain HTTP(S) with the standard library: a Range request resumes, and a server that ignores it sends the
whole file again."""

from __future__ import annotations

import http.client
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from .folder import ConversionError, check_free_space, model_folder, note_source, partial_folder

URL = re.compile(r"https?://\S+", re.IGNORECASE)
CHUNK_BYTES = 1 << 20
SPARE_BYTES = 10_000_000
TIMEOUT_S = 60
CHECK_EVERY = 64  # MB written between two checks of the free space


def is_url(source: str) -> bool:
    return bool(URL.fullmatch(source))


def gguf_file_name(url: str) -> str:
    """The name of the .gguf file an address names: the last part of its path once percent-decoded (decoded
    first: `%2F` is a '/'), one file's name ending in .gguf, else a ConversionError."""
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    name = path.rsplit("/", 1)[-1]
    if not name.lower().endswith(".gguf") or len(name) == len(".gguf"):
        raise ConversionError(f"{url[:200]}: not the address of a .gguf file")
    if name.startswith(".") or "\\" in name or any(ord(c) < 32 for c in name):
        raise ConversionError(f"{url[:200]}: {name[:80]!r} is not a file name a model folder can take")
    return name


def fetch_gguf_url(url: str, weights_dir: Path, name: str | None = None, force: bool = False,
                   on_files: Callable[[dict[str, int]], None] | None = None) -> list[Path]:
    """Download the GGUF at `url` and import it into weights_dir (as `name`, default its file's); returns the
    folder written. on_files: told the file and its size once the server has said it."""
    file_name = gguf_file_name(url)
    out_dir = model_folder(weights_dir, name or file_name[:-len(".gguf")])
    if out_dir.exists() and not force:  # (asked before the download, which a refused import deletes)
        raise ConversionError(f"{out_dir} already exists; pass --force to replace it, or --name to choose "
                              "another folder")
    partial = partial_folder(out_dir)
    target = model_folder(partial, file_name)  # (partial is created below: resolved, its parent is weights_dir's)
    new = not partial.exists()
    partial.mkdir(parents=True, exist_ok=True)
    note_source(partial, url, None)
    have = target.stat().st_size if target.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            if have and response.status != 206:  # the server sends the whole file again
                have = 0
            total = have + int(response.headers.get("Content-Length") or 0)
            if on_files is not None:
                on_files({file_name: total})
            check_free_space(weights_dir, total - have + SPARE_BYTES)
            with open(target, "ab" if have else "wb") as out:
                while chunk := response.read(CHUNK_BYTES):
                    out.write(chunk)
                    # the free space again as it writes, whatever the server said the size is (or did not say)
                    if (out.tell() // CHUNK_BYTES) % CHECK_EVERY == 0:
                        check_free_space(weights_dir, SPARE_BYTES)
            if target.stat().st_size < total:  # the connection ended before the file did
                raise ConnectionError("the server closed the connection")
    except ConversionError:  # no room: nothing kept of a download that had not begun before
        if new or not (target.is_file() and target.stat().st_size):
            shutil.rmtree(partial, ignore_errors=True)
        raise
    except urllib.error.HTTPError as e:
        if e.code != 416:  # 416: nothing past what is here: the file is whole
            if new:
                shutil.rmtree(partial, ignore_errors=True)
            raise ConversionError(f"{url}: the server answered {e.code} {e.reason}; check the address") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        here = target.stat().st_size / 1e6 if target.is_file() else 0
        reason = getattr(e, "reason", None) or e
        raise ConversionError(f"{url}: the download was cut ({reason}) with {here:.0f} MB here; run the same "
                              "again to go on from them") from None
    with open(target, "rb") as f:
        magic, size = f.read(4), target.stat().st_size
    if magic != b"GGUF":  # the whole file came, and is something else (a page): nothing to go on from
        shutil.rmtree(partial, ignore_errors=True)
        raise ConversionError(f"{url}: the server sent {size:,} bytes that are not a GGUF file; check the address "
                              "(a model page's address is not its file's)")
    from .gguf import import_ggufs  # (gguf and numpy: not for the web process, which checks addresses with URL)

    try:
        return import_ggufs(target, weights_dir, name, force)
    finally:  # imported, or refused as a GGUF (its type, its architecture): the download is of no more use
        shutil.rmtree(partial, ignore_errors=True)
