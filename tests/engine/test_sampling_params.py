import dataclasses

import pytest

from engine.sampling_params import (
    SamplingParams,
    SamplingType,
    default_sampling_params,
    eos_token_ids_from_generation_config,
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3."),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5."),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0."),
        ({"temperature": -1}, "temperature must be non-negative, got -1."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_k": -3}, "top_k must be 0 (disable), or at least 1, got -3."),
        ({"min_p": 2}, "min_p must be in [0, 1], got 2."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
        (
            {"max_tokens": 4, "min_tokens": 5},
            "min_tokens must be less than or equal to max_tokens=4, got 5.",
        ),
        ({"logprobs": -2}, "logprobs must be non-negative, got -2."),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be non-negative, got -1."),
        ({"stop": ["a", ""]}, "stop cannot contain an empty string."),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids must contain only integers"),
    ],
)
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError) as exc_info:
        SamplingParams(**kwargs)
    assert message in str(exc_info.value)


def test_top_k_must_be_int():
    with pytest.raises(TypeError):
        SamplingParams(top_k=2.5)


def test_defaults_and_normalization():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0, 16)
    assert p.stop == [] and p.stop_token_ids == []
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert "temperature=1.0" in repr(p)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


def test_sampling_type_and_greedy_drops_filters():
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.is_greedy and greedy.sampling_type == SamplingType.GREEDY
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    # Tiny positive temperatures are clamped like vLLM, to keep logits / T finite.
    assert SamplingParams(temperature=1e-3).temperature == 1e-2


def test_generation_config_defaults():
    gen_cfg = {
        "do_sample": False,  # ignored, as in vLLM
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_new_tokens": 256,
        "eos_token_id": [1, 2],
        "min_p": None,
    }
    p = default_sampling_params(gen_cfg)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.05)
    assert p.max_tokens == 256 and p.min_p == 0.0
    assert default_sampling_params(None) == SamplingParams()
    assert default_sampling_params({"bos_token_id": 1}) == SamplingParams()


def test_from_generation_config_overrides():
    gen_cfg = {"temperature": 0.6, "top_p": 0.9}
    p = SamplingParams.from_generation_config(gen_cfg, temperature=0.0, top_p=None, seed=7)
    assert p.temperature == 0.0 and p.seed == 7
    assert p.top_p == 1.0  # greedy normalization wins over the model default
    p = SamplingParams.from_generation_config(gen_cfg, top_p=None, max_tokens=None)
    assert p.top_p == 0.9  # None = "request did not set it"
    assert p.max_tokens is None  # not a generation-config key here: None means unlimited


def test_eos_from_generation_config():
    assert eos_token_ids_from_generation_config({"eos_token_id": 2}) == {2}
    assert eos_token_ids_from_generation_config({"eos_token_id": [2, 3]}) == {2, 3}
    assert eos_token_ids_from_generation_config(None) == set()


def test_child_params_seeds():
    parent = SamplingParams(n=3, seed=100, temperature=0.8, stop=["x"])
    children = [parent.child_params(i) for i in range(3)]
    assert [c.seed for c in children] == [100, 101, 102]
    assert all(c.n == 1 and c.temperature == 0.8 and c.stop == ["x"] for c in children)
    unseeded = SamplingParams(n=2).child_params(1)
    assert unseeded.seed is None and unseeded.n == 1
    with pytest.raises(AssertionError):
        parent.child_params(3)


def test_clone_and_with_seed():
    p = SamplingParams(stop=["a"], stop_token_ids=[5])
    c = p.clone()
    assert c == p and c.stop is not p.stop and c.stop_token_ids is not p.stop_token_ids
    assert p.with_seed(9).seed == 9 and p.seed is None
