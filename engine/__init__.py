"""Tandem's engine: what prefill and decode services share (see README's module map).

`LLM` is imported on first use: it pulls in torch and the model runner, and the gateway
imports this package for its torch-free modules only (block hashing, sampling parameters,
detokenizer, output processing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
