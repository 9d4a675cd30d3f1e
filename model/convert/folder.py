"""Writing a model folder into `weights/` so that it is whole or absent.

A folder is built in a hidden sibling (`.NAME.tmp-*`, or `.NAME.download` for a download, which a
later run resumes) and renamed into place when complete; the app and the engine skip hidden folders.
A failure leaves `weights/` as it was, apart from a download's hidden folder, kept to resume from.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path


# A tag that names a quantization (Ollama's hf.co/owner/name:Q4_K_M), not a revision: which .gguf of the repo to fetch
QUANTIZATION = re.compile(r"(I?Q[1-8](_[0-9A-Z]+)*|F16|BF16|F32)", re.IGNORECASE)


class ConversionError(Exception):
    """A model that cannot be brought into weights/ (bad file, failed download, full disk); the message
    says why and what to do. `status`: the HTTP status a server that ran it for a client answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def log(message: str) -> None:
    print(f"[fetch] {message}", file=sys.stderr, flush=True)


def is_quantization(tag: str | None) -> bool:
    return tag is not None and bool(QUANTIZATION.fullmatch(tag))


def folder_name(repo_id: str, revision: str | None = None) -> str:
    """The model folder a pull of a Hugging Face repo writes: the repo's name, and a quantization tag's after it
    (bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M -> Llama-3.2-1B-Instruct-GGUF-Q4_K_M)."""
    name = repo_id.split("/")[-1]
    return f"{name}-{revision.upper()}" if is_quantization(revision) else name


def model_folder(weights_dir: str | Path, name: str) -> Path:
    """weights_dir/name, the folder a pull or an import writes: refused (ConversionError) unless `name`, as it will
    be used (every percent-decoding done by the caller), is one folder's name directly inside weights_dir: no
    path separator, NUL or control character, not `.`, `..` or hidden (the name of a download's folder), at
    most 255 bytes; and the folder, resolved (symbolic links followed), must be inside weights_dir resolved."""
    shown = repr(name[:80])
    if (not name or name.startswith(".") or any(c in name for c in "/\\") or any(ord(c) < 32 for c in name)
            or len(name.encode("utf-8", "surrogatepass")) > 255):
        raise ConversionError(f"{shown} is not a model folder's name: expected one name of at most 255 bytes, "
                              "without '/', '\\' or control characters, not beginning with '.'")
    weights = Path(weights_dir)
    folder = weights / name
    if folder.resolve().parent != weights.resolve():
        raise ConversionError(f"{shown}: {folder} leads outside {weights} (a link); choose another name")
    return folder


def remove_stale_siblings(out_dir: Path) -> None:
    """Temp folders left by a conversion that crashed: `.NAME.tmp-*` and `.NAME.old-*`."""
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for stale in out_dir.parent.glob(pattern):
            log(f"removing {stale} left by an earlier run")
            shutil.rmtree(stale, ignore_errors=True)


def check_free_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ConversionError(f"{folder}: not enough disk space for the model: need {needed / 1e6:.0f} MB, "
                              f"{free / 1e6:.0f} MB free; free some space and run again", 507)


def move_into_place(built: Path, out_dir: Path) -> None:
    """`os.replace` cannot overwrite a full folder, so an old one is first moved aside, then deleted."""
    if not out_dir.exists():
        built.replace(out_dir)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    out_dir.replace(aside / out_dir.name)
    try:
        built.replace(out_dir)
    except OSError:
        (aside / out_dir.name).replace(out_dir)  # put the old folder back
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def make_parent(out_dir: Path) -> Path | None:
    """Create `out_dir`'s parent if missing; returns it when this call created it (for `undo`)."""
    made = None if out_dir.parent.exists() else out_dir.parent
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConversionError(f"{out_dir.parent}: cannot create the folder: {e}") from None
    return made


def new_build_folder(out_dir: Path) -> Path:
    """An empty hidden sibling of `out_dir` to build the model in."""
    building = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    building.chmod(0o755)  # mkdtemp makes it private; the final folder should not be
    return building


def undo(building: Path | None, made_parent: Path | None) -> None:
    if building is not None:
        shutil.rmtree(building, ignore_errors=True)
    if made_parent is not None:
        try:
            made_parent.rmdir()  # only if still empty
        except OSError:
            pass


def write_error(e: OSError, out_dir: Path, size: int) -> ConversionError:
    if e.errno == errno.ENOSPC:
        return ConversionError(f"{out_dir.parent}: no space left on device while writing the model "
                               f"({size / 1e6:.0f} MB); free some space and run again")
    return ConversionError(f"{out_dir}: cannot write the model: {e}")


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def partial_folder(out_dir: Path) -> Path:
    """Where a download into `out_dir` gathers its files (hidden: the engine skips it), and resumes from."""
    return out_dir.parent / f".{out_dir.name}.download"


SOURCE_FILE = ".llama-source.json"  # in a download folder, and the model folder it becomes: which repo it is of


def note_source(partial: Path, repo_id: str, revision: str | None) -> None:
    """Write down which repo (and revision) a download folder gathers, so that the server can offer to go on
    with it after a restart (app.web.models_panel); it moves into place with the files, so that a pull of
    another repo of the same name is told apart (app.weights)."""
    partial.mkdir(parents=True, exist_ok=True)
    write_json(partial / SOURCE_FILE, {"repo_id": repo_id, "revision": revision})


def source_of(folder: Path) -> tuple[str, str | None] | None:
    """(repo id, revision) of a download or model folder, as note_source wrote it; None when it did not (a
    download begun by an older version kept it in .cache/)."""
    for note in (folder / SOURCE_FILE, folder / ".cache" / SOURCE_FILE.lstrip(".")):
        try:
            said = json.loads(note.read_text(encoding="utf-8"))
            break
        except (OSError, ValueError):
            continue
    else:
        return None
    if not isinstance(said, dict) or not isinstance(said.get("repo_id"), str):
        return None
    return said["repo_id"], said.get("revision") if isinstance(said.get("revision"), str) else None
