"""Where a service's threads spend their time: their Python stacks, sampled from inside.

Off by default. A service started with `TANDEM_STACK_SAMPLE_DIR=<dir>` samples every thread's
stack `INTERVAL_S` apart and writes `<dir>/<instance id>-stacks.json` as it stops (beside the
step trace, see `engine/step_trace.py`): per thread, how often each stack (innermost
`MAX_DEPTH` frames, "file:function") was seen. For machines where py-spy cannot attach (the
lent GPUs run under gVisor, where ptrace is refused); `summarize` reads a thread's busy share and
its hottest frames back.

A sample needs the GIL, so a thread holding it through a long C call is seen once that call
returns: shares of pure-Python work are right, long C calls are under-counted.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from pathlib import Path

INTERVAL_S = 0.005
MAX_DEPTH = 24
# A thread whose innermost frame is one of these is waiting, not working.
IDLE_FRAMES = (
    "threading.py:wait",
    "selectors.py:select",
    "queue.py:get",
    "runners.py:run",  # uvloop: its C run loop (polling, or running C callbacks) below this
    "base_events.py:run_forever",
    "base_events.py:_run_once",
    "stack_sampler.py:_run",
    "async_engine.py:_wait_for_command",  # the engine thread, in its command queue's get
    "threading.py:run",  # a thread whose target is C code: gRPC's completion-queue poller
)


class StackSampler:
    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.num_samples = 0
        self.started = time.time()
        self._lock = threading.Lock()  # `write` may run while samples are still taken
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            stacks = []
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None and len(stack) < MAX_DEPTH:
                    code = frame.f_code
                    stack.append(f"{Path(code.co_filename).name}:{code.co_name}")
                    frame = frame.f_back
                stacks.append((names.get(ident, str(ident)), ";".join(reversed(stack))))
            with self._lock:
                for name, stack in stacks:
                    self.counts[name][stack] += 1
                self.num_samples += 1

    def write(self, path: Path) -> None:
        with self._lock:
            data = {
                "interval_s": self.interval_s,
                "started": self.started,
                "stopped": time.time(),
                "num_samples": self.num_samples,
                "threads": {name: dict(c.most_common()) for name, c in self.counts.items()},
            }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data) + "\n")


def summarize(data: dict, top: int = 12) -> dict[str, dict]:
    """Per thread: samples, busy share (innermost frame not a wait) and the busy samples'
    hottest frames, innermost (`self`) and anywhere in the stack (`total`), as shares."""
    out = {}
    for name, stacks in data["threads"].items():
        total = sum(stacks.values())
        self_c: collections.Counter = collections.Counter()
        incl: collections.Counter = collections.Counter()
        busy = 0
        for stack, n in stacks.items():
            frames = stack.split(";")
            if frames[-1] in IDLE_FRAMES:
                continue
            busy += n
            self_c[frames[-1]] += n
            for f in set(frames):
                incl[f] += n
        out[name] = {
            "samples": total,
            "busy_share": busy / total if total else 0.0,
            "self": {f: round(n / total, 4) for f, n in self_c.most_common(top)},
            "total": {f: round(n / total, 4) for f, n in incl.most_common(top)},
        }
    return out


def main() -> None:
    """`python -m engine.stack_sampler FILE...`: each file's summary, as JSON."""
    for arg in sys.argv[1:]:
        print(json.dumps({arg: summarize(json.loads(Path(arg).read_text()))}, indent=1))


if __name__ == "__main__":
    main()
