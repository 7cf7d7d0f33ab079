"""GGUF checkpoints: converted once into a Hugging Face folder, then loaded like any other.

`model.target` (and a standalone drafter) may name a `.gguf` file, or a folder holding one
and no `config.json`. transformers' GGUF loader dequantizes the file to float32 on every
load (tens of seconds, and the tokenizer rebuilt from the file's metadata), and a model it
loaded refuses `save_pretrained`. So the file is converted once: a plain model is built
from the loaded config without its `quantization_config`, given the dequantized weights,
and saved with the tokenizer and generation config as safetensors in a cache folder named
by the file's sha256 (`cache_root`). Every later load reads that folder, and a changed file
gets a new key, so a stale conversion is never read.

The write is atomic: the folder is written under a temporary name beside its final one and
renamed into place; a second writer (two Ray workers converting at once) that finds the
name taken discards its own copy, so the cache holds one complete folder or none.

Before anything is dequantized, the file's own metadata is checked: an architecture that
transformers' GGUF loader supports and that maps to a causal LM, and a tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from pairs.loading import LOADING
from specrank.settings.errors import Refusal

CACHE_ENV = "SPECRANK_CACHE"  # the cache root; default $XDG_CACHE_HOME/specrank
PROVENANCE = "specrank_gguf.json"  # written into each converted folder: where it came from
# what a GGUF file must declare for its tokenizer to be rebuilt (llama.cpp's key names)
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")


def cache_root() -> Path:
    """Where converted checkpoints live: $SPECRANK_CACHE, else $XDG_CACHE_HOME/specrank."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "gguf"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "specrank" / "gguf"


def gguf_file(path: str | Path, setting: str) -> Path | None:
    """The GGUF file `path` names (the file, or the one `.gguf` in a folder without
    config.json); None for a Hugging Face folder. A folder with several is refused."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) > 1:
        raise Refusal(
            f"{setting}: the folder '{p}' holds {len(found)} GGUF files "
            f"({', '.join(f.name for f in found)}); expected one: name the file itself"
        )
    return found[0] if found else None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def check_gguf(path: Path, setting: str) -> str:
    """The file's architecture, after checking that transformers can load it as a causal LM
    with its tokenizer (metadata only: nothing is dequantized)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, read_field
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as err:
        raise Refusal(f"{setting}: '{path}' is not a readable GGUF file ({err})") from err
    arch = (read_field(reader, "general.architecture") or [None])[0]
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise Refusal(
            f"{setting}: '{path}' declares general.architecture={arch!r}; transformers' GGUF "
            f"loader supports {sorted(GGUF_SUPPORTED_ARCHITECTURES)}"
        )
    model_type = arch.replace("-", "_")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise Refusal(
            f"{setting}: '{path}' holds a {arch!r} model, which transformers does not load "
            f"as a causal LM; a target or standalone drafter must be one"
        )
    missing = [k for k in _TOKENIZER_KEYS if k not in reader.fields]
    if missing:
        raise Refusal(
            f"{setting}: '{path}' carries no tokenizer (missing metadata {missing}); the "
            f"pair's tokenizer is read from the target's file"
        )
    return arch


def converted_folder(path: Path, setting: str, root: Path | None = None) -> Path:
    """The Hugging Face folder converted from the GGUF file `path` (converted now if the
    cache has no folder for the file's sha256)."""
    sha = file_sha256(path)
    root = cache_root() if root is None else root
    dest = root / sha
    if (dest / PROVENANCE).is_file():
        return dest
    arch = check_gguf(path, setting)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha}.", dir=root))
    try:
        _convert(path, tmp)
        (tmp / PROVENANCE).write_text(
            json.dumps({"source": str(path), "sha256": sha, "architecture": arch}, indent=1)
        )
        try:
            tmp.rename(dest)
        except OSError:
            # another writer renamed its complete copy into place first: keep that one
            if not (dest / PROVENANCE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert(path: Path, out: Path) -> None:
    """Dequantize to float32 (exact: every GGUF quantization widens into it) and save."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": path.name, "local_files_only": True}
    with LOADING:  # one load at a time in a process (pairs.loading)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
    config = loaded.config
    del config.quantization_config  # the saved folder holds plain weights
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:  # a tied head is a view of the embeddings, not its own key
        tied = getattr(plain, "_tied_weights_keys", None) or {}
        left = [k for k in missing if k not in tied]
        if left or unexpected:
            raise RuntimeError(
                f"GGUF conversion of '{path}': weights missing {left[:5]}, unexpected "
                f"{unexpected[:5]}"
            )
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
