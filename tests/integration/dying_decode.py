"""`tandem decode` whose engine loop dies: `EngineCore.step` raises after N steps.

Usage: python -m tests.integration.dying_decode N [tandem decode flags]
Only for tests (`test_supervision.py`): the product has no way to inject this.
"""

from __future__ import annotations

import sys

from decode_svc.server import main
from engine.engine_core import EngineCore


def fail_after(num_steps: int) -> None:
    real_step = EngineCore.step
    count = 0

    def step(self):
        nonlocal count
        count += 1
        if count > num_steps:
            raise RuntimeError(f"injected failure at step {count}")
        return real_step(self)

    EngineCore.step = step


if __name__ == "__main__":
    fail_after(int(sys.argv[1]))
    main(sys.argv[2:])
