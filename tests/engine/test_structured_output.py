"""Structured outputs on a tiny random model: the grammar alone makes its output valid.

JSON schema (validated with `jsonschema`), json_object, regex, choice, EBNF and Lark grammars,
structural tags; invalid constraints are ValueErrors that say what is wrong; constrained and
unconstrained rows share a batch without changing each other; compiled grammars are cached;
reasoning gating; prefill-role + decode-role cores resume the grammar across the hand-off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import threading

import jsonschema
import pytest
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.request import Request
from engine.sampling_params import StructuredOutputsParams as SO
from engine.serving import add_engine_args, engine_config_from_args
from engine.structured_output import choice_ebnf, reasoning_ended_in_prompt

SCHEMA = {
    "type": "object",
    "properties": {
        # A pattern, not maxLength: xgrammar's maxLength strings admit control characters.
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "ok"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON:"


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), max_model_len=256)


def _text(llm, so: SO, prompt=PROMPT, **kw) -> tuple[str, str]:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 60, **kw}, structured_outputs=so)
    out = llm.generate(prompt, params)[0].outputs[0]
    return out.text, out.finish_reason


def test_json_schema_outputs_validate(llm):
    # Random weights with free whitespace may emit whitespace forever: compact JSON here.
    as_dict = SO(json=SCHEMA, disable_any_whitespace=True)
    as_str = SO(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    settings = [(0.0, None, as_dict), (1.0, 1, as_dict), (0.7, 2, as_str), (1.3, 3, as_str)]
    params = [
        SamplingParams(temperature=t, seed=seed, max_tokens=50, structured_outputs=so)
        for t, seed, so in settings
    ]
    for out in llm.generate([PROMPT] * len(params), params):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        jsonschema.validate(json.loads(comp.text), SCHEMA)
        assert " " not in comp.text.replace(": ", "").replace(", ", "")  # no free whitespace


def test_json_object_is_an_object(llm):
    # Random weights write endless keys; a bias towards '"' and '}' (which alone would give
    # '""""}}}}') lets the grammar close the object within a few tokens.
    quote, brace = (llm.tokenizer.convert_tokens_to_ids(t) for t in ('"', "}"))
    so = SO(json_object=True, disable_any_whitespace=True)
    text, reason = _text(llm, so, max_tokens=20, logit_bias={quote: 5.0, brace: 8.0})
    assert reason == "stop", text
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", [None, 4])
def test_regex_fullmatches(llm, seed):
    pattern = r"(cat|dog)-[0-9]{2,4}"
    temp = 0.0 if seed is None else 1.0
    text, reason = _text(llm, SO(regex=pattern), temperature=temp, seed=seed, max_tokens=20)
    assert reason == "stop" and re.fullmatch(pattern, text), text


def test_choice_returns_one_choice(llm):
    choices = ["yes", 'no "way"', "maybe\nlater", "café ☕"]
    so = SO(choice=choices)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured_outputs=so)
        for s in (1, 2, 3)
    ]
    for out in llm.generate([PROMPT] * 3, params):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in choices
    assert xgr.Grammar.from_ebnf(choice_ebnf(choices))  # escaping survives xgrammar's parser


def test_ebnf_and_lark_grammars(llm):
    ebnf = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]{1,5}'
    text, reason = _text(llm, SO(grammar=ebnf), temperature=1.0, seed=7, max_tokens=20)
    assert reason == "stop"
    info = xgr.TokenizerInfo([])  # the grammar itself accepts the text
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(ebnf))
    assert matcher.accept_string(text) and matcher.is_completed(), text
    text, reason = _text(llm, SO(grammar='start: "up" | "down" ("!")?'), max_tokens=10)
    assert reason == "stop" and text in ("up", "down", "down!"), text


def test_structural_tag(llm):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<r>",
            "content": {"type": "json_schema", "json_schema": {"enum": [1, 2, 3]}},
            "end": "</r>",
        },
    }
    text, reason = _text(llm, SO(structural_tag=json.dumps(tag)), max_tokens=20)
    assert reason == "stop" and re.fullmatch(r"<r>[123]</r>", text), text


@pytest.mark.parametrize(
    "so, words",
    [
        (SO(json={"type": "strnig"}), ["JSON schema", "strnig"]),
        (SO(json='{"type": "object",'), ["JSON schema", "parse"]),
        (SO(regex="a(b"), ["regex", "parenthesis"]),
        (SO(grammar="root ::= item"), ["grammar", "item"]),
        (SO(structural_tag='{"type": "structural_tag"}'), ["structural tag", "format"]),
    ],
)
def test_invalid_constraint_is_a_clear_value_error(llm, so, words):
    with pytest.raises(ValueError) as e:
        llm.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=so))
    message = str(e.value)
    assert all(w in message for w in words), message
    assert "/project/cpp" not in message  # no C++ source positions for clients
    assert not llm.engine.has_unfinished_requests()


