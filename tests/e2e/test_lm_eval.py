"""lm-eval through Tandem agrees with lm-eval on transformers.

A small multiple-choice task (tests/fixtures/eval_mc.jsonl, a task YAML written here) is scored
twice by lm-eval itself: by its `hf` backend on the checkpoint folder, and by its
`local-completions` backend against real gateway, decode and prefill processes serving the same
folder (loglikelihoods from completions `echo` + `logprobs` + `max_tokens=1`, the prompt's
logprobs computed by the remote prefill). Every item must pick the same answer, the accuracies
must be equal and the loglikelihoods close. The tiny random checkpoint keeps this within the
suite's time; its answers are near chance, which makes agreement a sharper check, not a weaker
one (bench/lm_eval_agreement.py runs the same comparison on SmolLM2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.cluster import deploy

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf backend imports it

FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "128"]
DATA = Path(__file__).resolve().parents[1] / "fixtures" / "eval_mc.jsonl"
TASK = "tandem_mc"


def write_task(folder: Path, data: Path = DATA) -> Path:
    """A multiple-choice task over a local JSONL ({question, choices, answer} per line)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
    )
    return folder


def evaluate(model: str, model_args: dict, task_dir: Path) -> tuple[float, dict[int, list]]:
    """(accuracy, doc id -> loglikelihood of each choice) from `lm_eval.simple_evaluate`."""
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=8,
    )
    lls = {s["doc_id"]: [ll for ll, _ in s["filtered_resps"]] for s in results["samples"][TASK]}
    return results["results"][TASK]["acc,none"], lls


def hf_and_tandem(model_path: str, base_url: str, served: str, task_dir: Path):
    hf = evaluate("hf", {"pretrained": model_path, "dtype": "float32", "device": "cpu"}, task_dir)
    api_args = {
        "model": served,
        "base_url": f"{base_url}/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": model_path,
        "num_concurrent": 1,
        "max_retries": 1,
    }
    return hf, evaluate("local-completions", api_args, task_dir)


@pytest.fixture(scope="module")
def dep(tiny_qwen3_path):
    # Every prompt prefilled on P (a busy machine could make the cost model prefill some on D):
    # the test is about the remote path returning prompt logprobs.
    d = deploy(str(tiny_qwen3_path), 1, 1, FLAGS, gateway_flags=["--prefill-policy", "remote"])
    yield d
    d.stop()


def test_local_completions_agree_with_hf(dep, tiny_qwen3_path, tmp_path):
    (hf_acc, hf_lls), (api_acc, api_lls) = hf_and_tandem(
        str(tiny_qwen3_path), dep.base_url, dep.model, write_task(tmp_path / "tasks")
    )
    assert sorted(api_lls) == sorted(hf_lls) and len(hf_lls) == 32
    for doc_id, expected in hf_lls.items():
        got = api_lls[doc_id]
        assert got.index(max(got)) == expected.index(max(expected)), doc_id
        assert got == pytest.approx(expected, abs=1e-3), doc_id
    assert api_acc == hf_acc
    # Every remote prefill returned the prompt's logprobs (none fell back to local prefill).
    (load,) = dep.loads("decode")
    assert load.num_remote_prefills >= 4 * 32 and load.num_local_prefills == 0
