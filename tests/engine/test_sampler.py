import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_sampling_filters,
    apply_top_k_top_p,
    compute_prompt_logprobs,
    make_generator,
)
from engine.sampling_params import SamplingParams

VOCAB = 32
NEG_INF = float("-inf")


def make_batch(params, generators=None, prompts=None, outputs=None, eos=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params,
        generators=generators or [None] * n,
        prompt_token_ids=prompts or [[1, 2, 3]] * n,
        output_token_ids=outputs or [[]] * n,
        eos_token_ids=eos,
    )


def rand_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Same kept set and same renormalized probabilities."""
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(torch.softmax(ours, -1), torch.softmax(ref, -1))


def test_greedy_is_argmax_of_any_dtype():
    logits = rand_logits(5).to(torch.bfloat16)
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * 5))
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_sampler_does_not_mutate_input():
    logits = rand_logits(2)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, min_tokens=2, stop_token_ids=[0])] * 2
    Sampler()(logits, make_batch(params))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6)])
def test_tight_filters_equal_greedy(params):
    logits = rand_logits(8)
    for seed in range(3):
        torch.manual_seed(seed)
        out = Sampler()(logits, make_batch([params] * 8))
        assert out.token_ids == logits.argmax(-1).tolist()


def test_min_p_masks_against_transformers():
    logits = rand_logits(4)
    ours = apply_min_p(logits, torch.full((4, 1), 0.1))
    assert_same_distribution(ours, MinPLogitsWarper(0.1)(None, logits))
    assert torch.isinf(ours).any()  # the test logits really do lose tokens


@pytest.mark.parametrize("top_k", [1, 5, VOCAB, VOCAB + 10])
def test_top_k_against_transformers(top_k):
    logits = rand_logits(4)
    k = torch.full((4,), min(top_k, VOCAB))
    ours = apply_top_k_top_p(logits, k, None)
    assert_same_distribution(ours, TopKLogitsWarper(top_k)(None, logits))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 1.0])
def test_top_p_against_transformers(top_p):
    logits = rand_logits(4)
    ours = apply_top_k_top_p(logits, None, torch.full((4,), top_p))
    assert_same_distribution(ours, TopPLogitsWarper(top_p)(None, logits))


def test_filter_chain_against_transformers_per_row():
    """Rows with different params in one batch each match HF warpers applied in vLLM's order."""
    params = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
        SamplingParams(temperature=1.3, min_p=0.05),
        SamplingParams(temperature=0.5, top_p=0.6, min_p=0.1),
        SamplingParams(),
    ]
    logits = rand_logits(len(params))
    ours = apply_sampling_filters(logits, params)
    for i, p in enumerate(params):
        ref = TemperatureLogitsWarper(p.temperature)(None, logits[i : i + 1])
        if p.min_p > 0:
            ref = MinPLogitsWarper(p.min_p)(None, ref)
        if p.top_k > 0:
            ref = TopKLogitsWarper(p.top_k)(None, ref)
        ref = TopPLogitsWarper(p.top_p)(None, ref)
        assert_same_distribution(ours[i : i + 1], ref)


def test_repetition_penalty_against_transformers():
    logits = rand_logits(3)
    prompts = [[1, 2, 3, 3], [4, 5], [6]]
    outputs = [[7, 1], [], [8, 9, 9]]
    penalties = [1.3, 0.8, 2.0]
    batch = make_batch(
        [SamplingParams(repetition_penalty=r) for r in penalties], prompts=prompts, outputs=outputs
    )
    ours = apply_penalties(logits.clone(), batch)
    for i, r in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(r)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], ref)


def test_frequency_presence_penalties_against_reference():
    logits = rand_logits(2)
    prompts = [[5, 5, 6], [7]]
    outputs = [[1, 1, 1, 2], [3]]
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=-1.0, presence_penalty=2.0),
    ]
    ours = apply_penalties(logits.clone(), make_batch(params, prompts=prompts, outputs=outputs))
    ref = logits.clone()
    for i, p in enumerate(params):
        for token in set(outputs[i]):  # prompt tokens are not penalized (OpenAI semantics)
            count = outputs[i].count(token)
            ref[i, token] -= p.frequency_penalty * count + p.presence_penalty
    torch.testing.assert_close(ours, ref)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 100.0  # EOS is overwhelmingly likely
    logits[:, 9] = 50.0  # then a stop token id
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0.8, min_tokens=5, stop_token_ids=[9]),
    ]
    outputs = [[4], [4, 4], [1, 2]]
    batch = make_batch(params, outputs=outputs, eos=[{2}, {2}, frozenset({2})])
    out = Sampler()(logits, batch)
    assert out.token_ids[0] not in (2, 9)
    assert out.token_ids[1] == 2  # min_tokens reached: EOS allowed again
    assert out.token_ids[2] not in (2, 9)


