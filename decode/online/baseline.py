"""Plain target-only decoding: the reference for greedy equality and the speed baseline."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from decode.tree.attention import cache_kwarg, new_cache


@torch.inference_mode()
def autoregressive_decode(
    target: PreTrainedModel,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Plain target-only decoding, one token per forward, through the model's own masks.

    The reference for the greedy-equality tests and the speed baseline; it uses
    none of this package's mask or cache code, so it checks them independently.
    """
    dev = target.device
    cache = new_cache(target)
    kw = cache_kwarg(target)
    logits = target(
        input_ids=torch.tensor([prompt], device=dev),
        use_cache=True,
        logits_to_keep=1,
        **{kw: cache},
    ).logits
    out: list[int] = []
    while True:
        row = logits[0, -1]
        if temperature == 0:
            nxt = int(row.argmax())
        else:
            probs = torch.softmax(row.float() / temperature, -1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        if nxt in eos_ids or len(out) >= max_new_tokens:
            return out
        logits = target(
            input_ids=torch.tensor([[nxt]], device=dev), use_cache=True, **{kw: cache}
        ).logits
