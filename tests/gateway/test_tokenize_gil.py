"""Tokenizing a prompt leaves the GIL to the rest of the gateway: the event loop (streams, other
requests) runs while a preprocessing worker tokenizes. `Tokenizer.encode` of the `tokenizers`
library holds the GIL for its whole call; `encode_batch` and `encode_batch_fast` (which
`encode_bounded` calls) release it (measured, tokenizers 0.23: a thread spinning beside `encode`
was held up 76-84% of the time, beside `encode_batch` as little as alone), so a burst of long
prompts was tokenized one at a time on the loop's thread whatever the pool's size."""

from __future__ import annotations

import dataclasses
import threading
import time

from gateway.preprocess import encode_bounded


def _spin_while_encoding(info, text: str) -> tuple[float, float]:
    """(seconds `encode_bounded` took in a thread, fraction of that time this thread ran)."""
    state = {"started": False, "done": False}

    def encode() -> None:
        state["started"] = True
        state["ids"] = encode_bounded(info, text, add_special_tokens=False)
        state["done"] = True

    # This thread's loop rate alone, to turn a count into time.
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        n += 1
    rate = n / (time.perf_counter() - t0)
    worker = threading.Thread(target=encode)
    count, begin = 0, time.perf_counter()
    worker.start()
    while not state["done"]:
        if state["started"]:
            count += 1
            time.perf_counter()  # the same work per iteration as the calibration
    took = time.perf_counter() - begin
    worker.join()
    assert state["ids"]
    return took, count / rate / took


def test_the_loop_runs_while_a_prompt_is_tokenized(model_info):
    info = dataclasses.replace(model_info, max_model_len=10**8)
    text = "the quick brown fox jumps over the lazy dog, 12345 times! " * 2000
    while True:  # long enough that the GIL's 5 ms switch interval cannot account for the result
        took, ran = _spin_while_encoding(info, text)
        if took > 0.2 or len(text) > 50_000_000:
            break
        text *= 2
    assert took > 0.2, took
    # Holding the GIL, the encode left this thread at most a switch interval or two (~2%);
    # released, this thread runs beside it (on a loaded 2-core machine, still a good share).
    assert ran > 0.15, f"the spinning thread ran {ran:.0%} of the {took:.2f} s encode"
