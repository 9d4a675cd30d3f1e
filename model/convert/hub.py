"""Download a Hugging Face checkpoint into `weights/<name>/` with huggingface_hub.

Only the files the engine reads: config.json, generation_config.json, the safetensors weights (one
file, or shards and their index), the tokenizer's files and `original/tokenizer.model`, each where
the repo has it. The token is huggingface_hub's own: `HF_TOKEN`, else the one `hf auth login` saved.
`endpoint` points at another hub (a mirror, or the tests' stand-in; `python -m model.fetch` takes
`HF_ENDPOINT`).

Files go into `weights/.<name>.download/`, which is renamed to `weights/<name>` once all are there.
An interrupted run leaves that hidden folder; the next run fetches only the files still missing
(huggingface_hub itself resumes a dropped connection within a file). A run that got nothing leaves
`weights/` as it was. Every failure is one ConversionError line that says what to do.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx2  # huggingface_hub's HTTP client: its transport errors mean "no network"
from huggingface_hub import HfApi, get_token, hf_hub_download, snapshot_download
from huggingface_hub.utils import validate_repo_id
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..config import ConfigError, LlamaConfig
from .folder import (QUANTIZATION, ConversionError, check_free_space, folder_name, is_quantization, log,
                     make_parent, model_folder, move_into_place, note_source, partial_folder, undo)

WANTED = re.compile(r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors"
                    r"|model\.safetensors\.index\.json|tokenizer\.json|tokenizer_config\.json"
                    r"|special_tokens_map\.json|chat_template\.jinja|original/tokenizer\.model")
REPO_ID = re.compile(r"\w[\w.-]*/[\w.][\w.-]*", re.ASCII)  # owner/name, neither beginning with '-' (never an option)
REVISION = re.compile(r"\w[\w./-]{0,254}")  # a branch, tag or commit: never an option (-...) nor a path (./, ../)
PREFERRED = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0")  # a GGUF repo's file without a tag: the first of these there
SPARE_BYTES = 10_000_000
HUB_CACHE = ".cache"  # huggingface_hub's bookkeeping inside a download folder


def is_repo_id(repo_id: str) -> bool:
    """owner/name as the Hub itself allows it (huggingface_hub's validate_repo_id: ASCII letters, digits, '-', '_'
    and '.', no '--' or '..', at most 96 characters), checked before a download starts."""
    if not REPO_ID.fullmatch(repo_id):
        return False
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def download(repo_id: str, weights_dir: str | Path = "weights", *, name: str | None = None,
             revision: str | None = None, force: bool = False, endpoint: str | None = None,
             on_files: Callable[[dict[str, int]], None] | None = None) -> Path:
    """`weights_dir/<name>` (default: folder_name) holding the checkpoint; returns it. A repo of .gguf files
    (as llama.cpp's users publish them) gets one file, the one a quantization tag names as `revision` (Q4_K_M),
    else the first of PREFERRED, imported as a GGUF file on disk is (model.convert.gguf). `endpoint`: the hub's
    address (default: huggingface.co). on_files: told the files to fetch and their sizes, before they come into
    `partial_folder(out_dir)` (for a progress report)."""
    if not is_repo_id(repo_id):
        raise ConversionError(f"{repo_id!r}: expected a Hugging Face model id (owner/name, e.g. "
                              "meta-llama/Llama-3.2-1B-Instruct)")
    out_dir = model_folder(weights_dir, name or folder_name(repo_id, revision))
    if out_dir.exists() and not force:
        raise ConversionError(f"{out_dir} already exists; pass --force to download it again, or --name to "
                              "choose another folder")
    partial = partial_folder(out_dir)
    made_parent = make_parent(out_dir)
    try:
        note_source(partial, repo_id, revision)
        files = fetch_into(partial, repo_id, revision, endpoint, on_files)
        shutil.rmtree(partial / HUB_CACHE, ignore_errors=True)
        if len(files) == 1 and files[0].lower().endswith(".gguf"):
            from .gguf import import_ggufs  # (numpy and gguf: only for a GGUF)

            try:
                import_ggufs(partial / files[0], Path(weights_dir), out_dir.name, force)
                note_source(out_dir, repo_id, revision)  # where it came from, as a download's folder says
            finally:  # imported, or refused (its architecture): the download is of no more use
                shutil.rmtree(partial, ignore_errors=True)
        else:
            move_into_place(partial, out_dir)
    except BaseException as e:
        if isinstance(e, NoLlamaCheckpoint) or not files_in(partial):
            undo(partial, made_parent)  # nothing worth resuming: weights/ as it was
        else:
            log(f"kept {partial} ({folder_bytes(partial) / 1e6:.0f} MB): the same command resumes from it")
        raise hub_error(e, repo_id, revision, endpoint, partial) from None
    log(f"wrote {out_dir}: {', '.join(sorted(files))}")
    return out_dir


class NeedsToken(Exception):
    """A gated repo, asked for without a token (hub_error says what to do)."""


class NoLlamaCheckpoint(ConversionError):
    """The repo holds no Llama checkpoint the engine reads (another architecture, or no safetensors)."""


def fetch_into(partial: Path, repo_id: str, revision: str | None, endpoint: str | None,
               on_files: Callable[[dict[str, int]], None] | None = None) -> list[str]:
    """Download the checkpoint's files into `partial`; returns their names."""
    quantization = revision if is_quantization(revision) else None
    info = HfApi(endpoint=endpoint).model_info(repo_id, revision=None if quantization else revision,
                                               files_metadata=True)
    if info.gated and get_token() is None:  # said before any byte, not after the first file's 401
        raise NeedsToken(repo_id)
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or [] if WANTED.fullmatch(s.rfilename)}
    ggufs = {s.rfilename: s.size or 0 for s in info.siblings or [] if s.rfilename.lower().endswith(".gguf")}
    if quantization or (ggufs and "config.json" not in sizes):
        return fetch_gguf(partial, repo_id, info.sha, ggufs, quantization, endpoint, on_files)
    if on_files is not None:
        on_files(sizes)
    if "config.json" not in sizes or not any(f.endswith(".safetensors") for f in sizes):
        found = ", ".join(sorted(s.rfilename for s in info.siblings or [])[:8]) or "no files"
        raise NoLlamaCheckpoint(f"{repo_id}: expected a transformers checkpoint (config.json and "
                                f"model.safetensors) or .gguf files, found {found}")
    missing = sum(size for f, size in sizes.items() if not has_file(partial / f, size))
    log(f"{repo_id} at {info.sha[:12]}: {len(sizes)} files, {sum(sizes.values()) / 1e6:.0f} MB"
        f" ({missing / 1e6:.0f} MB to download)")
    check_free_space(partial.parent, missing + SPARE_BYTES)
    hf_hub_download(repo_id, "config.json", revision=info.sha, local_dir=partial, endpoint=endpoint)
    try:
        LlamaConfig.from_hf_config(partial / "config.json")
    except ConfigError as e:
        raise NoLlamaCheckpoint(f"{repo_id}: {str(e).replace(str(partial / 'config.json'), 'config.json')}; "
                                "this engine runs Llama-architecture models") from None
    snapshot_download(repo_id, revision=info.sha, local_dir=partial, allow_patterns=list(sizes), endpoint=endpoint)
    short = [f for f, size in sizes.items() if not has_file(partial / f, size)]
    if short:  # huggingface_hub hands back what is on disk when it cannot reach the hub
        raise ConversionError(f"{repo_id}: {', '.join(short)} did not arrive; run the same command again")
    return list(sizes)


