"""Sampled decoding follows the target law (exhaustive and EAGLE-3 verifiers).

Two levels:
1. The traversal alone, on fixed rows and a fixed tree, replicated into a forest so
   that 20,000 rounds take one second: the law of the emitted address (last accepted
   node, continuation) must be P(u) p(c | u) for every tree node u and every token c
   not labelling a tree child of u (SPEC §3).
2. The whole decoder on a tiny-vocabulary model: the first two emitted tokens over
   independently seeded runs must follow p(x1 | c) p(x2 | c x1).
Both use Pearson's chi-square over cells with expected count >= 5 (sparser cells
merged) and fail below p = 1e-3, so a correct decoder fails about once in a
thousand runs per test; the seeds are fixed, so the outcome is reproducible.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from decode.stream import DecodeSettings, prompt_seed
from pairs.config import ModelConfig
from pairs.models import load_causal_lm
from tests.recording import decode_recorded
from tests.tiny_models import build_tiny_pair, one_thread
from tree.attention import ancestor_matrix
from tree.config import DecodeConfig, PoolConfig, SelectConfig
from tree.pool import Pool
from tree.verify import accepted_mask, outcome_eagle3, outcome_exhaustive, row_logprobs

ALPHA = 1e-3


def _chi_square_p(observed: np.ndarray, expected_prob: np.ndarray) -> float:
    n = observed.sum()
    expected = expected_prob * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


# -- 1. the traversal on a fixed tree -------------------------------------------------------

V = 6
PARENT = torch.tensor([-1, -1, -1, 0, 0, 1, 3])  # tree in pool order (root's children: 0, 1, 2)
TOKENS = torch.tensor([2, 0, 5, 1, 2, 3, 4])  # distinct among siblings
N_NODES = PARENT.shape[0]


def _tree_pool() -> Pool:
    n = N_NODES
    depth = torch.tensor([1, 1, 1, 2, 2, 2, 3])
    zeros = torch.zeros(n)
    return Pool(
        TOKENS,
        PARENT,
        depth,
        zeros,
        zeros,
        torch.zeros(n, dtype=torch.bool),
        ancestor_matrix(PARENT, 3),
        -torch.ones(n, dtype=torch.long),
        n_first=3,
    )


def _exact_emitted_law(rows_p: np.ndarray) -> dict[tuple[int, int], float]:
    """P(last accepted = u, continuation = c) = P(u) p(c|u), c labels no tree child of u."""
    path_p = np.ones(N_NODES + 1)  # row 0 = root, row i + 1 = node i
    for i in range(N_NODES):
        path_p[i + 1] = path_p[int(PARENT[i]) + 1] * rows_p[int(PARENT[i]) + 1, int(TOKENS[i])]
    law = {}
    for u in range(-1, N_NODES):
        kids = {int(TOKENS[i]) for i in range(N_NODES) if int(PARENT[i]) == u}
        for c in range(V):
            if c not in kids:
                law[(u, c)] = path_p[u + 1] * rows_p[u + 1, c]
    return law


@pytest.mark.parametrize("verifier", ["exhaustive", "eagle3"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_traversal_emits_the_target_law(verifier, temperature):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(N_NODES + 1, V, generator=g) * 1.5  # rows: root + each node
    row_logp = row_logprobs(logits, temperature)
    pool = _tree_pool()
    in_tree = torch.ones(N_NODES, dtype=torch.bool)
    prow = PARENT + 1  # batch row of each node's parent (root = 0)
    reps, chunks = 500, 40  # 20,000 rounds
    forest_logp = row_logp.repeat(reps, 1)  # [reps * rows, V]: independent copies of the round
    offsets = (torch.arange(reps) * (N_NODES + 1))[:, None]
    child_rows = (offsets + prow[None]).reshape(-1)
    child_tokens = TOKENS.repeat(reps)
    gen = torch.Generator().manual_seed(11)
    counts = np.zeros((N_NODES + 1) * V, dtype=np.int64)  # cell (last accepted + 1, continuation)
    for _ in range(chunks):
        if verifier == "exhaustive":
            out = outcome_exhaustive(forest_logp, gen)
        else:
            out = outcome_eagle3(forest_logp, child_tokens, child_rows, gen)
        out = out.view(reps, N_NODES + 1)
        acc = accepted_mask(pool, in_tree, prow, out)  # [reps, P]
        # Deepest accepted node = the largest accepted pool index (pool order is depth order).
        last = torch.where(acc.any(-1), (acc * torch.arange(N_NODES)).max(-1).values, -1)
        cont = out.gather(1, (last + 1)[:, None])[:, 0]
        counts += np.bincount(((last + 1) * V + cont).numpy(), minlength=counts.size)
    law = _exact_emitted_law(row_logp.exp().double().numpy())
    exact = np.zeros_like(counts, dtype=np.float64)
    for (u, c), prob in law.items():
        exact[(u + 1) * V + c] = prob
    assert (
        counts[exact == 0].sum() == 0
    )  # never an impossible outcome (a tree child as continuation)
    p = _chi_square_p(counts, exact)
    assert p > ALPHA, f"chi-square p = {p:.2e}"


def test_eagle3_accept_probabilities_telescope():
    """Siblings c1, c2 with p = .3, .5: P(accept c2) = .7 * (.5 / .7) = .5 exactly."""
    row = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))
    gen = torch.Generator().manual_seed(0)
    n = 40000
    out = outcome_eagle3(
        row.repeat(n, 1), torch.tensor([0, 1]).repeat(n), torch.arange(n).repeat_interleave(2), gen
    )
    freq = torch.bincount(out, minlength=3).double() / n
    assert torch.allclose(
        freq, torch.tensor([0.3, 0.5, 0.2], dtype=torch.float64), atol=5 * (0.25 / n) ** 0.5
    )


# -- 2. the whole decoder on a tiny-vocabulary model ------------------------------------------

TINY_V = 8
PROMPT = [1, 5, 3, 6]
# 250 runs keep the default suite fast (~10 s per verifier); `-m slow` repeats with 3,000.
N_RUNS = 250


@pytest.fixture(scope="module")
def tiny_vocab_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyv")
    # init_std 0.6: peaked rows, so the law is far from uniform and the test has power.
    build_tiny_pair(root, "llama", vocab_size=TINY_V, init_std=0.6, draft_noise=0.3)
    cfg = ModelConfig(name="tinyv", target=str(root / "target"), drafter=str(root / "drafter"))
    with one_thread():
        yield (
            load_causal_lm(cfg.target, cfg, "model.target"),
            load_causal_lm(cfg.drafter, cfg, "model.drafter"),
        )


def _exact_two_token_law(target, temperature: float) -> np.ndarray:
    with torch.inference_mode():
        p1 = torch.softmax(
            target(input_ids=torch.tensor([PROMPT])).logits[0, -1].float() / temperature, -1
        )
        seqs = torch.tensor([[*PROMPT, x] for x in range(TINY_V)])
        p2 = torch.softmax(target(input_ids=seqs).logits[:, -1].float() / temperature, -1)
    return (p1[:, None] * p2).double().numpy()  # [x1, x2]


def assert_samples_follow_the_target_law(target, drafter, verifier: str, n: int,
                                         draft_temperature: float | None = None,
                                         chain: bool = False) -> int:  # fmt: skip
    """n sampled two-token outputs against the target's exact law: chi-square p > ALPHA,
    and the tree is actually used (drafts accepted, not only continuations); returns the
    drafts accepted. `draft_temperature`: the pair 1|T_d (null: today's deterministic
    drafting). `chain`: a 3-node chain pool, all of it verified, instead of a tree."""
    pool = (
        PoolConfig(top_k=1, expand_steps=2, expand=1)
        if chain
        else PoolConfig(top_k=3, expand_steps=2, expand=2)
    )
    s = DecodeSettings(
        pool=pool,
        select=SelectConfig(budget=3 if chain else 5, record_top_m=8),
        decode=DecodeConfig(
            temperature=1.0,
            verifier=verifier,
            max_new_tokens=2,
            draft_temperature=draft_temperature,
        ),
    )
    counts = np.zeros((TINY_V, TINY_V))
    accepted = 0
    with one_thread():
        for i in range(n):
            res = decode_recorded(target, drafter, PROMPT, s, frozenset(), prompt_id=f"p{i}")
            counts[res.output[0], res.output[1]] += 1
            accepted += sum(res.accepted)
    # a 3-node chain covers less of the target's mass than the 5-node tree of 3 children
    assert accepted > (n // 20 if chain else n // 4)
    p = _chi_square_p(counts.reshape(-1), _exact_two_token_law(target, 1.0).reshape(-1))
    assert p > ALPHA, f"chi-square p = {p:.2e}"
    return accepted


def assert_sampling_is_seeded_per_prompt(target, drafter) -> None:
    """The same prompt id gives the same sampled output, another id another one."""
    s = DecodeSettings(
        pool=PoolConfig(top_k=3, expand_steps=2, expand=2),
        select=SelectConfig(budget=5, record_top_m=8),
        decode=DecodeConfig(temperature=1.0, max_new_tokens=30),
    )
    with one_thread():
        a, b, c = (
            decode_recorded(target, drafter, PROMPT, s, frozenset(), prompt_id=i).output
            for i in ("x", "x", "y")
        )
    assert a == b and a != c


@pytest.mark.parametrize("n", [N_RUNS, pytest.param(3000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("verifier", ["exhaustive", "eagle3"])
def test_decoder_samples_follow_the_target_law(tiny_vocab_models, verifier, n):
    assert_samples_follow_the_target_law(*tiny_vocab_models, verifier, n)


def test_sampling_is_seeded_per_prompt(tiny_vocab_models):
    assert_sampling_is_seeded_per_prompt(*tiny_vocab_models)
    assert prompt_seed(0, "x") != prompt_seed(1, "x")
    # stable across processes and versions (a resumed run draws what the first run drew):
    # the value recorded when the derivation (sha256 of "seed\0prompt id") was fixed
    assert prompt_seed(0, "x") == 8088837398780876553
