"""Semi-AR drafters (`model.drafter_kind=dspark|domino`, pairs/semiar): each reference's layout
and its refusals, the corrected chain equal to a transcription of each reference's sampling
loop, children that depend on the node, lossless greedy decoding and the target's law.

Drafters are random (built from a config, saved in the reference layout, loaded back as a
released one is), so the tests check the decoder's invariants, not a drafter's quality.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from decode.baseline import autoregressive_decode
from decode.stream import DecodeSettings
from pairs import models
from pairs.models import load_causal_lm, load_model_pair
from pairs.prompts import encode_prompt
from pairs.semiar.drafter import attach_semiar, read_semiar
from specrank.settings.errors import Refusal
from tests.eagle3_heads import tiny_target
from tests.recording import decode_recorded
from tests.semiar_drafters import semiar_model_config, write_semiar
from tests.test_decode_sampling import TINY_V, assert_samples_follow_the_target_law
from tests.tiny_models import build_tiny_pair, one_thread
from tree.attention import forward_chain, new_cache
from tree.config import DecodeConfig, PoolConfig, SelectConfig

VARIANTS = [("dspark", {"head": "vanilla", "copy_markov": 3.0}),
            ("dspark", {"head": "gated", "copy_markov": 8.0}),  # its gate scales W1 down
            ("domino", {}), ("domino", {"shift_label": True, "prefix": 2})]  # fmt: skip
IDS = ["dspark-vanilla", "dspark-gated", "domino", "domino-shift-prefix"]


def _edit(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        place, key = (raw["dflash_config"], key[len("dflash_config."):]) if key.startswith(
            "dflash_config.") else (raw, key)  # fmt: skip
        if value is None:
            place.pop(key, None)
        else:
            place[key] = value
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(("kind", "changes", "message"), [
    ("dspark", {"markov_head_type": "rnn"}, r"markov_head_type: 'rnn' is not supported"),
    ("dspark", {"markov_rank": 0}, r"markov_rank: 0 \(no Markov head\) is not supported"),
    ("dspark", {"architectures": ["Gemma4DSparkModel"]}, r"the Gemma4DSparkModel backbone"),
    ("dspark", {"block_size": None}, r"block_size: absent; DeepSpec's .* top level"),
    ("dspark", {"dflash_config": {"mask_token_id": 3}},
     r"mask_token_id: the top level \(where DeepSpec reads it\) holds 102 but "
     r"dflash_config.mask_token_id 3"),
    ("dspark", {"target_layer_ids": [1, 6]}, r"DeepSpec refuses the last layer"),
    ("dspark", {"vocab_size": 50}, r"vocab_size: its drafts are the target's ids"),
    ("domino", {"dflash_config.projector_type": "dspark"}, r"requires 'domino'"),
    ("domino", {"dflash_config.markov_rank": 8}, r"keys \['markov_rank'\]: not Domino's"),
    ("domino", {"shared_with_target": ["lm_head"]}, r"keys \['shared_with_target'\]: not Domino's"),
    ("dspark", {"shared_with_target": ["markov_head"]}, r"shared_with_target: expected a list of"),
    ("domino", {"dflash_config.emb_dim": None}, r"dflash_config.emb_dim: absent"),
    ("domino", {"dflash_config.shift_label": "yes"}, r"shift_label: expected true or false"),
    ("domino", {"dflash_config.pure_draft_prefix_len": 7}, r"leaves no corrected row"),
    ("domino", {"dflash_config.block_size": 4}, r"top-level block_size is 8 .* must agree"),
    ("domino", {"architectures": ["DFlashDraftModel"]}, r"expects \['DominoDraftModel'\]"),
])  # fmt: skip
def test_a_mismatched_config_is_refused_by_name_before_the_target_loads(
    tmp_path, monkeypatch, kind, changes, message
):
    target = tiny_target(tmp_path, "qwen3")
    drafter = write_semiar(kind, tmp_path / kind, target)
    _edit(drafter, **changes)
    monkeypatch.setattr(models, "load_causal_lm", lambda *a: pytest.fail("the target loaded"))
    with pytest.raises(Refusal, match=message):
        load_model_pair(semiar_model_config(kind, target, drafter))


def test_mismatched_weights_and_deep_pools_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from pairs.positions import check_prompt_lengths
    from pairs.prompts import Prompt

    target = tiny_target(tmp_path, "qwen3")
    drafter = write_semiar("dspark", tmp_path / "d", target)
    cfg = semiar_model_config("dspark", target, drafter)
    deep = PoolConfig(top_k=2, expand_steps=8, expand=2)  # depth 9 > DSpark's 8 rows
    with pytest.raises(Refusal, match=r"pool.expand_steps=8: a pool of depth 9, but the dspark"):
        check_prompt_lengths(cfg, [Prompt("p", "qa", "hi")], 8, deep, "refuse")
    state = load_file(drafter / "model.safetensors")
    del state["markov_head.gate_proj.weight"]
    save_file(state, drafter / "model.safetensors")
    with pytest.raises(Refusal, match=r"lacks key 'markov_head.gate_proj.weight'"):
        load_model_pair(cfg)


def test_a_dspark_file_without_the_target_s_embedding_and_lm_head_needs_the_shared_key(tmp_path):
    """A recipe that keeps DSpark's embedding and lm_head frozen copies of the target's ships
    them left out: `shared_with_target` names them and the loader fills them from the target;
    without the key such a file is refused by name, and with it a file holding them too."""
    from safetensors.torch import load_file, save_file

    target = tiny_target(tmp_path, "qwen3")
    drafter = write_semiar("dspark", tmp_path / "d", target)
    cfg = semiar_model_config("dspark", target, drafter)
    full = load_file(drafter / "model.safetensors")
    lean = {k: v for k, v in full.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    save_file(lean, drafter / "model.safetensors")
    with pytest.raises(Refusal, match=r"lacks key 'embed_tokens.weight' .*shared_with_target does "
                                      r"not name 'embed_tokens'"):  # fmt: skip
        load_model_pair(cfg)
    _edit(drafter, shared_with_target=["embed_tokens", "lm_head"])
    with one_thread():
        pair = load_model_pair(cfg)
    module = pair.drafter.module
    assert torch.equal(module.embed_tokens.weight, pair.target.get_input_embeddings().weight)
    assert torch.equal(module.lm_head.weight, pair.target.get_output_embeddings().weight)
    save_file(full, drafter / "model.safetensors")
    with pytest.raises(Refusal, match=r"unexpected key 'embed_tokens.weight'"):
        load_model_pair(cfg)


@pytest.fixture(scope="module", params=range(len(VARIANTS)), ids=IDS)
def tiny_vocab(request, tmp_path_factory):
    """An 8-token target (7 layers) and a random drafter of each variant (mask: token 7)."""
    kind, kw = VARIANTS[request.param]
    root = tmp_path_factory.mktemp(f"tinyv_{kind}")
    with one_thread():
        build_tiny_pair(root, "llama", vocab_size=TINY_V, init_std=0.6, layers=7)
        drafter = write_semiar(kind, root / kind, root / "target", seed=1, init_std=0.6, **kw)
        cfg = semiar_model_config(kind, root / "target", drafter)
        target = load_causal_lm(cfg.target, cfg, "model.target")
        yield target, attach_semiar(read_semiar(kind, drafter, target.config), target, cfg)


def _reference_chain(d, hidden: torch.Tensor, root: int) -> list[int]:
    """Each reference's greedy block: DeepSpec's `sample_block_tokens` (row k + its Markov bias
    from token k) or SpecForge's Domino `_sample_draft_tokens` (the GRU run over the whole
    completed block again at each step, as there)."""
    s, m, bs = d.semi, d.module, d.semi.block.block_size
    if s.kind == "dspark":
        out, prev = [], root
        for k in range(bs):
            e = m.markov_head.bias(torch.tensor([prev]), hidden[k][None])[0]
            prev = int((d.lm_head(hidden[k]) + e).argmax())
            out.append(prev)
        return out
    ids = [root] + [s.block.mask_token_id] * (bs - 1)
    base = d.lm_head(hidden)
    start = s.plain_rows if s.shift else 1 + s.plain_rows
    for t in range(1, bs):
        emb = d.gru_embed(torch.tensor(ids))
        gru = m.prefix_gru(emb[None] if s.shift else emb[None, : bs - 1])[0][0]
        pos = t - 1 if s.shift else t
        row = base[pos]
        if pos >= start:
            state = gru[pos] if s.shift else gru[pos - 1]
            row = row + m.embed_proj(torch.cat([hidden[pos], state]))
        ids[t] = int(row.argmax())
    return ids[1:]


def test_the_corrected_chain_is_the_reference_s(tiny_vocab):
    target, d = tiny_vocab
    prompt = [1, 5, 3, 6, 2]
    chain = PoolConfig(top_k=1, expand_steps=d.semi.depth - 1, expand=1)
    with one_thread(), torch.inference_mode():
        cache = new_cache(target)
        state = d.new_state(cache)
        forward_chain(target, torch.tensor(prompt[:-1]), cache)
        pool = d.grow(state, prompt, len(prompt) - 1, chain)
        bs = d.semi.block.block_size
        ids = torch.full((bs,), d.spec.mask_token_id)
        ids[0] = prompt[-1]
        hidden = d.module(d.embed(ids), torch.arange(len(prompt) - 1, len(prompt) - 1 + bs),
                          state.ctx)  # fmt: skip
        want = _reference_chain(d, hidden, prompt[-1])
    assert pool.token.tolist() == want


def _children(pool, depth: int) -> list[dict[int, float]]:
    """Each expanded node's children at `depth`: token -> log q."""
    nodes = torch.nonzero((pool.depth == depth) & pool.expanded)[:, 0].tolist()
    return [dict(zip(pool.token[pool.parent == i].tolist(),
                     pool.draft_logprob[pool.parent == i].tolist(), strict=True))
            for i in nodes]  # fmt: skip


