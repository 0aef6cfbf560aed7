"""Prompts to send: `random` (exact token lengths), `sharegpt` and `custom` files, as vLLM's
`vllm/benchmarks/datasets.py` samples them (same flags, same seeding rules).

Every sampler returns `SampleRequest`s whose `prompt_len` is the prompt's token count under the
benchmark's tokenizer, without special tokens; `expected_output_len` becomes `max_tokens`.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DATASET_NAMES = ("random", "sharegpt", "custom")


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def add_dataset_args(parser) -> None:
    parser.add_argument(
        "--dataset-name",
        default="random",
        choices=DATASET_NAMES,
        help="where the prompts come from",
    )
    parser.add_argument(
        "--dataset-path",
        default=None,
        help="local file: ShareGPT JSON (conversations) or custom JSONL "
        '({"prompt": ..., "output_tokens": N})',
    )
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests per load point")
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds prompt sampling and arrival times"
    )
    parser.add_argument(
        "--disable-shuffle",
        action="store_true",
        help="keep the file order of sharegpt / custom prompts",
    )
    group = parser.add_argument_group("random dataset")
    group.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="prompt tokens per request (special tokens included)",
    )
    group.add_argument(
        "--random-output-len", type=int, default=128, help="output tokens per request"
    )
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from [len*(1-r), len*(1+r)], r in [0, 1)",
    )
    group.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="tokens of one random prefix shared by every prompt",
    )
    group = parser.add_argument_group("sharegpt / custom datasets")
    group.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output tokens per request instead of the reply's length",
    )
    group.add_argument(
        "--custom-output-len",
        type=int,
        default=256,
        help="output tokens of a custom line without output_tokens",
    )


def sample_requests(args, tokenizer) -> list[SampleRequest]:
    if args.dataset_name == "random":
        return random_requests(
            tokenizer,
            args.num_prompts,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            seed=args.seed,
        )
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "sharegpt":
        rows = sharegpt_rows(Path(args.dataset_path), args.sharegpt_output_len)
    else:
        rows = custom_rows(Path(args.dataset_path), args.custom_output_len)
    return file_requests(
        rows,
        tokenizer,
        args.num_prompts,
        args.seed,
        shuffle=not args.disable_shuffle,
        is_sharegpt=args.dataset_name == "sharegpt" and args.sharegpt_output_len is None,
    )


# ---- random --------------------------------------------------------------------------------
def random_requests(
    tokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's RandomDataset: lengths uniform around the targets; prompt i is the allowed
    vocabulary from offset_i + i on, after one shared random prefix; decoded, re-encoded and
    trimmed or padded until its token count is what was drawn. Allowed: `roundtrip_tokens`
    (vLLM takes every non-special id, and some of its prompts miss their length)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    real_input_len = max(0, input_len - int(tokenizer.num_special_tokens_to_add()))
    in_low = math.floor(real_input_len * (1 - range_ratio))
    in_high = math.ceil(real_input_len * (1 + range_ratio))
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + in_low < 1:
        raise ValueError("--random-input-len is too small: a prompt needs at least one token")
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)
    allowed = roundtrip_tokens(tokenizer)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
    ids = [
        prefix + allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        for i in range(num_requests)
    ]
    # Every prompt's first decode + encode in one batch each (Rust, on all cores): the same
    # texts as one at a time, and the rng is drawn only in the retries below, still in prompt
    # order. 1,000 x 512 tokens: ~20 s one at a time before the first request was sent.
    texts = tokenizer.batch_decode(ids)
    first = _encode_all(tokenizer, texts)
    requests = []
    for i in range(num_requests):
        target = prefix_len + int(input_lens[i])
        prompt, prompt_len = _decode_to_len(
            tokenizer, ids[i], target, allowed, rng, first=(texts[i], first[i])
        )
        requests.append(SampleRequest(prompt, prompt_len, int(output_lens[i])))
    return requests


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids without special tokens: in one Rust batch for a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _decode_to_len(
    tokenizer,
    ids: list[int],
    target: int,
    allowed,
    rng,
    max_retry: int = 10,
    first: tuple[str, list[int]] | None = None,
):
    """(text, its token count): `target` where the tokenizer allows it. Token sequences do not
    all survive decode/encode (neighbours merge), so trim or pad and try again; the count
    returned is always the text's own. `first`: the first try's (text, ids), made already."""
    for attempt in range(max_retry):
        if attempt == 0 and first is not None:
            prompt, ids = first
        else:
            prompt = tokenizer.decode(ids)
            ids = tokenizer.encode(prompt, add_special_tokens=False)
        if len(ids) == target:
            return prompt, target
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + allowed[rng.integers(0, len(allowed), size=target - len(ids))].tolist()
    prompt = tokenizer.decode(ids)
    return prompt, len(tokenizer.encode(prompt, add_special_tokens=False))


def roundtrip_tokens(tokenizer) -> np.ndarray:
    """Ids that are not special and come back as themselves from decode + encode alone: no
    partial UTF-8 byte (it decodes to U+FFFD), no token the tokenizer would split or strip."""
    special = set(tokenizer.all_special_ids)
    ids = [t for t in range(tokenizer.vocab_size) if t not in special]
    encoded = _encode_all(tokenizer, tokenizer.batch_decode([[t] for t in ids]))
    return np.array([t for t, enc in zip(ids, encoded) if enc == [t]])


# ---- files ---------------------------------------------------------------------------------
def sharegpt_rows(path: Path, output_len: int | None) -> list[tuple[str, Any]]:
    """(prompt, reply text or fixed output length) from the first two turns of each
    conversation of a ShareGPT JSON file (a list of {"conversations": [{"value": ...}, ...]})."""
    data = json.loads(path.read_text())
    rows = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2:
            rows.append((turns[0]["value"], output_len if output_len else turns[1]["value"]))
    return rows


def custom_rows(path: Path, default_output_len: int) -> list[tuple[str, Any]]:
    """(prompt, output tokens) per line of a JSONL file: {"prompt": ..., "output_tokens": N}."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if "prompt" not in obj:
            raise ValueError(f"{path}:{n}: a custom dataset line needs a 'prompt' field")
        rows.append((obj["prompt"], int(obj.get("output_tokens", default_output_len))))
    return rows


def file_requests(
    rows: list[tuple[str, Any]],
    tokenizer,
    num_requests: int,
    seed: int,
    shuffle: bool = True,
    is_sharegpt: bool = False,
) -> list[SampleRequest]:
    """Shuffle (seeded), count tokens, keep valid rows; too few rows are oversampled."""
    rows = list(rows)
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(rows)
    requests = []
    for prompt, out in rows:
        if len(requests) == num_requests:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = len(tokenizer.encode(out, add_special_tokens=False)) if is_sharegpt else out
        # vLLM's ShareGPT filter: too short or too long conversations are skipped.
        if is_sharegpt and not (
            4 <= prompt_len <= 1024 and output_len >= 4 and prompt_len + output_len <= 2048
        ):
            continue
        requests.append(SampleRequest(prompt, prompt_len, int(output_len)))
    if not requests:
        raise ValueError("the dataset has no usable prompt")
    if len(requests) < num_requests:
        logger.info("oversampling: %d prompts for %d requests", len(requests), num_requests)
        requests += rng.choices(requests, k=num_requests - len(requests))
    return requests
