"""`tandem decode` whose engine steps take at least SECONDS each (a loaded GPU, on a CPU).

Usage: python -m tests.integration.slow_decode SECONDS [tandem decode flags]
Only for tests (`test_drain.py`): a stream then lasts long enough to be in flight on purpose.
"""

from __future__ import annotations

import sys
import time

from decode_svc.server import main
from engine.engine_core import EngineCore


def slow_down(step_s: float) -> None:
    real_step = EngineCore.step

    def step(self):
        if self.has_unfinished_requests():
            time.sleep(step_s)
        return real_step(self)

    EngineCore.step = step


if __name__ == "__main__":
    slow_down(float(sys.argv[1]))
    main(sys.argv[2:])