def fetch_gguf(partial: Path, repo_id: str, sha: str, ggufs: dict[str, int], quantization: str | None,
               endpoint: str | None, on_files: Callable[[dict[str, int]], None] | None) -> list[str]:
    """The repo's .gguf of `quantization` (or the first of PREFERRED) into `partial`; returns [its name]."""
    def tag_of(file: str) -> str | None:  # Llama-3.2-1B-Instruct-Q4_K_M.gguf -> Q4_K_M (split files: none)
        parts = re.split(r"[-.]", file.rsplit("/", 1)[-1][:-len(".gguf")])
        return next((p.upper() for p in reversed(parts) if QUANTIZATION.fullmatch(p)), None)
    whole = {f: size for f, size in ggufs.items() if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f)}
    by_tag = {}
    for file in sorted(whole, key=len):
        by_tag.setdefault(tag_of(file), file)
    wanted = [quantization.upper()] if quantization else list(PREFERRED)
    file = next((by_tag[tag] for tag in wanted if tag in by_tag), None)
    if file is None and not quantization and whole:
        file = min(whole, key=whole.get)
    if file is None:
        have = ", ".join(sorted(t for t in by_tag if t)) or "none"
        raise NoLlamaCheckpoint(f"{repo_id}: no {quantization or 'whole'} .gguf file; its quantizations: {have}")
    if on_files is not None:
        on_files({file: whole[file]})
    here = partial / file
    check_free_space(partial.parent, whole[file] - (here.stat().st_size if here.is_file() else 0) + SPARE_BYTES)
    log(f"{repo_id}: {file}, {whole[file] / 1e6:.0f} MB")
    hf_hub_download(repo_id, file, revision=sha, local_dir=partial, endpoint=endpoint)
    if not has_file(here, whole[file]):
        raise ConversionError(f"{repo_id}: {file} did not arrive; run the same command again")
    return [file]


