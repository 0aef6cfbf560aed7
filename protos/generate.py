"""Regenerate the Python stubs: `python -m protos.generate`. A test fails when they are stale."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ["common.proto", "prefill.proto", "decode.proto"]


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(PROTO_DIR / p) for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    outputs = []
    for path in sorted(out_dir.glob("*_pb2*.py*")):
        # protoc emits `import common_pb2`; make imports package-relative.
        text = re.sub(
            r"^import (\w+_pb2) as", r"from protos import \1 as", path.read_text(), flags=re.M
        )
        path.write_text(text)
        outputs.append(path)
    return outputs


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(p)