def test_logprobs_are_raw_and_include_sampled_token():
    logits = rand_logits(3)
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.7, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(),
    ]
    out = Sampler()(logits, make_batch(params, outputs=[[0, 1], [], []]))
    raw = torch.log_softmax(logits, -1)
    row = out.logprobs[0]
    assert out.token_ids[0] in row and next(iter(row)) == out.token_ids[0]
    assert set(raw[0].topk(3).indices.tolist()) <= set(row) and len(row) <= 4
    for token_id, lp in row.items():
        assert lp == pytest.approx(raw[0, token_id].item(), abs=1e-6)
    assert out.logprobs[1] == {out.token_ids[1]: pytest.approx(raw[1].max().item(), abs=1e-6)}
    assert out.logprobs[2] is None


def test_compute_prompt_logprobs():
    logits = rand_logits(4).to(torch.float16)
    next_ids = [3, 0, 7, 7]
    result = compute_prompt_logprobs(logits, next_ids, k=2)
    raw = torch.log_softmax(logits.float(), -1)
    for i, row in enumerate(result):
        assert next(iter(row)) == next_ids[i]
        expected = {next_ids[i], *raw[i].topk(2).indices.tolist()}
        assert set(row) == expected
        for token_id, lp in row.items():
            assert lp == pytest.approx(raw[i, token_id].item(), abs=1e-6)


def run_steps(logits: torch.Tensor, params, seeds, num_steps: int = 4) -> list[list[int]]:
    """Decode `num_steps` steps with the same logits; seeded rows keep one generator."""
    generators = [make_generator(s) for s in seeds]
    tokens: list[list[int]] = [[] for _ in params]
    for _ in range(num_steps):
        out = Sampler()(logits, make_batch(params, generators))
        for i, t in enumerate(out.token_ids):
            tokens[i].append(t)
    return tokens


def test_seeded_rows_independent_of_batch_composition():
    base = rand_logits(1, vocab=1000)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = run_steps(base[None], [seeded], [1234], num_steps=6)[0]

    other = SamplingParams(temperature=0.9)
    greedy = SamplingParams(temperature=0.0, seed=5)  # greedy rows never touch their generator
    rows = [other, greedy, seeded, other, seeded]
    noise_rows = rand_logits(3, vocab=1000, seed=7)
    logits = torch.stack([noise_rows[0], noise_rows[1], base, noise_rows[2], base])
    torch.manual_seed(99)
    batched = run_steps(logits, rows, [None, 5, 1234, None, 1234], num_steps=6)
    assert batched[2] == alone and batched[4] == alone
    assert len(set(alone)) > 1  # it really samples


def test_unseeded_rows_use_global_rng():
    logits = rand_logits(1, vocab=1000)
    torch.manual_seed(0)
    a = run_steps(logits, [SamplingParams()], [None], 8)
    torch.manual_seed(0)
    b = run_steps(logits, [SamplingParams()], [None], 8)
    assert a == b


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token with zero probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8, seed=0), SamplingParams(temperature=1.2, top_k=5, top_p=0.9)],
)
def test_empirical_distribution_matches_softmax(params):
    vocab, num_rows = 8, 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5]])
    ref = TemperatureLogitsWarper(params.temperature)(None, logits)
    if params.top_k:
        ref = TopPLogitsWarper(params.top_p)(None, TopKLogitsWarper(params.top_k)(None, ref))
    probs = torch.softmax(ref, -1)[0]
    # Every row a separate request: seeded ones each get their own generator (seed + i).
    row_params = [params.child_params(0)] * num_rows
    seeds = [None if params.seed is None else params.seed + i for i in range(num_rows)]
    torch.manual_seed(0)
    generators = [make_generator(s) for s in seeds]
    out = Sampler()(logits.expand(num_rows, vocab), make_batch(row_params, generators))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).float()
    dof = int((probs > 0).sum()) - 1
    # ~ 99.99th percentile of chi2(dof): mean dof, sd sqrt(2 dof); generous but catches bias.
    assert chi_square(counts, probs) < dof + 8 * math.sqrt(2 * dof)
