"""`tandem bench serve`: load any OpenAI-compatible server over HTTP and report vLLM's figures.

A run, in order: `datasets` samples the prompts (token lengths from the tokenizer); `runner`
sends them at the arrival times and concurrency of one load point, each through `client`
(one streamed request, timed on an injectable clock); `metrics` turns the outputs into vLLM's
result fields; `serve` is the CLI (flags as `vllm bench serve`, plus `--sweep`) and saves the
JSON; `plots` draws latency CDFs and load curves (matplotlib, Agg).
"""