def test_siblings_children_differ(tiny_vocab):
    """The children rows are the node's own: siblings' children differ somewhere (a block
    drafter's would be one marginal row); Domino's pure draft prefix keeps its first rows
    shared, as its reference leaves them uncorrected."""
    target, d = tiny_vocab
    tree = PoolConfig(top_k=4, expand_steps=4, expand=4)
    with one_thread(), torch.inference_mode():
        cache = new_cache(target)
        state = d.new_state(cache)
        forward_chain(target, torch.tensor([1, 5, 3, 6]), cache)
        pool = d.grow(state, [1, 5, 3, 6, 2], 4, tree)
    corrected = max(d.semi.plain_rows, 1)  # nodes at depth j take row j, corrected from L on
    kids = _children(pool, corrected)
    assert len(kids) >= 2 and any(k != kids[0] for k in kids[1:]), kids
    for depth in range(1, corrected):
        shared = _children(pool, depth)
        assert all(k == shared[0] for k in shared), shared


def test_every_tree_node_is_drafted_from_its_own_path(tiny_vocab):
    """Each node's log q and score (the best-first growth's key) are those of its own path
    recomputed from the root alone: its token's corrected row drafted node by node down the
    path (`SemiARModule.correct`, a fresh state per path), whatever the pool's level order,
    the expanded nodes' rows or their parents' places (`Level.prev_row`)."""
    target, d = tiny_vocab
    tree = PoolConfig(top_k=3, expand_steps=4, expand=4)
    prompt = [1, 5, 3, 6, 2]
    with one_thread(), torch.inference_mode():
        cache = new_cache(target)
        state = d.new_state(cache)
        forward_chain(target, torch.tensor(prompt[:-1]), cache)
        pool = d.grow(state, prompt, len(prompt) - 1, tree)
        hidden = d.block_hidden(state, prompt[-1], len(prompt) - 1)
        s = d.semi
        rows = hidden[: s.depth] if s.shift else hidden[1 : s.depth + 1]
        for i in range(pool.size):
            path = [i]
            while pool.parent[path[0]] >= 0:
                path.insert(0, int(pool.parent[path[0]]))
            prev, node_state, score = torch.tensor([prompt[-1]]), None, 0.0
            for j, node in enumerate(path):
                bias, node_state = d.module.correct(j, rows[j], prev, d.gru_embed, node_state)
                row = d.lm_head(rows[j]) + (0 if bias is None else bias[0])
                logq = float(row.float().log_softmax(-1)[pool.token[node]])
                score += logq
                prev = pool.token[node : node + 1]
            assert float(pool.draft_logprob[i]) == pytest.approx(logq, abs=1e-4), (i, path)
            assert float(pool.score[i]) == pytest.approx(score, abs=1e-4), (i, path)


