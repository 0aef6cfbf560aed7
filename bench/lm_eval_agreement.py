"""lm-eval on Tandem vs lm-eval on transformers, with real weights (SmolLM2-135M-Instruct, CPU).

The comparison of tests/e2e/test_lm_eval.py (which runs it on the tiny random checkpoint to stay
within the suite's time): the 32-item multiple-choice task of tests/fixtures/eval_mc.jsonl,
scored by lm-eval's `hf` backend on the model folder (fp32) and by its `local-completions`
backend against a gateway + decode (+ prefill with `--num-prefill 1`, the default) serving the
same folder. Records both accuracies, how many items pick the same answer, and the largest
loglikelihood difference.

Run from the repo root: `python -m bench.lm_eval_agreement [--model PATH] [--num-prefill 0|1]`.
Writes `bench/results/lm_eval_agreement-<YYYY-MM-DD>.json`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import ensure_internal_token, print_table, write_result  # noqa: E402
from engine.weights import SMOLLM2_REPO_ID, resolve_model_path  # noqa: E402
from tests.e2e.cluster import deploy  # noqa: E402
from tests.e2e.test_lm_eval import hf_and_tandem, write_task  # noqa: E402

FLAGS = ["--max-model-len", "512", "--num-gpu-blocks-override", "256"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=SMOLLM2_REPO_ID)
    parser.add_argument("--num-prefill", type=int, default=1, choices=[0, 1])
    args = parser.parse_args()
    ensure_internal_token()
    path = str(resolve_model_path(args.model))
    start = time.monotonic()
    dep = deploy(path, args.num_prefill, 1, FLAGS)
    deploy_s = time.monotonic() - start
    try:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            (hf_acc, hf_lls), (api_acc, api_lls) = hf_and_tandem(
                path, dep.base_url, dep.model, write_task(Path(tmp))
            )
            eval_s = time.monotonic() - start
        (load,) = dep.loads("decode")
    finally:
        dep.stop()
    same = sum(
        api_lls[d].index(max(api_lls[d])) == lls.index(max(lls)) for d, lls in hf_lls.items()
    )
    max_diff = max(abs(a - b) for d, lls in hf_lls.items() for a, b in zip(api_lls[d], lls))
    results = {
        "num_items": len(hf_lls),
        "hf_acc": hf_acc,
        "tandem_acc": api_acc,
        "num_same_answer": same,
        "max_abs_loglikelihood_diff": max_diff,
        "num_remote_prefills": load.num_remote_prefills,
        "num_local_prefills": load.num_local_prefills,
        "deploy_s": deploy_s,
        "eval_s": eval_s,
    }
    config = {"model": args.model, "num_prefill": args.num_prefill, "engine_flags": FLAGS}
    out = write_result("lm_eval_agreement", config, results)
    print_table(
        [(k, f"{v:.3g}" if isinstance(v, float) else str(v)) for k, v in results.items()],
        ("figure", "value"),
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
