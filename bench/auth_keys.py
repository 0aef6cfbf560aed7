"""What the gateway's API keys cost as their number grows: loading the key file, and the CPU of
`KeyStore.authenticate` per request (a wrong key and the last key of the file).

    python -m bench.auth_keys [--keys 1,1000,10000] [--baseline-tree /tmp/base]

`--baseline-tree` runs the same measurement on another checkout's `gateway.auth` (a
`git worktree add /tmp/base REV`), in a subprocess, for a before/after in one run.
Writes `bench/results/auth_keys-<date>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(num_keys: list[int], min_time_s: float) -> dict[str, dict[str, float]]:
    """{num_keys: {load_s, wrong_key_us, last_key_us}} for `gateway.auth` as imported here."""
    from gateway.auth import KeyStore
    from gateway.config import GatewaySettings

    results = {}
    for n in num_keys:
        keys = [f"sk-{secrets.token_hex(16)}" for _ in range(n)]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "keys"
            path.write_text("".join(f"{k}:tenant{i % 100}\n" for i, k in enumerate(keys)))
            settings = GatewaySettings(model="m", TANDEM_API_KEYS_FILE=path)
            t0 = time.perf_counter()
            store = KeyStore.from_settings(settings)
            load_s = time.perf_counter() - t0
        row = {"load_s": round(load_s, 4)}
        for name, presented in (
            ("wrong_key_us", b"sk-not-a-key"),
            ("last_key_us", keys[-1].encode()),
        ):
            assert (store.authenticate(presented) is None) == (name == "wrong_key_us")
            calls, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < min_time_s:
                for _ in range(10):
                    store.authenticate(presented)
                calls += 10
            row[name] = round(elapsed / calls * 1e6, 2)
        results[str(n)] = row
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", default="1,1000,10000")
    p.add_argument("--min-time-s", type=float, default=0.5, help="per authenticate figure")
    p.add_argument("--baseline-tree", type=Path)
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    num_keys = [int(n) for n in args.keys.split(",")]
    current = measure(num_keys, args.min_time_s)
    if args.json_only:  # the baseline's subprocess
        print(json.dumps(current))
        return
    results = {"current": current}
    if args.baseline_tree:
        # This file run by path: its directory, then the baseline, on sys.path (not this tree),
        # so `gateway` is the baseline's.
        cmd = [sys.executable, __file__, "--json-only", "--keys", args.keys]
        cmd += ["--min-time-s", str(args.min_time_s)]
        env = {**os.environ, "PYTHONPATH": str(args.baseline_tree)}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"baseline failed: {out.stderr[-2000:]}")
        results["baseline"] = json.loads(out.stdout.strip().splitlines()[-1])
    from bench.common import print_table, write_result

    config = {"keys": num_keys, "min_time_s": args.min_time_s}
    if args.baseline_tree:
        config["baseline_tree"] = str(args.baseline_tree)
    path = write_result("auth_keys", config, results)
    rows = []
    for which, figures in results.items():
        for n, row in figures.items():
            rows.append(
                (which, n, str(row["load_s"]), str(row["wrong_key_us"]), str(row["last_key_us"]))
            )
    print_table(rows, ("tree", "keys", "load s", "wrong key us", "last key us"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
