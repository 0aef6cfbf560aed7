"""Exec probe for gRPC health under internal mTLS (the kubelet's own `grpc` probe cannot
present a client certificate). Usage: health_probe.py [SERVICE]; "" (default) is liveness, the
service's name (tandem.v1.Prefill / tandem.v1.Decode) readiness. Exits 0 when SERVING.

Dials 127.0.0.1:$TANDEM_GRPC_PORT with the pod's own certificate
($TANDEM_INTERNAL_TLS_CERT/_KEY/_CA) and checks the server's certificate against the host of
$TANDEM_ADVERTISE_ADDRESS, the name peers dial. Without TLS variables it dials in plaintext.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    service = argv[1] if len(argv) > 1 else ""
    target = f"127.0.0.1:{os.environ.get('TANDEM_GRPC_PORT', '50051')}"
    paths = [os.environ.get(f"TANDEM_INTERNAL_TLS_{n}") for n in ("CERT", "KEY", "CA")]
    if all(paths):
        cert, key, ca = (open(p, "rb").read() for p in paths)
        credentials = grpc.ssl_channel_credentials(ca, key, cert)
        host = os.environ.get("TANDEM_ADVERTISE_ADDRESS", "localhost").rsplit(":", 1)[0]
        options = [("grpc.ssl_target_name_override", host)]
        channel = grpc.secure_channel(target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=4
            )
        except grpc.RpcError as e:
            print(f"health {service!r}: {e.code().name}", file=sys.stderr)
            return 1
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not ok:
        print(
            f"health {service!r}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
