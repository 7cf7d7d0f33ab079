"""Plain target-only decoding: the reference for greedy equality and the speed baseline."""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from tree.attention import cache_kwarg, new_cache


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


@torch.inference_mode()
def row_entropies(
    target: PreTrainedModel,
    prompt: list[int],
    output: list[int],
    temperature: float = 0.0,
    chunk: int = 64,
) -> np.ndarray:
    """Entropy (nats) of the target row that generated each output token. [len(output)] float64.

    Rows at the law temperature (greedy: the unit-temperature softmax, as the rounds'
    root_entropy). Computed after decoding by one teacher-forced pass over prompt +
    output (in chunks of `chunk` rows, so the logits never hold the whole output), so
    the timed baseline decode does no extra work per token.
    """
    if not output:
        return np.zeros(0)
    if not prompt:
        raise ValueError("row_entropies: the prompt has no tokens")
    dev, t = target.device, temperature if temperature > 0 else 1.0
    cache, kw = new_cache(target), cache_kwarg(target)
    seq = [*prompt, *output[:-1]]  # row i + len(prompt) - 1 generated output[i]
    first = len(prompt) - 1
    if first > 0:
        ids = torch.tensor([seq[:first]], device=dev)
        target(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
    out = []
    for a in range(first, len(seq), chunk):
        ids = torch.tensor([seq[a : a + chunk]], device=dev)
        logits = target(input_ids=ids, use_cache=True, **{kw: cache}).logits[0]
        logp = torch.log_softmax(logits.float() / t, dim=-1)
        out.append(-(logp.exp() * logp).nan_to_num(0.0, 0.0, 0.0).sum(-1))
    return torch.cat(out).double().cpu().numpy()
