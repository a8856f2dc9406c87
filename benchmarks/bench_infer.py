"""Produce benchmarks/results/infer-<device>-<date>.{json,md,png} with `onegpu bench infer`.

    python benchmarks/bench_infer.py  # CPU: small random-init Llama, a few minutes
    python benchmarks/bench_infer.py --preset 1b --device cuda  # GPU: ~1B Llama, bf16 and friends
    python benchmarks/bench_infer.py --preset 1b --device cuda --dry-run  # list the settings only

Extra arguments after ``--`` go to `onegpu bench infer` unchanged (e.g. ``-- --repeats 5``).
The models are random-init Llamas built from onegpu's presets: speed and memory do not depend on
the weights' values, and no download is needed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# Per device: which settings are worth measuring, and a workload that takes minutes, not hours.
PROFILES = {
    "cpu": dict(
        settings="fp32,bf16,int8,nf4,ao-int8,ao-int8-dynamic,static-compile",
        batch_size=4,
        prompt_len=64,
        new_tokens=32,
        repeats=3,
        vocab_size=32000,
    ),
    "cuda": dict(
        settings="fp32,bf16,fp16,int8,nf4,fp4,ao-int8,ao-int8-dynamic,bf16+ao-int4,"
        "bf16+static-compile,bf16+eager",
        batch_size=8,
        prompt_len=512,
        new_tokens=128,
        repeats=5,
        vocab_size=128256,
    ),
}


def main(argv: list[str]) -> int:
    own, _, passthrough = _split(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default="small", help="tiny, small, 125m or 1b (default: small)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the options and list the settings; no model is built or measured",
    )
    args = parser.parse_args(own)
    profile = PROFILES[args.device]
    bench_argv = [
        "infer",
        "--model",
        args.preset,
        "--device",
        args.device,
        "--out",
        args.out,
        "--name",
        f"infer-{args.device}-{time.strftime('%Y%m%d')}",
    ]
    for key, value in profile.items():
        bench_argv += [f"--{key}", str(value)]
    from onegpu.cli.bench import cli
    from onegpu.cli.main import run_command

    if args.dry_run:  # after the profile, so that extra arguments still override it
        passthrough = passthrough + ["--dry_run", "true"]
    code = run_command(lambda: cli(bench_argv + passthrough))
    if code == 0 and not args.dry_run:
        record_command(Path(args.out) / bench_argv[bench_argv.index("--name") + 1], argv)
    return code


def record_command(stem: Path, argv: list[str]) -> None:
    """Name this script as the way to reproduce the result, next to the equivalent onegpu
    command."""
    import json

    from onegpu.bench.infer_report import to_markdown

    path = stem.with_suffix(".json")
    result = json.loads(path.read_text())
    script = " ".join(["python benchmarks/bench_infer.py", *argv]).strip()
    if not result["command"].startswith("python "):
        result["command"] = f"{script}   (runs: {result['command']})"
    path.write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(to_markdown(result))


def _split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], "--", argv[i + 1 :]
    return argv, "", []


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
