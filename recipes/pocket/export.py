"""Shipping: half-precision Hugging Face folders that load through `from_pretrained`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from recipes.pocket.corpus import DOC_SEP, END

EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_FILE_BYTES = 25 * 2**20  # each shipped file, and both folders together


@torch.no_grad()
def apply_sharpen(model: LlamaForCausalLM, factor: float) -> LlamaForCausalLM:
    """Multiply every logit by `factor` (the final RMSNorm's weight feeds the tied head linearly).

    p_sharp(x) ∝ p(x) ** factor: the argmax is unchanged; factor > 1 lowers every row's entropy.
    """
    if not factor > 0:
        raise ValueError(f"pocket.sharpen: expected a positive factor, found {factor}")
    model.model.norm.weight.mul_(factor)
    return model


def save_tokenizer(tok: PreTrainedTokenizerFast, folder: Path, max_positions: int) -> None:
    tok.model_max_length = max_positions
    tok.save_pretrained(folder)
    # Name the generic fast class so transformers 4.x loads the folder too (5.x maps it alike).
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def export_model(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, folder: Path, dtype: str
) -> None:
    """Write config.json, model.safetensors (in `dtype`), generation_config.json and the tokenizer."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(
            f"pocket.export_dtype: expected one of {sorted(EXPORT_DTYPES)}, found {dtype!r}"
        )
    folder.mkdir(parents=True, exist_ok=True)
    model = model.to(EXPORT_DTYPES[dtype])
    eos = [tok.convert_tokens_to_ids(END), tok.convert_tokens_to_ids(DOC_SEP)]
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False
    )
    model.save_pretrained(folder)
    save_tokenizer(tok, folder, model.config.max_position_embeddings)


def check_sizes(folders: list[Path]) -> dict[str, int]:
    """Bytes per shipped file; refuses a file or a total over `MAX_FILE_BYTES`."""
    sizes = {str(p): p.stat().st_size for f in folders for p in sorted(f.rglob("*")) if p.is_file()}
    big = {p: s for p, s in sizes.items() if s >= MAX_FILE_BYTES}
    if big or sum(sizes.values()) > MAX_FILE_BYTES:
        raise ValueError(
            f"pocket export: expected each file under and all files together at most "
            f"{MAX_FILE_BYTES} bytes, found total {sum(sizes.values())}, too large: {big}"
        )
    return sizes
