"""The committed gRPC stubs are exactly what protoc generates from the .proto files."""

from __future__ import annotations

from protos.generate import PROTO_DIR, generate


def test_generated_stubs_are_fresh(tmp_path):
    outputs = generate(tmp_path)
    assert outputs, "protoc produced nothing"
    stale = [p.name for p in outputs if p.read_text() != (PROTO_DIR / p.name).read_text()]
    assert not stale, f"stale stubs {stale}: run `python -m protos.generate` and commit"
