"""`onegpu serve` under guidellm (vLLM's load generator, 0.8.1) at its defaults: chat completions,
streamed, with ``stream_options: {include_usage, continuous_usage_stats}``, so the figures read as
vLLM's do (TTFT, inter-token latency, output tokens/s, errors).

    flock /work/.bench.lock python benchmarks/serve_guidellm.py \\
        --out benchmarks/results/serve-guidellm-cpu
    python benchmarks/serve_guidellm.py --model /models/Llama-3.1-8B --prompt_tokens 512 \\
        --output_tokens 256 --streams 32 --requests 256 --out serve-guidellm-gpu   # a GPU card

Without ``--model`` it serves serve_load.py's tiny preset (random weights, fp32). The server runs
on 127.0.0.1 and a free port; guidellm reads the prompts' token counts with the model folder's own
tokenizer (no network). Two profiles, one after the other: synchronous (one request at a time) and
concurrent (``--streams`` at once), each bounded by ``--requests`` requests and ``--max_seconds``.
Writes <out>.json and <out>.md with the command, commit, versions, machine and load."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from serve_load import free_port, make_model, stop_server  # noqa: E402 - the script's own folder

from onegpu.bench import provenance  # noqa: E402


def start(model: Path, port: int, server_args: list, log: Path) -> subprocess.Popen:
    import httpx

    argv = [sys.executable, "-m", "onegpu", "serve", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), *server_args]
    # one torch thread unless told: on a shared 2-core machine small decode ops split over two
    # threads run slower (benchmarks/results/grpo-rollouts-cpu.md); a GPU server is not affected
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    sys.exit(f"the server did not start:\n{log.read_text(errors='replace')[-3000:]}")


def guidellm(model: Path, port: int, profile: str, args, out: Path) -> dict:
    """One guidellm run; its JSON report's first benchmark."""
    prof = f"kind={profile}" + (f",streams={args.streams}" if profile == "concurrent" else "")
    cmd = [
        str(Path(sys.executable).with_name("guidellm")),
        "run",
        "--backend",
        f"kind=openai_http,target=http://127.0.0.1:{port},model={model}",
        "--profile",
        prof,
        "--constraint",
        f"kind=max_requests,count={args.requests}",
        "--constraint",
        f"kind=max_duration,seconds={args.max_seconds}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--tokenizer",
        f"kind=huggingface_auto,model={model}",
        "--output",
        f"kind=json,path={out}",
        "--disable-progress",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=args.max_seconds + 300
    )
    if done.returncode != 0:
        sys.exit(
            f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return summarize(json.loads(out.read_text())["benchmarks"][0], profile)


def summarize(bench: dict, profile: str) -> dict:
    m = bench["metrics"]

    def stat(name: str) -> dict:
        s = m[name]["successful"]
        pct = s.get("percentiles") or {}
        return {"median": s["median"], "p99": pct.get("p99"), "mean": s["mean"]}

    return {
        "profile": profile,
        "requests": m["request_totals"],
        "duration_s": bench["duration"],
        "ttft_ms": stat("time_to_first_token_ms"),
        "itl_ms": stat("inter_token_latency_ms"),
        "request_latency_s": stat("request_latency"),
        "output_tokens_per_s": m["output_tokens_per_second"]["successful"]["mean"],
        "concurrency_median": m["request_concurrency"]["successful"]["median"],
    }


def write(out: Path, rows: list, meta: dict) -> None:
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "profiles": rows}, indent=1))
    lines = ["# `onegpu serve` under guidellm 0.8.1 at its defaults", "", provenance.markdown(meta)]
    skip = ("command", "commit", "date", "machine", "uptime_before", "uptime_after")
    lines += [f"- {k}: {v}" for k, v in meta.items() if k not in skip] + [""]
    lines += [
        "| profile | requests ok / errored / incomplete | TTFT median ms | TTFT p99 ms "
        "| ITL median ms | ITL p99 ms | output tokens/s | concurrency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["requests"]
        lines.append(
            f"| {r['profile']} | {t['successful']} / {t['errored']} / {t['incomplete']} "
            f"| {r['ttft_ms']['median']:.1f} | {r['ttft_ms']['p99']:.1f} "
            f"| {r['itl_ms']['median']:.2f} | {r['itl_ms']['p99']:.2f} "
            f"| {r['output_tokens_per_s']:.0f} | {r['concurrency_median']:.0f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def meta(args, head: dict) -> dict:
    from importlib.metadata import version

    return {
        **provenance.end(head),
        "model": str(args.model or "serve_load.py's tiny preset (random weights, fp32)"),
        "server_args": " ".join(args.server_args),
        "versions": {n: version(n) for n in ("torch", "transformers", "guidellm")},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a local model folder (default: the tiny preset)")
    ap.add_argument("--prompt_tokens", type=int, default=128)
    ap.add_argument("--output_tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8, help="the concurrent profile's streams")
    ap.add_argument("--requests", type=int, default=64, help="requests per profile at most")
    ap.add_argument("--max_seconds", type=int, default=300, help="seconds per profile at most")
    ap.add_argument("--server_args", nargs="*", default=["--max_len", "1024"])
    ap.add_argument("--out", default="benchmarks/results/serve-guidellm-cpu")
    args = ap.parse_args()
    head = provenance.begin()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "tiny"
            make_model(model)
        port = free_port()
        proc = start(model, port, args.server_args, Path(tmp) / "server.log")
        try:
            rows = [
                guidellm(model, port, p, args, Path(tmp) / f"{p}.json")
                for p in ("synchronous", "concurrent")
            ]
        finally:
            exit_code = stop_server(proc)
    info = {**meta(args, head), "server_exit_code": exit_code}
    write(ROOT / args.out, rows, info)
    print((ROOT / args.out).with_suffix(".md").read_text())
    return 0 if all(r["requests"]["errored"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