def _settings(budget: int, pool: PoolConfig) -> DecodeSettings:
    return DecodeSettings(pool=pool, select=SelectConfig(budget=budget),
                          decode=DecodeConfig(max_new_tokens=24))  # fmt: skip


@pytest.mark.parametrize(("shape", "window"), [("chain", None), ("tree", None), ("tree", 2)],
                         ids=["chain", "tree", "tree-window"])  # fmt: skip
def test_greedy_output_equals_plain_greedy_with_drafts_accepted(tiny_vocab, shape, window):
    """With `model.drafter_window` 2 too (every prompt's context passes it)."""
    target, d = tiny_vocab
    d = dataclasses.replace(d, window=window)
    pool = (PoolConfig(top_k=1, expand_steps=5, expand=1) if shape == "chain"
            else PoolConfig(top_k=3, expand_steps=4, expand=3))  # fmt: skip
    accepted = 0
    with one_thread():
        for prompt in ([1, 5, 3, 6], [2, 2, 7, 0, 4], [6, 1]):
            res = decode_recorded(target, d, prompt, _settings(5, pool), frozenset())
            assert res.output == autoregressive_decode(target, prompt, len(res.output))
            assert 1 + sum(res.accepted) + len(res.accepted) == len(res.output)
            accepted += sum(res.accepted)
    assert accepted >= 2  # verified paths, not only continuations


