"""Incremental detokenizers == full decode; stop strings are found and never streamed.

Every invariant runs on both detokenizers: the Python algorithm and the Rust DecodeStream one.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

import engine.detokenizer as detokenizer_module
from engine.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    StopStringMatcher,
    make_detokenizer,
)
from engine.tokenizer import load_tokenizer
from engine.tokenizer_files import load_light_tokenizer
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


Detokenizer = IncrementalDetokenizer | FastIncrementalDetokenizer


@pytest.fixture(params=["python", "rust"])
def new_detok(request, tokenizer: PreTrainedTokenizerBase):
    """Builds the detokenizer under test: new_detok(prompt, skip_special_tokens=True)."""

    def build(prompt: list[int], skip_special_tokens: bool = True) -> Detokenizer:
        if request.param == "python":
            return IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        backend = tokenizer.backend_tokenizer
        return FastIncrementalDetokenizer(backend, prompt, skip_special_tokens)

    return build


def _stream(detok: Detokenizer, ids: list[int], rng: random.Random) -> tuple[list[str], str]:
    """Feed `ids` in random chunks of 1-3; return the deltas and the final flush."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.update(ids[i : i + n]))
        i += n
    return deltas, detok.flush()


def test_unicode_text_streams_without_replacement_chars(
    tokenizer: PreTrainedTokenizerBase, new_detok
) -> None:
    rng = random.Random(0)
    num_split_chars = 0
    for text in UNICODE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        num_split_chars += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
        for prompt in ([], tokenizer.encode("Say: 東京", add_special_tokens=False)):
            detok = new_detok(prompt)
            deltas, rest = _stream(detok, ids, rng)
            assert all("\ufffd" not in d for d in deltas), deltas
            assert "".join(deltas) == detok.output_text == text
            assert rest == ""
    # The test means something only if the byte-level tokenizer splits characters.
    assert num_split_chars > 10


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_full_decode(
    tokenizer: PreTrainedTokenizerBase, new_detok, skip_special_tokens: bool
) -> None:
    rng = random.Random(int(skip_special_tokens))
    vocab_size = len(tokenizer)
    num_held = 0
    for _ in range(500):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))]
        detok = new_detok(prompt, skip_special_tokens)
        deltas, rest = _stream(detok, ids, rng)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) + rest == expected == detok.output_text
        assert rest == "" or rest.endswith("\ufffd")  # only an incomplete tail is held
        num_held += rest != ""
    assert num_held > 10  # the flush is exercised, not only the deltas


def test_special_tokens(tokenizer: PreTrainedTokenizerBase, new_detok) -> None:
    ids = [IM_START_ID, *tokenizer.encode("hi 😀", add_special_tokens=False), IM_END_ID]
    kept = new_detok([IM_START_ID], skip_special_tokens=False)
    assert "".join(kept.update([i]) for i in ids) == "<|im_start|>hi 😀<|im_end|>"
    skipped = new_detok([IM_START_ID], skip_special_tokens=True)
    assert "".join(skipped.update([i]) for i in ids) == "hi 😀"


def test_prompt_ending_mid_character(tokenizer: PreTrainedTokenizerBase, new_detok) -> None:
    ids = tokenizer.encode("東京😀", add_special_tokens=False)
    split = next(k for k in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:k]))
    detok = new_detok(ids[:split])
    out = ids[split:] + tokenizer.encode(" ok", add_special_tokens=False)
    assert "".join(detok.update([i]) for i in out) + detok.flush() == tokenizer.decode(out)


def test_ids_beyond_the_vocabulary_decode_to_nothing(
    tokenizer: PreTrainedTokenizerBase, new_detok
) -> None:
    """Models pad their embedding past the tokenizer's vocabulary; such ids have no text."""
    ids = tokenizer.encode("a b", add_special_tokens=False)
    detok = new_detok([])
    out = [ids[0], len(tokenizer) + 7, *ids[1:]]
    assert "".join(detok.update([i]) for i in out) + detok.flush() == "a b"


