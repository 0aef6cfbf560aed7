"""The stack sampler (`TANDEM_STACK_SAMPLE_DIR`) sees a busy thread busy in the function that
spins, a waiting thread idle, and writes what `summarize` reads back."""

import json
import threading
import time

from engine.stack_sampler import StackSampler, summarize


def _spin_here(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(200))


def _until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_busy_and_idle_threads(tmp_path):
    stop = threading.Event()
    busy = threading.Thread(target=_spin_here, args=(stop,), name="spinner")
    idle = threading.Thread(target=stop.wait, name="waiter")
    sampler = StackSampler(interval_s=0.001).start()
    busy.start()
    idle.start()
    try:
        _until(lambda: sum(sampler.counts["spinner"].values()) >= 200)
        _until(lambda: sum(sampler.counts["waiter"].values()) >= 200)
        sampler.write(tmp_path / "mid.json")  # while sampling: a consistent snapshot
    finally:
        stop.set()
        busy.join()
        idle.join()
        sampler.stop()
    sampler.write(tmp_path / "s.json")
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["num_samples"] >= 200
    assert json.loads((tmp_path / "mid.json").read_text())["threads"]["spinner"]
    summary = summarize(data)
    spinner, waiter = summary["spinner"], summary["waiter"]
    # The spinner waits only for the GIL, in this file's function or the sum under it.
    assert spinner["busy_share"] > 0.9
    assert spinner["total"]["test_stack_sampler.py:_spin_here"] > 0.9
    assert waiter["busy_share"] < 0.05
    assert "stack-sampler" not in summary
