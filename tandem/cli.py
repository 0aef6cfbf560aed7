"""`tandem` command line: one subcommand per role, plus `serve` for all of them on one machine.

tandem serve [MODEL] [--num-prefill N] [--num-decode M] [engine flags]
tandem prefill [MODEL] [--port P] [engine flags]
tandem decode  [MODEL] [--port P] [engine flags]
tandem gateway --model MODEL --decode host:port,... [--prefill host:port,...]
tandem generate [MODEL] --prompt TEXT      (offline, no services)
tandem bench serve --model MODEL [--base-url URL] [vLLM's `bench serve` flags]
                                           (load any OpenAI-compatible server; --help)

prefill, decode and gateway authenticate each other with the token in the file named by
TANDEM_INTERNAL_TOKEN_FILE (or in TANDEM_INTERNAL_TOKEN) and refuse to start without one, unless
--insecure-internal (a trusted single host); `serve` makes one per launch. Optional mTLS:
TANDEM_INTERNAL_TLS_CERT / _KEY / _CA. KV transfers: --kv-interface IFACE (TANDEM_KV_INTERFACE).
"""

from __future__ import annotations

import sys

from engine.lifeline import die_with_parent


def _generate(argv: list[str]) -> int:
    import argparse

    from engine import LLM, SamplingParams

    parser = argparse.ArgumentParser(
        "tandem generate",
        description="One chat turn on the offline engine (no services, no gateway).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model",
        nargs="?",
        default="HuggingFaceTB/SmolLM2-135M-Instruct",
        help="local Hugging Face folder or hub id",
    )
    parser.add_argument(
        "--prompt", required=True, help="the user message (the chat template applies)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--max-model-len", type=int, default=2048, help="context length")
    args = parser.parse_args(argv)
    try:
        llm = LLM(args.model, max_model_len=args.max_model_len)
    except (OSError, ValueError) as e:  # a bad path or length: one line, as `tandem serve`
        print(f"tandem generate: {e}", file=sys.stderr)
        return 1
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    print(out.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # started by `tandem serve` (engine/lifeline.py): end with it
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from tandem.launcher import serve_main

        return serve_main(rest)
    if cmd == "prefill":
        from prefill_svc.server import main as prefill_main

        prefill_main(rest)
        return 0
    if cmd == "decode":
        from decode_svc.server import main as decode_main

        decode_main(rest)
        return 0
    if cmd == "gateway":
        from gateway.__main__ import main as gateway_main

        gateway_main(rest)
        return 0
    if cmd == "generate":
        return _generate(rest)
    if cmd == "bench":
        from tandem.benchmark.serve import bench_main

        return bench_main(rest)
    print(f"unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
