"""Per-request sampling parameters, mirroring vLLM's `SamplingParams`.

Fields, defaults and error messages follow vLLM so that OpenAI-style clients see familiar
behaviour. The object is frozen: one instance is shared by the scheduler, the sampler and the
detokenizer, so nobody may change it under the others' feet. Derive variants with
`dataclasses.replace`, `with_seed` or `child_params`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Random-sampling temperatures are clamped up to this so logits / T stays finite (vLLM _MAX_TEMP).
MIN_RANDOM_TEMPERATURE = 1e-2

# Keys vLLM's `get_diff_sampling_param` reads from a HF generation_config.json (it ignores
# `do_sample`), mapped to our field names.
GENERATION_CONFIG_KEYS: dict[str, str] = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, as vLLM's `StructuredOutputsParams`: exactly one of `json`
    (a JSON schema, as a dict or its serialized string), `regex`, `choice`, `grammar` (EBNF),
    `json_object` (any JSON object) or `structural_tag` (serialized).

    `reasoning_start_token_id` / `reasoning_end_token_id` are set by the serving layer's
    reasoning parser: the constraint then applies only after the reasoning has ended, as in vLLM.
    """

    KINDS: ClassVar[tuple[str, ...]] = (
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "structural_tag",
    )

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    reasoning_start_token_id: int | None = None
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in self.KINDS if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are "
                f"specified: {self.__dict__}"
            )
        if not kinds:
            raise ValueError(
                "You must use one kind of structured outputs constraint but none are specified: "
                f"{self.__dict__}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must list at least one choice.")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) is not None)


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop it.

    `top_k` 0 or -1 disables top-k (-1 is normalized to 0); `max_tokens=None` means "up to
    max_model_len" (the engine resolves it); `logprobs=k` returns the sampled token's logprob plus
    the top-k, computed from the raw model logits.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> value added to its logit before sampling (vLLM applies it before penalties).
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Normalize first (vLLM does the same), so validation and consumers see one shape.
        set_ = object.__setattr__  # frozen dataclass: __post_init__ is the only writer
        if self.stop is None:
            set_(self, "stop", [])
        elif isinstance(self.stop, str):
            set_(self, "stop", [self.stop])
        else:
            set_(self, "stop", list(self.stop))
        set_(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.seed == -1:
            set_(self, "seed", None)
        self._verify_args()
        if self.top_k == -1:
            set_(self, "top_k", 0)
        if SAMPLING_EPS <= self.temperature < MIN_RANDOM_TEMPERATURE:
            # vLLM clamps every positive temperature; we keep (0, SAMPLING_EPS) greedy instead,
            # so "tiny temperature" means argmax rather than a T=0.01 random draw.
            set_(self, "temperature", MIN_RANDOM_TEMPERATURE)
        if self.temperature < SAMPLING_EPS:
            # Greedy: filters cannot change the argmax, so drop them (as vLLM does).
            set_(self, "top_p", 1.0)
            set_(self, "top_k", 0)
            set_(self, "min_p", 0.0)

    def _verify_args(self) -> None:
        if not isinstance(self.n, int):
            raise TypeError(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int):
            raise TypeError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain only integers, got {self.stop_token_ids}."
            )
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self) -> SamplingParams:
        """Deep copy, so list fields are not shared with the original."""
        return copy.deepcopy(self)

    def with_seed(self, seed: int | None) -> SamplingParams:
        return dataclasses.replace(self, seed=seed)

    def child_params(self, index: int) -> SamplingParams:
        """Params for the `index`-th of `n` parallel samples (vLLM v1 `ParentRequest`).

        Each child is an n=1 request; with a seed, child i gets `seed + i` so the n samples
        differ yet stay reproducible. Without one they share the global RNG and differ anyway.
        """
        assert 0 <= index < self.n, f"child index {index} out of range for n={self.n}"
        if self.n == 1:  # the only child is the request itself (frozen: safe to share)
            return self
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    @classmethod
    def from_generation_config(
        cls, gen_cfg: dict[str, Any] | None, **overrides: Any
    ) -> SamplingParams:
        """Model defaults from a HF generation_config.json dict, then request `overrides`.

        Pass the raw JSON (or `GenerationConfig.to_diff_dict()`), not `to_dict()`: the latter
        carries HF's class defaults such as top_k=50 that the model author never chose.
        An override of None for one of the generation-config keys means "not set by the
        request" and keeps the model default, so request fields can be passed straight through.
        """
        defaults = generation_config_defaults(gen_cfg)
        kwargs: dict[str, Any] = dict(defaults)
        for key, value in overrides.items():
            if value is None and key in defaults:
                continue
            kwargs[key] = value
        return cls(**kwargs)


def generation_config_defaults(gen_cfg: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling fields a generation config sets, like vLLM's `get_diff_sampling_param`."""
    if not gen_cfg:
        return {}
    return {
        field: gen_cfg[key]
        for key, field in GENERATION_CONFIG_KEYS.items()
        if gen_cfg.get(key) is not None
    }


def default_sampling_params(gen_cfg: dict[str, Any] | None) -> SamplingParams:
    """What a request that sets nothing gets: the model's generation config over our defaults."""
    return SamplingParams.from_generation_config(gen_cfg)


def eos_token_ids_from_generation_config(gen_cfg: dict[str, Any] | None) -> set[int]:
    """`eos_token_id` may be an int or a list in generation_config.json; return a set."""
    eos = (gen_cfg or {}).get("eos_token_id")
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
