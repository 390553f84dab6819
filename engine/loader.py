"""Model files: the bundled model, Hugging Face directories, GGUF files and their metadata cache.

Everything downstream reads a model's config and tokenizer from one shape of directory, a Hugging Face
one (``config.json`` + tokenizer files). A GGUF file's config, tokenizer and chat template come from its
metadata, written once into such a directory under ``$PAGED_CACHE`` (default ``~/.cache/paged``) with a
manifest naming the file; its weights are read from the file itself at every load
(``engine.model_files``), never converted. Nothing here touches the network.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from engine.errors import ModelLoadError  # noqa: E402
from engine.model_types import GGUF_ARCHITECTURES, GGUF_UNSERVED_EMBEDDERS, SUPPORTED_MODEL_TYPES  # noqa: E402
from engine.paths import bundled_gguf_path, cache_root  # noqa: E402

logger = logging.getLogger(__name__)

MANIFEST = "paged-manifest.json"
_MANIFEST_VERSION = 3  # 2: config and tokenizer only (the weights stay in the GGUF file); 3: MoE and Phi-3 configs


def resolve_model(model: str | os.PathLike[str] | None = None) -> Path:
    """The Hugging Face-format directory of ``model``'s config and tokenizer.

    Args:
        model: a Hugging Face model directory, a ``.gguf`` file, or ``None`` for the bundled model.

    Returns:
        The directory itself, or for a GGUF its metadata's cache entry (``gguf_source`` gives the file back).

    Raises:
        ModelLoadError: the path is missing, is neither kind, holds an unsupported architecture
            or is corrupt. The message names the path and what was expected.
    """
    path = bundled_gguf_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist; expected a Hugging Face model directory "
            "(config.json + *.safetensors + tokenizer) or a .gguf file"
        )
    if path.is_dir():
        _check_hf_dir(path)
        return path
    if path.suffix.lower() == ".gguf":
        return _gguf_metadata(path)
    raise ModelLoadError(
        f"model path {str(path)!r} is a file but not a .gguf; expected a Hugging Face model "
        "directory or a .gguf file"
    )


def _check_hf_dir(path: Path) -> None:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; expected a Hugging Face model directory")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{str(config_file)!r} is not valid JSON: {e}") from None
    _check_model_type(model_type, path)
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"{str(path)!r} has no tokenizer (tokenizer.json or tokenizer_config.json)")


def _check_model_type(model_type: str | None, path: Path) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{str(path)!r}: unsupported architecture {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


# ---------------------------------------------------------------------------- GGUF metadata cache


def _check_gguf_architecture(architecture: str, path: Path) -> None:
    if architecture not in GGUF_ARCHITECTURES:
        served = " (served from its Hugging Face directory, not from GGUF)" if architecture in SUPPORTED_MODEL_TYPES else ""
        if architecture in GGUF_UNSERVED_EMBEDDERS:
            served = " (an embedding model; GGUF embedders served: bert)"
        raise ModelLoadError(
            f"{str(path)!r}: unsupported GGUF architecture {architecture!r}{served}; "
            f"supported in GGUF: {', '.join(GGUF_ARCHITECTURES)}"
        )


def _gguf_architecture(path: Path) -> str:
    from engine.model_files.gguf import GGUFError, GGUFFile

    try:
        return GGUFFile(path).architecture
    except (GGUFError, OSError) as e:
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file: {e}") from None


def _cache_entry(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf-metadata" / f"{path.stem}-{key}"


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def is_valid_entry(entry: Path) -> bool:
    """Whether a cache entry is complete: its manifest lists every file with matching size and digest."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        if manifest.get("version") != _MANIFEST_VERSION:
            return False
        for name, (size, digest) in manifest["files"].items():
            file = entry / name
            if file.stat().st_size != size or _file_digest(file) != digest:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _gguf_metadata(path: Path) -> Path:
    entry = _cache_entry(path)
    if is_valid_entry(entry):
        return entry
    with _locked(entry.with_name(entry.name + ".lock")):
        if is_valid_entry(entry):  # another process wrote it while we waited
            return entry
        if entry.exists():
            logger.warning("cache entry %s is incomplete or corrupt; rebuilding it", entry)
            shutil.rmtree(entry)
        _check_gguf_architecture(_gguf_architecture(path), path)
        staging = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _write_metadata(path, staging)
            os.replace(staging, entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return entry


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a metadata cache entry was made from, or None for any other model directory."""
    try:
        source = json.loads((Path(model_dir) / MANIFEST).read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = Path(source)
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def _write_metadata(gguf_path: Path, out: Path) -> None:
    """The GGUF's config (transformers' reading, completed by ``gguf_config.complete_config``), generation config
    and tokenizer (with its chat template) as a Hugging Face directory, then the manifest last. A ``bert`` file,
    which transformers does not read, is written by ``gguf_bert.write_bert_directory``."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from engine.model_files.gguf import GGUFFile
    from engine.model_files.gguf_bert import write_bert_directory
    from engine.model_files.gguf_config import complete_config

    start = time.perf_counter()
    gguf = GGUFFile(gguf_path)
    if gguf.architecture == "bert":  # transformers reads no BERT GGUF: its files are written from the metadata
        out.mkdir(parents=True)
        write_bert_directory(gguf, out)
        _write_manifest(gguf_path, out, start)
        return
    kwargs = dict(gguf_file=gguf_path.name, local_files_only=True)
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    except Exception as e:  # transformers raises many kinds on a file it cannot read
        raise ModelLoadError(f"cannot read the metadata of GGUF {str(gguf_path)!r}: {e}") from None
    config = complete_config(config, gguf)  # what transformers leaves out
    out.mkdir(parents=True)
    if hasattr(config, "quantization_config"):  # the weights are read from the file, not through transformers
        del config.quantization_config
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_manifest(gguf_path, out, start)


def _write_manifest(gguf_path: Path, out: Path, start: float) -> None:
    files = {
        str(f.relative_to(out)): (f.stat().st_size, _file_digest(f)) for f in sorted(out.rglob("*")) if f.is_file()
    }
    manifest = {"version": _MANIFEST_VERSION, "source": str(gguf_path.resolve()), "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    logger.info("read the config and tokenizer of %s in %.1fs", gguf_path.name, time.perf_counter() - start)
