"""The target's auxiliary hidden states, taken from the passes decoding runs anyway.

Convention (`model.aux_layer_convention`): in this module a layer id i always means the
hidden state ENTERING target decoder layer i -- transformers' `hidden_states[i]`
(`hidden_states[0]` = the embeddings), the convention of SafeAILab/EAGLE's
`modeling_*_kv.py`, vLLM, SGLang and speculators. Trainers that hook layer *outputs* name
the same tensor i - 1; `resolve_aux_layers` converts those ids. The default ids are
(2, N // 2, N - 3): (2, 16, 29) for Llama-3.1-8B (32 layers), (2, 18, 33) for Qwen3-8B (36).
The states are concatenated in layer order, as every runtime captures them.

Capture is keyed by the target's KV cache: forward pre-hooks on the chosen layers record
their input when the forward extends a *tracked* cache, and a `FeatureRows` beside that
cache receives one row per new position. Every target pass of a prompt -- prefill, root
pass, verification pass, X1 alone -- thereby adds exactly the rows it adds to the cache,
and `FeatureRows.compact` applies the commit's compaction, so the rows always mirror the
cache: after a round they hold the root and the accepted path, from the verification pass,
with no extra target pass. Forwards on untracked caches (the plain baseline, tests) are
left alone.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

CONVENTIONS = ("input", "output")


def _part(target: PreTrainedModel, name: str, kind: type, what: str) -> nn.Module:
    """`target.model.<name>`, refused by name unless a `kind` (a Llama/Qwen-style causal LM)."""
    part = getattr(getattr(target, "model", None), name, None)
    if not isinstance(part, kind):
        raise ValueError(
            f"model.target: {type(target).__name__} has no `model.{name}` {what} (expected a "
            "Llama/Qwen-style causal LM) to take hidden states from"
        )
    return part


def decoder_layers(target: PreTrainedModel) -> nn.ModuleList:
    return _part(target, "layers", nn.ModuleList, "decoder stack")


def final_norm(target: PreTrainedModel) -> nn.Module:
    """The norm after the decoder stack: HF's `hidden_states[n_layers]` is its output."""
    return _part(target, "norm", nn.Module, "after its decoder stack")


def default_aux_layers(n_layers: int) -> tuple[int, ...]:
    """(2, N // 2, N - 3): the ids EAGLE-3 trains heads with (input convention)."""
    return (2, n_layers // 2, n_layers - 3)


def resolve_aux_layers(
    override: list[int] | None,
    from_config: tuple[int, ...] | None,
    convention: str,
    n_layers: int,
    config_file: str,
) -> tuple[int, ...]:
    """The aux layer ids in the input convention, ascending; refused unless distinct and in range."""
    if convention not in CONVENTIONS:
        raise ValueError(
            f"The 'model.aux_layer_convention' must be one of {list(CONVENTIONS)}. "
            f"Got {convention!r} instead."
        )
    if override is not None:
        ids, source = list(override), "model.aux_layers"
    elif from_config is not None:
        ids, source = list(from_config), f"{config_file} eagle_aux_hidden_state_layer_ids"
    else:
        ids, source, convention = (
            list(default_aux_layers(n_layers)),
            "the default (2, N // 2, N - 3)",
            "input",
        )
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{source}: expected a non-empty list of ints, found {ids!r}")
    entering = [i + 1 for i in ids] if convention == "output" else ids
    if len(set(entering)) != len(entering) or min(entering) < 0 or max(entering) >= n_layers:
        read = (
            "output of layer i = input to i + 1" if convention == "output" else "input to layer i"
        )
        raise ValueError(
            f"{source}: {ids} read as '{read}' are {entering}; expected distinct ids in "
            f"[0, {n_layers}) for a target with {n_layers} decoder layers "
            "(set model.aux_layers or model.aux_layer_convention)"
        )
    return tuple(sorted(entering))


def join_aux(states: list[Tensor]) -> Tensor:
    """The head's input features: the aux states concatenated in layer order. [..., k * H]."""
    return torch.cat(states, dim=-1)


class FeatureRows:
    """Aux hidden states of the positions a target cache holds, from position `start` on.

    Rows before `start` were fed to the head and are no longer kept (`drop_before`).
    """

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self._chunks: list[Tensor] = []
        self._n = 0

    @property
    def end(self) -> int:
        """One past the last position held (= the target cache's length when mirrored)."""
        return self.start + self._n

    def append(self, rows: Tensor) -> None:
        self._chunks.append(rows)
        self._n += rows.shape[0]

    def _all(self) -> Tensor:
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks)]
        return self._chunks[0]

    def rows(self, lo: int, hi: int) -> Tensor:
        """Rows of positions [lo, hi). [hi - lo, k * H]."""
        if not self.start <= lo <= hi <= self.end:
            raise ValueError(
                f"EAGLE-3 features: positions [{lo}, {hi}) requested, rows held for "
                f"[{self.start}, {self.end})"
            )
        return self._all()[lo - self.start : hi - self.start]

    def drop_before(self, pos: int) -> None:
        if not self.start <= pos <= self.end:
            raise ValueError(
                f"EAGLE-3 features: cannot drop rows before {pos}; rows held for "
                f"[{self.start}, {self.end})"
            )
        if pos > self.start:
            rest = self._all()[pos - self.start :]
            self._chunks = [rest] if rest.shape[0] else []
            self._n, self.start = self._n - (pos - self.start), pos

    def compact(self, keep_prefix: int, keep: list[int]) -> None:
        """What `compact_cache(cache, keep_prefix, keep)` does to the cache, done to the rows."""
        if keep_prefix < self.start or any(k < keep_prefix or k >= self.end for k in keep):
            raise ValueError(
                f"EAGLE-3 features: compaction to [{keep_prefix}) + {keep} outside the rows "
                f"held for [{self.start}, {self.end})"
            )
        if not self._n:
            return
        every = self._all()
        idx = torch.tensor(keep, dtype=torch.long, device=every.device)
        self._chunks = [torch.cat([every[: keep_prefix - self.start], every[idx - self.start]])]
        self._n = self._chunks[0].shape[0]


