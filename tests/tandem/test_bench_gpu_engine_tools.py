"""`bench/gpu_engine`'s decode floors: the bytes a step reads, counted from the model's parts."""

from __future__ import annotations

import pytest

from bench import gpu_engine
from engine import LLM


def _nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_step_reads_every_weight_but_the_embedding_table(family, tiny_qwen3_path, tiny_llama_path):
    """The tiny Qwen3 has its own LM head: a step reads the layers, the final norm, the LM
    head and one embedding row. The tiny Llama's LM head is its embedding table: all of it."""
    path = tiny_qwen3_path if family == "qwen3" else tiny_llama_path
    llm = LLM(str(path), load_format="dummy", dtype="float32", skip_tokenizer_init=True)
    model = llm.engine.runner.model
    table = model.embed_tokens.weight
    read = _nbytes(model.layers) + _nbytes(model.norm) + _nbytes(model.rotary)
    if model.tie_word_embeddings:
        read += table.numel() * table.element_size()
    else:
        read += _nbytes(model.lm_head) + table.shape[1] * table.element_size()
    assert gpu_engine.step_read_bytes(llm.engine.runner) == read
    assert (gpu_engine.step_read_bytes(llm.engine.runner) < gpu_engine.weight_bytes(llm)) == (
        family == "qwen3"
    )
