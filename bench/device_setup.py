"""Install carried wheels on the lent GPU machine (no package index there): each wheel in the
folder whose module does not import yet goes into a target folder with --no-deps, so nothing
the image already has is shadowed (a carried typing_extensions older than the image's once broke
anyio there). Put the target first on PYTHONPATH afterwards.

    python -m bench.device_setup .whl_so /tmp/site && export PYTHONPATH=/tmp/site:$PWD
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

# Distribution (wheel name prefix) -> the module it provides, where they differ.
MODULES = {
    "attrs": "attr",
    "grpcio_health_checking": "grpc_health",
    "python_dotenv": "dotenv",
    "apache_tvm_ffi": "tvm_ffi",
    "opentelemetry_api": "opentelemetry",
    "libucx_cu13": "libucx",
    "libucxx_cu13": "libucxx",
    "ucxx_cu13": "ucxx",
    "librmm_cu13": "librmm",
    "rmm_cu13": "rmm",
}


def main() -> None:
    wheels_dir, target = Path(sys.argv[1]), sys.argv[2]
    missing = []
    for wheel in sorted(wheels_dir.glob("*.whl")):
        dist = wheel.name.split("-")[0]
        module = MODULES.get(dist, dist)
        if importlib.util.find_spec(module) is None:
            missing.append(str(wheel))
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target]
        subprocess.run([*cmd, *missing], check=True)
    print("installed:", ", ".join(Path(m).name.split("-")[0] for m in missing) or "nothing")


if __name__ == "__main__":
    main()