def test_rust_stream_for_tokenizers_backed_by_tokenizers(
    tokenizer: PreTrainedTokenizerBase, tiny_qwen3_path: Path
) -> None:
    light = load_light_tokenizer(tiny_qwen3_path)
    for tok in (tokenizer, light):
        assert isinstance(make_detokenizer(tok, [1, 2]), FastIncrementalDetokenizer)

    class NoBackend:  # a slow (sentencepiece or custom) tokenizer has no Rust backend
        def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
            return tokenizer.convert_ids_to_tokens(ids, skip_special_tokens)

        def convert_tokens_to_string(self, tokens):
            return tokenizer.convert_tokens_to_string(tokens)

    slow = make_detokenizer(NoBackend(), [1, 2])
    assert isinstance(slow, IncrementalDetokenizer)
    ids = tokenizer.encode("still streams", add_special_tokens=False)
    assert "".join(slow.update([i]) for i in ids) + slow.flush() == "still streams"


def test_rust_stream_restarts_after_an_invalid_prefix(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """DecodeStream raises when a tokenizer's text for more ids does not extend its text for
    fewer (vLLM #17448): the request goes on without context, logged; other errors raise."""
    real = detokenizer_module.DecodeStream
    failures = {"Invalid prefix encountered while decoding": 1, "something else": 0}

    class FailingOnce:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def step(self, backend, ids):
            for message, left in failures.items():
                if left:
                    failures[message] = 0
                    raise Exception(message)
            return self.inner.step(backend, ids)

    monkeypatch.setattr(detokenizer_module, "DecodeStream", FailingOnce)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    detok = make_detokenizer(tokenizer, [])
    assert "".join(detok.update([i]) for i in ids) + detok.flush() == "hello world"
    assert "restarting the request's decode stream" in caplog.text
    failures["something else"] = 1
    with pytest.raises(Exception, match="something else"):
        make_detokenizer(tokenizer, []).update(ids[:1])


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


def test_rust_stream_on_a_sentencepiece_style_decoder() -> None:
    """Llama-2's decoder chain (Metaspace spaces, byte fallback, a stripped first space): the
    stream equals a full decode, characters spelled in byte tokens included; after a prompt,
    the first word keeps its space (decode strips it only at the start of a text). Cut inside
    a character, the stream emits every complete character and flushes U+FFFD for the rest,
    where a full decode turns the whole run of byte tokens into U+FFFD (byte fallback decodes
    a run all or nothing): the complete part is compared with the decode that ends before."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    in_vocab = sorted(set("Hello world, a test. Café naïve ok".replace(" ", "▁")))
    vocab = {
        t: i for i, t in enumerate(["<unk>", *in_vocab, *(f"<0x{b:02X}>" for b in range(256))])
    }
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    rng = random.Random(0)
    alphabet = list("Hello world, a test. Café naïve ok") + list("東京жΩ😀🚀")  # the last: bytes
    num_held = num_byte_chars = 0
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = backend.encode(text).ids
        ids = ids[: rng.randint(1, len(ids))]  # cut anywhere: mid-character too
        num_byte_chars += any(backend.id_to_token(i).startswith("<0x") for i in ids)
        # The longest prefix that ends on a whole character, and its text.
        k = next(
            k for k in range(len(ids), -1, -1) if not backend.decode(ids[:k]).endswith("\ufffd")
        )
        complete = backend.decode(ids[:k])
        for prompt, space in (([], ""), (backend.encode(rng.choice(["Say:", "ok"])).ids, " ")):
            detok = FastIncrementalDetokenizer(backend, prompt, skip_special_tokens=True)
            deltas = [detok.update([i]) for i in ids]  # one id per step, as decoding gives
            rest = detok.flush()
            assert "".join(deltas) in (complete, space + complete)
            assert len(rest) == len(ids) - k and set(rest) <= {"\ufffd"}
            num_held += rest != ""
    assert num_byte_chars > 100 and num_held > 10  # byte tokens seen; cut characters flushed
