"""N-gram speculative decoding, the parts without a model: the lookup (vLLM's cases and a
brute-force reference), the proposer's incremental history, the config's validation, the CLI
flag, the verify rule's distribution on fixed logits, and the Prometheus counters."""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.config import SchedulerConfig, SpeculativeConfig
from engine.metrics import EngineCollector
from engine.model_runner import ModelRunner, ModelRunnerOutput
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.serving import add_engine_args, engine_config_from_args
from engine.spec_decode import (
    NgramProposer,
    SpecDecodeStats,
    find_ngram_draft,
    num_accepted,
    sampling_batch,
)


def _draft(tokens, min_n, max_n, k) -> list[int]:
    return find_ngram_draft(np.array(tokens, dtype=np.int64), min_n, max_n, k).tolist()


# ---- the lookup ------------------------------------------------------------------------------
def test_lookup_follows_vllm():
    """vLLM's own cases (tests/v1/spec_decode/test_ngram.py): longest match first, then the
    earliest occurrence; drafts stop at the end of the tokens."""
    assert _draft([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2) == []
    assert _draft([1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]
    assert _draft([1, 2, 3, 4, 1, 2, 3], 2, 2, 2) == [4, 1]
    assert _draft([1, 2, 3, 4, 1, 2, 3], 1, 1, 3) == [4, 1, 2]
    assert _draft([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]
    assert _draft([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2) == [6, 2]  # the first 1-gram match
    assert _draft([1, 2, 3, 4, 5], 2, 2, 2) == []
    assert _draft([1, 2, 3, 4, 1, 2, 3], 4, 4, 2) == []
    assert _draft([1, 2, 3, 4, 1, 2, 3], 3, 4, 2) == [4, 1]
    assert _draft([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2) == [1, 2]  # 4-gram, not [5, 1]
    assert _draft([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2) == [1, 2]  # 3-gram, not [5, 2]
    assert _draft([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2) == [100, 1]
    # Overlapping occurrences count (a run of one token drafts more of it), k caps the draft.
    assert _draft([7, 7, 7, 7], 1, 2, 5) == [7, 7]
    assert _draft([9], 1, 3, 4) == [] and _draft([5, 5], 1, 1, 0) == []


def _reference_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Plain loops: for n from max_n down to min_n, the first i with tokens[i:i+n] equal to
    the last n tokens (i + n < len: an earlier occurrence), then what follows it."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        for i in range(num - n):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_lookup_equals_brute_force_on_random_tokens():
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 6)
        assert _draft(tokens, min_n, max_n, k) == _reference_draft(tokens, min_n, max_n, k), (
            tokens,
            min_n,
            max_n,
            k,
        )


def test_proposer_keeps_history_as_tokens_arrive():
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    proposer = NgramProposer(config)
    r = Request("a", [10, 11, 12, 13, 10], SamplingParams(max_tokens=50))
    assert proposer.propose(r, 3) == []  # one token of a 2-gram only
    r.append_output_token(11)
    assert proposer.propose(r, 3) == [12, 13, 10]
    assert proposer.propose(r, 2) == [12, 13]  # the caller's cap (budget, max_tokens)
    for t in [12, 13, 10, 11] * 40:  # grows its buffer past the first size
        r.append_output_token(t)
    assert proposer.propose(r, 3) == [12, 13, 10]
    history = proposer._history["a"]
    assert history.num_tokens == r.num_tokens
    assert history.buf[: r.num_tokens].tolist() == r.all_token_ids
    proposer.forget("a")
    assert "a" not in proposer._history
    # A new request reusing the id starts a new history.
    r2 = Request("a", [1, 2, 1], SamplingParams(max_tokens=5))
    assert proposer.propose(r2, 3) == []
    r2.append_output_token(2)
    assert proposer.propose(r2, 3) == [1, 2]


def test_no_drafts_for_structured_or_prefill_role_requests():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    r = Request("a", [4, 5, 4], SamplingParams(max_tokens=5))
    assert proposer.propose(r, 2) == [5, 4]
    r.structured = object()  # a grammar would have to follow the drafts
    assert proposer.propose(r, 2) == []
    held = Request("b", [4, 5, 4], SamplingParams(max_tokens=5), hold_blocks=True)
    assert proposer.propose(held, 2) == []


def test_num_accepted():
    assert num_accepted([], [5]) == 0
    assert num_accepted([1, 2, 3], [1, 2, 3, 4]) == 3
    assert num_accepted([1, 2, 3], [1, 9, 3, 4]) == 1
    assert num_accepted([1, 2, 3], [0, 2, 3, 4]) == 0


# ---- config ----------------------------------------------------------------------------------
def test_config_defaults_like_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict(
        {"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert c.method == "ngram" and (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not available"),
        ({"method": "lookahead", "num_speculative_tokens": 2}, "Unknown speculative method"),
        ({"num_speculative_tokens": 2}, "needs a 'method'"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer in"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 1000}, "[1, 128]"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be an integer > 0",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2.5},
            "prompt_lookup_max must be an integer > 0",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
            "unknown key(s) ['model']",
        ),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_config_errors_name_the_field(values, message):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict(values)
    assert message in str(e.value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_cli_flag_parses_and_reaches_the_engine_config(tiny_qwen3_path, capsys):
    args = _parser().parse_args(
        [
            str(tiny_qwen3_path),
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
            '"prompt_lookup_min": 2}',
        ]
    )
    config = engine_config_from_args(args)
    assert config.speculative == SpeculativeConfig("ngram", 3, 4, 2)
    assert engine_config_from_args(_parser().parse_args([str(tiny_qwen3_path)])).speculative is None
    for bad, message in [
        ("{method: ngram}", "is not valid JSON"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "not available in Tandem"),
    ]:
        with pytest.raises(SystemExit):
            _parser().parse_args([str(tiny_qwen3_path), "--speculative-config", bad])
        assert message in capsys.readouterr().err


def test_async_scheduling_is_refused_with_speculation(tiny_qwen3_path):
    from engine.config import EngineConfig

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="does not run with async scheduling"):
        EngineConfig.from_args(str(tiny_qwen3_path), async_scheduling=True, speculative_config=spec)
    config = EngineConfig.from_args(str(tiny_qwen3_path), speculative_config=spec)
    assert config.scheduler.async_scheduling is None and config.speculative is not None
    assert SchedulerConfig().async_scheduling is None


# ---- the verify rule on fixed logits -----------------------------------------------------------
class _LogitsModel:
    """compute_logits is the identity: the test hands the runner its logits as 'hidden'."""

    @staticmethod
    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _verifier() -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # no model, no KV: `_verify` needs neither
    runner.model, runner.sampler, runner.grammar_bitmask = _LogitsModel(), Sampler(), None
    runner.config = SimpleNamespace(scheduler=SchedulerConfig())
    return runner


def _verify_many(logits: torch.Tensor, draft: list[int], params, num: int, seeds=None):
    """Verify `draft` against `logits` (its 1 + k positions) for `num` requests at once."""
    runner = _verifier()
    reqs = [
        Request(
            str(i),
            [1],
            params if seeds is None else params.with_seed(seeds[i]),
        )
        for i in range(num)
    ]
    out = ModelRunnerOutput()
    hidden = logits.repeat(num, 1)
    row_ends = [(i + 1) * logits.shape[0] for i in range(num)]
    runner._verify(reqs, [draft] * num, row_ends, hidden, out)
    return [out.sampled[r.request_id] for r in reqs], reqs


def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def test_verify_preserves_the_target_distribution():
    """Rejection sampling with a one-hot draft: the draft is accepted with probability
    p(draft); every emitted position is distributed as the target's p (given the accepted
    prefix), including the corrected token after a rejection and the bonus token."""
    torch.manual_seed(0)
    vocab, num = 6, 40_000
    logits = torch.randn(3, vocab) * 1.5
    draft = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]  # likely, not certain
    params = SamplingParams(temperature=0.9, top_k=5, max_tokens=8)
    filtered = logits / 0.9
    filtered[filtered < filtered.sort(dim=-1).values[:, 1:2]] = float("-inf")  # top-5 of 6
    probs = torch.softmax(filtered, dim=-1).numpy()

    emitted, _ = _verify_many(logits, draft, params, num)
    first = np.array([e[0] for e in emitted])
    assert _tv(np.bincount(first, minlength=vocab), probs[0]) < 0.01
    accepted = first == draft[0]
    assert abs(accepted.mean() - probs[0][draft[0]]) < 0.01
    assert all(len(e) == 1 for e, a in zip(emitted, accepted) if not a)
    second = np.array([e[1] for e, a in zip(emitted, accepted) if a])
    assert _tv(np.bincount(second, minlength=vocab), probs[1]) < 0.02
    bonus = np.array([e[2] for e in emitted if len(e) == 3])
    assert len(bonus) > 3000
    assert _tv(np.bincount(bonus, minlength=vocab), probs[2]) < 0.03
    assert probs[0].min() == 0.0 and not (first == probs[0].argmin()).any()  # top_k holds


def test_verify_greedy_and_seeded_rows_match_one_token_steps():
    """Greedy: the drafts that equal the argmax, then the argmax. Seeded: the tokens are those
    of one-token steps with the same seed, and the generator ends as if it had made exactly
    one draw per emitted token."""
    torch.manual_seed(1)
    vocab = 50
    logits = torch.randn(4, vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    top = logits.argmax(dim=-1).tolist()
    (emitted,), _ = _verify_many(logits, [top[0], top[1], 7 if top[2] != 7 else 8], greedy, 1)
    assert emitted == top[:3]

    params = SamplingParams(temperature=1.0, max_tokens=8)
    sampler = Sampler()
    for seed in range(40):
        ref = Request("ref", [1], params.with_seed(seed))
        steps = []
        for j in range(4):  # one-token steps, drawing from the seed in turn
            batch = sampling_batch([ref], [[]])
            steps.append(sampler(logits[j : j + 1], batch).token_ids[0])
        draft = [steps[0], steps[1], (steps[2] + 1) % vocab]  # two right, then a wrong one
        (emitted,), (req,) = _verify_many(logits, draft, params, 1, seeds=[seed])
        assert emitted == steps[:3]
        replay = Request("replay", [1], params.with_seed(seed))
        for _ in range(3):
            torch.empty(vocab).exponential_(generator=replay.generator)
        assert torch.equal(req.generator.get_state(), replay.generator.get_state())


# ---- metrics ---------------------------------------------------------------------------------
def test_spec_decode_counters_are_exported_with_vllm_names():
    stats = SpecDecodeStats()
    stats.observe(3, 2)
    stats.observe(4, 0)
    stats.observe(1, 1)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 3)
    assert stats.accepted_per_pos == [2, 1, 0, 0]

    def collector(spec):
        core_stats = SimpleNamespace(
            num_running=0,
            num_waiting=0,
            kv_cache_usage=0.0,
            num_preemptions=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            spec_decode=spec,
        )
        core = SimpleNamespace(stats=lambda: core_stats, config=SimpleNamespace())
        core.config.model = SimpleNamespace(model="m")
        engine = SimpleNamespace(core=core, is_alive=True, num_hook_errors=0)
        return EngineCollector(engine, object(), "decode", "d0")

    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in collector(stats).collect()
        for s in family.samples
    }
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == 3
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == 8
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == 3
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [samples[(per_pos, str(p))] for p in range(4)] == [2, 1, 0, 0]
    names = {f.name for f in collector(None).collect()}
    assert not any(n.startswith("vllm:spec_decode") for n in names)  # off: not exported