def test_a_real_vocabulary_pair_loads_records_its_manifest_and_decodes(tmp_path):
    target = tiny_target(tmp_path, "qwen3")
    for kind in ("dspark", "domino"):
        drafter = write_semiar(kind, tmp_path / kind, target, seed=3)
        with one_thread():
            pair = load_model_pair(semiar_model_config(kind, target, drafter))
            prompt = encode_prompt(pair.tokenizer, "def add(a, b):\n    return")
            res = decode_recorded(pair.target, pair.drafter, prompt,
                                  _settings(6, PoolConfig(top_k=3, expand_steps=3, expand=3)),
                                  frozenset(), record=True)  # fmt: skip
        assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))
        assert set(models.DRAFTERS[kind].manifest_fields) <= set(pair.ids)
        assert pair.ids["drafter_kind"] == kind and "corrected by" in pair.ids["pool_conditionals"]


N_RUNS = 250  # as tests/test_decode_sampling.py


@pytest.mark.parametrize(("verifier", "t_d", "chain"), [
    ("exhaustive", None, False), ("eagle3", None, False), ("coupling", 1.0, True),
])  # fmt: skip
def test_sampled_output_follows_the_target_law(tiny_vocab, verifier, t_d, chain):
    """Chi-square over the first two tokens at 1|0 (trees) and 1|1 (a sampled chain verified
    by maximal coupling against the corrected rows it was drawn from)."""
    target, d = tiny_vocab
    if d.semi.variant == "gated" and not chain:
        # the random gated head's trees are accepted below the helper's floor (n / 4)
        pytest.skip("no gated DSpark drafter accepted often enough on the 8-token target yet")
    assert_samples_follow_the_target_law(target, d, verifier, N_RUNS, t_d, chain)