def test_chat_with_a_constraint(llm):
    so = SO(choice=["red", "green", "blue"])
    params = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=so)
    out = llm.chat([{"role": "user", "content": "Pick a colour."}], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in so.choice


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], free)[0].outputs[0].token_ids
    constrained = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=SO(regex="[0-9]+")
    )
    outs = llm.generate([PROMPT, [5, 6, 7, 8], "x"], [constrained, free, constrained])
    assert outs[1].outputs[0].token_ids == alone
    for i in (0, 2):
        assert re.fullmatch("[0-9]+", outs[i].outputs[0].text), outs[i].outputs[0].text


def test_many_constrained_rows_of_different_kinds_share_a_batch(llm):
    """Several constrained rows of different kinds share one batch bitmask:
    each row still gets its own grammar (different kinds in one batch), beside a free row."""
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], free)[0].outputs[0].token_ids
    kinds = [
        SO(regex="[0-9]+"),
        SO(choice=["yes", "no"]),
        SO(json=SMALL_SCHEMA, disable_any_whitespace=True),
        SO(regex="[a-c]+"),
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so) for so in kinds
    ]
    outs = llm.generate([PROMPT, "x", "y", "z", [5, 6, 7, 8]], [*params, free])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch("[0-9]+", texts[0]) and texts[1] in ("yes", "no"), texts
    jsonschema.validate(json.loads(texts[2]), SMALL_SCHEMA)
    assert re.fullmatch("[a-c]+", texts[3]), texts
    assert outs[4].outputs[0].token_ids == alone


def test_compiled_grammar_cache_hit(llm):
    so = SO(regex="[a-c]{3}")
    before = llm.engine.structured.num_compiles
    first = _text(llm, so, max_tokens=8)
    assert llm.engine.structured.num_compiles == before + 1
    assert _text(llm, SO(regex="[a-c]{3}"), max_tokens=8) == first
    assert llm.engine.structured.num_compiles == before + 1  # equal spec: no recompile
    _text(llm, SO(regex="[a-c]{4}"), max_tokens=8)
    assert llm.engine.structured.num_compiles == before + 2


def test_terminated_grammar_stops_even_with_ignore_eos(llm):
    text, reason = _text(llm, SO(choice=["alpha", "beta"]), max_tokens=30, ignore_eos=True)
    assert reason == "stop" and text in ("alpha", "beta")


def test_reasoning_end_in_prompt():
    assert not reasoning_ended_in_prompt([1, 2, 3], start_id=10, end_id=11)
    assert reasoning_ended_in_prompt([10, 2, 11, 4], start_id=10, end_id=11)
    assert not reasoning_ended_in_prompt([10, 11, 10, 3], start_id=10, end_id=11)
    assert reasoning_ended_in_prompt([5, 11], start_id=None, end_id=11)
    assert not reasoning_ended_in_prompt([5, 6], start_id=None, end_id=11)


def test_reasoning_is_free_until_its_end_token(llm):
    prompt = [40, 41, 42, 43]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    free_ids = free[0].outputs[0].token_ids
    # A fake end-of-reasoning id: the 3rd token the model would say anyway (greedy).
    k = next(i for i in range(2, 8) if free_ids[i] not in prompt + free_ids[:i])
    end_id = free_ids[k]
    so = SO(regex="[0-9]{3}", reasoning_end_token_id=end_id)
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids[: k + 1] == free_ids[: k + 1]  # unconstrained up to the end token
    after = llm.tokenizer.decode(out.token_ids[k + 1 :], skip_special_tokens=True)
    assert out.finish_reason == "stop" and re.fullmatch("[0-9]{3}", after), after
    # The prompt already closed the reasoning: constrained from the first token.
    out = llm.generate([prompt + [end_id]], params)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", out.text), out.text


def test_preemption_does_not_feed_the_grammar_twice(tiny_qwen3_path):
    # 6 usable blocks of 16: two 44-token prompts fill them, and the 49th token preempts one.
    roomy = LLM(str(tiny_qwen3_path), max_model_len=96, num_gpu_blocks_override=64)
    tight = LLM(str(tiny_qwen3_path), max_model_len=96, num_gpu_blocks_override=7)
    so = SO(json=SMALL_SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=so)
    prompts = [list(range(3 + i, 47 + i)) for i in range(2)]
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SMALL_SCHEMA)


# ---- prefill role + decode role ---------------------------------------------------------------
def _prefill(p: LLM, rid: str, prompt: list[int], params: SamplingParams):
    p_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    p_req = Request(rid, prompt, p_params, p.eos_token_ids, hold_blocks=True)
    p.engine.add_request(p_req)
    first = None
    while p.engine.has_unfinished_requests():
        for out in p.engine.step():
            first = out
    return p_req, first