class AuxCapture:
    """Forward hooks on a target that fill the `FeatureRows` of every tracked cache.

    Layer id i (input convention) is the state entering decoder layer i; id n_layers, past
    the stack, is the final norm's output (HF's `hidden_states[n_layers]`)."""

    def __init__(self, target: PreTrainedModel, layer_ids: tuple[int, ...]) -> None:
        layers = decoder_layers(target)
        self.layer_ids = tuple(layer_ids)
        self._tracked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._sink: FeatureRows | None = None
        self._parts: dict[int, Tensor] = {}
        self._handles = [
            target.register_forward_pre_hook(self._begin, with_kwargs=True),
            target.register_forward_hook(self._end, with_kwargs=True),
            *(
                layers[i].register_forward_pre_hook(self._grab(i), with_kwargs=True)
                for i in self.layer_ids
                if i < len(layers)
            ),
        ]
        if len(layers) in self.layer_ids:  # the last state: the final norm's output, as HF's
            self._handles.append(
                final_norm(target).register_forward_hook(self._grab_out(len(layers)))
            )

    def track(self, cache: DynamicCache, start: int = 0) -> FeatureRows:
        """Rows that every target forward extending `cache` will extend (positions from `start`)."""
        rows = FeatureRows(start)
        self._tracked[cache] = rows
        return rows

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _begin(self, module, args, kwargs) -> None:
        # The project passes the cache by keyword (tree.attention.cache_kwarg).
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self._sink = None if cache is None else self._tracked.get(cache)
        self._parts = {}

    def _grab(self, index: int):
        def hook(module, args, kwargs) -> None:
            if self._sink is not None:
                hidden = args[0] if args else kwargs["hidden_states"]
                self._parts[index] = hidden[0]  # [n, H]: batch size 1 (pairs.models)

        return hook

    def _grab_out(self, index: int):
        def hook(module, args, output) -> None:
            if self._sink is not None:
                self._parts[index] = output[0]

        return hook

    def _end(self, module, args, kwargs, output) -> None:
        # Runs only after a forward that completed (a failed one is reset by the next _begin).
        sink, parts, self._sink, self._parts = self._sink, self._parts, None, {}
        if sink is None:
            return
        if len(parts) != len(self.layer_ids):
            raise RuntimeError(
                f"EAGLE-3 capture: a target forward ran layers {sorted(parts)} of the aux "
                f"layers {list(self.layer_ids)}; the features would no longer mirror the cache"
            )
        sink.append(join_aux([parts[i] for i in self.layer_ids]))
