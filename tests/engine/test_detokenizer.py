"""Incremental detokenizer == full decode; stop strings are found and never streamed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.tokenizer import load_tokenizer
from tests.fixtures.tiny_models import IM_END_ID, IM_START_ID

UNICODE_TEXTS = [
    "東京は日本の首都です。 北京是中国的首都。",
    "Emoji 😀🎉🚀 ❤️ 👍🏽 🇫🇷 family 👨‍👩‍👧 done",
    "Café naïve résumé Ångström jalapeño ÿ ĳ ǅ",
    "Mixed: ∑∫√π ≈ 3.14 — «quotes» \u2018single\u2019 ¿Qué? 서울 🦀 z̷a̷l̷g̷o",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_path: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(tiny_qwen3_path)


def _stream(
    detok: IncrementalDetokenizer, ids: list[int], rng: random.Random
) -> tuple[list[str], str]:
    """Feed `ids` in random chunks of 1-3; return the deltas and the final flush."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.update(ids[i : i + n]))
        i += n
    return deltas, detok.flush()


def test_unicode_text_streams_without_replacement_chars(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    rng = random.Random(0)
    num_split_chars = 0
    for text in UNICODE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        num_split_chars += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
        for prompt in ([], tokenizer.encode("Say: 東京", add_special_tokens=False)):
            detok = IncrementalDetokenizer(tokenizer, prompt)
            deltas, rest = _stream(detok, ids, rng)
            assert all("\ufffd" not in d for d in deltas), deltas
            assert "".join(deltas) == detok.output_text == text
            assert rest == ""
    # The test means something only if the byte-level tokenizer splits characters.
    assert num_split_chars > 10


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_full_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    rng = random.Random(int(skip_special_tokens))
    vocab_size = len(tokenizer)
    for _ in range(500):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))]
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        deltas, rest = _stream(detok, ids, rng)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) + rest == expected == detok.output_text
        assert rest == "" or rest.endswith("\ufffd")  # only an incomplete tail is held


def test_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [IM_START_ID, *tokenizer.encode("hi 😀", add_special_tokens=False), IM_END_ID]
    kept = IncrementalDetokenizer(tokenizer, [IM_START_ID], skip_special_tokens=False)
    assert "".join(kept.update([i]) for i in ids) == "<|im_start|>hi 😀<|im_end|>"
    skipped = IncrementalDetokenizer(tokenizer, [IM_START_ID], skip_special_tokens=True)
    assert "".join(skipped.update([i]) for i in ids) == "hi 😀"


def test_prompt_ending_mid_character(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("東京😀", add_special_tokens=False)
    split = next(k for k in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:k]))
    detok = IncrementalDetokenizer(tokenizer, ids[:split])
    out = ids[split:] + tokenizer.encode(" ok", add_special_tokens=False)
    assert "".join(detok.update([i]) for i in out) + detok.flush() == tokenizer.decode(out)


def _emit(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    """Stream `deltas` through `matcher` like the engine does; flush if no stop was hit."""
    text = ""
    for delta in deltas:
        emitted, stopped = matcher.feed(delta)
        text += emitted
        if stopped:
            return text, True
    return text + matcher.flush(), False


def test_stop_across_delta_boundaries() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("Hello S") == ("Hello ", False)
    assert matcher.feed("T") == ("", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("P and more") == ("", True)
    assert matcher.stop_str == "STOP" and matcher.is_stopped


def test_false_start_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("AR") == ("STAR", False)
    assert matcher.feed("S") == ("", False)
    assert matcher.flush() == "S"
    assert _emit(StopStringMatcher(["xyz"]), ["abc", "def"]) == ("abcdef", False)
    assert StopStringMatcher(["xyz"]).feed("no match here") == ("no match here", False)


def test_multiple_stop_strings_earliest_wins() -> None:
    assert _emit(StopStringMatcher(["world", "lo"]), ["hello world"]) == ("hel", True)
    assert _emit(StopStringMatcher(["o w", "ld"]), ["hel", "lo wor", "ld"]) == ("hell", True)
    # First to complete wins, whatever the chunking: "bc" completes before "abcd".
    assert _emit(StopStringMatcher(["abcd", "bc"]), ["xabcd"]) == ("xa", True)
    assert _emit(StopStringMatcher(["abcd", "bc"]), ["xab", "cd"]) == ("xa", True)


def test_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(["</s>", "END"], include_stop_str_in_output=True)
    assert _emit(matcher, ["answer: 42 </", "s> trailing"]) == ("answer: 42 </s>", True)
    assert matcher.stop_str == "</s>"


def test_stop_result_independent_of_chunking() -> None:
    rng = random.Random(0)
    stops = ["ab", "bca", "cc", "abcab", "é😀"]
    for _ in range(300):
        text = "".join(rng.choice("abcxé😀") for _ in range(rng.randint(0, 30)))
        include = rng.random() < 0.5
        # Reference: one character at a time.
        expected = _emit(StopStringMatcher(stops, include), list(text))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _emit(StopStringMatcher(stops, include), chunks) == expected, (text, chunks)
        emitted, stopped = expected
        assert stopped or emitted == text
        # No stop string completes before the end of the output (nor inside it, when excluded).
        assert not any(s in (emitted[:-1] if include else emitted) for s in stops)


def test_no_stop_strings_is_passthrough() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""
    with pytest.raises(ValueError):
        StopStringMatcher([""])
