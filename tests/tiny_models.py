"""Tiny random target/drafter pairs for the decoder tests (built in a tmp dir, loaded like real ones)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from decode.config import ModelConfig
from decode.models import TINY_CHAT_TEMPLATE, ModelPair, build_tiny_pair, load_model_pair

transformers.utils.logging.disable_progress_bar()  # quiet save/load bars in test output


def tiny_model_config(root: Path, arch: str, attn: str = "sdpa", **kw) -> ModelConfig:
    """Write a tiny pair under `root` (once) and return the ModelConfig that names it."""
    if not (root / "target" / "config.json").exists():
        template = TINY_CHAT_TEMPLATE if arch == "qwen3" else None  # Qwen3: chat; Llama: plain
        build_tiny_pair(root, arch, chat_template=template, **kw)
    return ModelConfig(
        name=f"tiny_{arch}",
        target=str(root / "target"),
        drafter=str(root / "drafter"),
        attn_implementation=attn,
    )


def tiny_pair(root: Path, arch: str, attn: str = "sdpa", **kw) -> ModelPair:
    return load_model_pair(tiny_model_config(root, arch, attn, **kw))


class one_thread:  # lower-case: reads as a context manager
    """Run torch on one thread: the test machine's cores are shared, and tiny ops gain nothing."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)