def _decode(p: LLM, d: LLM, p_req, d_req, alloc, first_token: int) -> list[int]:
    bs = p.config.cache.block_size
    p_blocks = p.engine.kv.get_block_ids(p_req.request_id)
    for i in range(alloc.num_hit_tokens // bs, -(-p_req.num_prompt_tokens // bs)):
        d.engine.runner.kv_cache[alloc.block_ids[i]] = p.engine.runner.kv_cache[p_blocks[i]]
    p.engine.release_blocks(p_req)
    out = d.engine.add_remote_prefilled(d_req, first_token, None, p_req.num_cached_tokens)
    tokens = list(out.new_token_ids)
    while d.engine.has_unfinished_requests():
        for o in d.engine.step():
            tokens += o.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def pd(tiny_qwen3_path):
    kwargs = dict(max_model_len=256, num_gpu_blocks_override=64)
    return [LLM(str(tiny_qwen3_path), **kwargs) for _ in range(3)]


@pytest.mark.parametrize("seed", [None, 9])
def test_decode_resumes_the_remote_prefills_grammar(pd, seed):
    p, d, ref = pd
    so = SO(json=SMALL_SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(
        temperature=0.0 if seed is None else 0.9, seed=seed, max_tokens=30, structured_outputs=so
    )
    prompt = list(range(3, 30))
    rid = f"pd{seed}"
    d_req = Request(rid, prompt, params, d.eos_token_ids)
    alloc = d.engine.allocate_for_remote_prefill(d_req)
    p_req, first = _prefill(p, rid, prompt, params)
    tokens = _decode(p, d, p_req, d_req, alloc, first.new_token_ids[0])
    expected = ref.generate([prompt], params)[0].outputs[0]
    assert tokens == expected.token_ids and expected.finish_reason == "stop"
    jsonschema.validate(json.loads(expected.text), SMALL_SCHEMA)


def test_decode_waits_for_its_grammar_then_feeds_the_first_token(pd):
    """The first token arrives before the decode's compile is done: the request waits, then
    its matcher takes that token and decoding goes on under the grammar."""
    p, d, ref = pd
    manager = d.engine.structured
    release = threading.Event()
    compile_ = manager._compile
    manager._compile = lambda g: release.wait(10) and compile_(g)
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=20, structured_outputs=SO(regex="[a-f]{6}")
        )
        prompt = [7, 8, 9, 10, 11]
        d_req = Request("slow", prompt, params, d.eos_token_ids)
        alloc = d.engine.allocate_for_remote_prefill(d_req)
        p_req, first = _prefill(p, "slow", prompt, params)
        bs = p.config.cache.block_size
        p_blocks = p.engine.kv.get_block_ids("slow")
        for i in range(-(-len(prompt) // bs)):
            d.engine.runner.kv_cache[alloc.block_ids[i]] = p.engine.runner.kv_cache[p_blocks[i]]
        p.engine.release_blocks(p_req)
        out = d.engine.add_remote_prefilled(d_req, first.new_token_ids[0], None, 0)
        assert "slow" in d.engine.compiling and d.engine.stats().num_waiting == 1
        assert d.engine.step() == [] and "slow" in d.engine.compiling
        release.set()
        tokens = list(out.new_token_ids)
        while d.engine.has_unfinished_requests():
            for o in d.engine.step():
                tokens += o.new_token_ids
    finally:
        manager._compile = compile_
        release.set()
    assert tokens == ref.generate([prompt], params)[0].outputs[0].token_ids
    assert d.engine.kv.num_free_blocks == d.engine.kv.pool.num_usable_blocks


def test_a_rejected_first_token_fails_only_that_request(pd):
    _, d, _ = pd
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(regex="[0-9]+"))
    letter = d.tokenizer.encode("x", add_special_tokens=False)[0]
    d_req = Request("bad-first", [5, 6, 7], params, d.eos_token_ids)
    d.engine.allocate_for_remote_prefill(d_req)
    d.engine.add_remote_prefilled(d_req, letter, None, 0)  # P's token breaks the grammar
    outs = []
    while d.engine.has_unfinished_requests():
        outs += d.engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("bad-first", "abort")]
    assert d.engine.kv.num_free_blocks == d.engine.kv.pool.num_usable_blocks


def test_abort_while_compiling_frees_everything(pd):
    _, d, _ = pd
    manager = d.engine.structured
    release = threading.Event()
    compile_ = manager._compile
    manager._compile = lambda g: release.wait(10) and compile_(g)
    try:
        params = SamplingParams(max_tokens=8, structured_outputs=SO(regex="[0-9]{5}x"))
        d.engine.add_request(Request("ab", [5, 6, 7], params, d.eos_token_ids))
        assert d.engine.has_unfinished_requests() and "ab" in d.engine.scheduler.requests
        assert d.engine.abort_request("ab")
        assert not d.engine.has_unfinished_requests() and "ab" not in d.engine.scheduler.requests
    finally:
        manager._compile = compile_
        release.set()


# ---- the backend flag -------------------------------------------------------------------------
def test_backend_flag(tiny_qwen3_path, capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flag = "--structured-outputs-config.backend"
    assert parser.parse_args([]).structured_outputs_backend == "auto"
    args = parser.parse_args([str(tiny_qwen3_path), flag, "xgrammar"])
    assert engine_config_from_args(args).structured_outputs.backend == "xgrammar"
    for name in ("guidance", "outlines", "lm-format-enforcer"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, name])
        assert f"{name!r} is not available in Tandem" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([flag, "nope"])
    assert "Unknown structured outputs backend 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="xgrammar only"):  # before any model is looked up
        LLM("no/such-model", structured_outputs_config={"backend": "outlines"})