def files_in(partial: Path) -> list[str]:
    """The checkpoint files already in a download folder."""
    if not partial.is_dir():
        return []
    return [str(p.relative_to(partial)) for p in partial.rglob("*")
            if p.is_file() and (WANTED.fullmatch(str(p.relative_to(partial))) or p.suffix.lower() == ".gguf")]


def has_file(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def hub_error(e: BaseException, repo_id: str, revision: str | None, endpoint: str | None,
              partial: Path) -> BaseException:
    """The one line that says what went wrong and what to do (unknown errors pass through unchanged)."""
    hub = endpoint or "https://huggingface.co"
    if isinstance(e, ConversionError):
        return e
    if isinstance(e, (GatedRepoError, NeedsToken)):
        response = getattr(e, "response", None)
        if get_token() is not None or (response is not None and response.status_code == 403):
            return ConversionError(f"{repo_id} is gated and your token has no access yet: accept its terms at "
                                   f"{hub}/{repo_id} with the account of that token, then run again", 403)
        return ConversionError(f"{repo_id} is gated: accept its terms at {hub}/{repo_id}, then set HF_TOKEN "
                               "(or run `hf auth login`) and run again", 401)
    if isinstance(e, RepositoryNotFoundError):
        return ConversionError(f"{repo_id}: no such model on {hub}; check the id (owner/name), and for a "
                               "private model set HF_TOKEN (or run `hf auth login`)", 404)
    if isinstance(e, RevisionNotFoundError):
        return ConversionError(f"{repo_id}: no revision {revision!r}; use a branch, tag or commit of the repo", 404)
    if isinstance(e, HfHubHTTPError) and e.response is not None and e.response.status_code == 401:
        return ConversionError(f"{hub} refused the token for {repo_id} (HTTP 401); check HF_TOKEN "
                               "(or run `hf auth login` again)", 401)
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "an error"
        return ConversionError(f"{hub} answered HTTP {status} for {repo_id}; try again later", 502)
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled, httpx2.TransportError)):
        return ConversionError(f"cannot reach {hub} ({type(e).__name__}); check the network (or HF_ENDPOINT, "
                               "HF_HUB_OFFLINE, the proxy settings) and run the same command again", 502)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return ConversionError(f"{partial.parent}: no space left on device while downloading {repo_id}; "
                               "free some space and run the same command again", 507)
    if isinstance(e, OSError):
        return ConversionError(f"{partial}: cannot write the download: {e}", 500)
    return e
