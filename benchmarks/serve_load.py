"""Load test of `onegpu serve` on loopback: many concurrent clients against one server.

    python benchmarks/serve_load.py --clients 16 --requests 64

The `tiny` preset (random weights, fp32, a byte-level BPE of 4096 trained on the standard library)
is saved to a temporary folder and served by a `onegpu serve` subprocess on 127.0.0.1. The workload
mixes short and long prompts, short and long answers, completions and chat, streamed and not; all
greedy, so every answer has one right value. A round is two phases: the first sends each request
alone, one after the other (the single-request answers, latencies, and the sequential tokens/s); the
second sends the same requests from ``--clients`` threads at once. ``--rounds`` rounds run one after
the other (the phases interleaved), so a slow spell of a shared machine touches both. Checks: no
errors, every request answered once in every phase, every answer equal (text, finish reason, token
count) to its answer alone in the first round. Reports, per phase, the median over rounds (and the
range) of p50/p99 time to first token and end-to-end latency and of output tokens/s, and the
targets on the ratios of each round's pair. Bounded: ``--requests``
requests a phase, ``--time_limit`` seconds in all (each call times out); it stops by itself.
Writes <out>.json and <out>.md with the machine, load, command and date."""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

from serve_load_report import report, write  # noqa: E402 - the script's own folder

from onegpu.bench import provenance  # noqa: E402


@dataclass(frozen=True)
class Job:
    index: int
    prompt: str
    max_tokens: int
    chat: bool
    stream: bool


@dataclass
class Answer:
    index: int
    text: str = ""
    finish: str = ""
    tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    error: str = ""
    events: int = 0  # streamed: the events that carried text
    gaps: list = field(default_factory=list)  # streamed: seconds between those events
    last: float = 0.0  # streamed: when the last of them came (seconds from the start)


@dataclass
class Phase:
    answers: dict = field(default_factory=dict)
    wall: float = 0.0


def make_model(folder: Path, preset: str = "tiny") -> None:
    """A preset's shape (``tiny``, ``125m``) with random weights, and its
    tokenizer, saved where the server loads it."""
    import torch
    from transformers import LlamaForCausalLM

    from onegpu.data.tokenizer import train_tokenizer
    from onegpu.models import preset_config

    tok = train_tokenizer(stdlib_texts(), 4096, "serve-load-bench-stdlib-300")
    torch.manual_seed(0)
    LlamaForCausalLM(preset_config(preset, tok)).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))


def stdlib_texts(max_files: int = 300) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:max_files]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def make_jobs(n: int) -> list[Job]:
    """Mixed: prompts of ~10 to ~400 characters, answers of 16 to 128 tokens, every fourth a chat,
    every other streamed (a fixed pattern: the same workload each run)."""
    texts = [t for t in stdlib_texts() if len(t) > 2000]
    prompt_chars = (40, 400, 120, 800, 60, 1200)
    answer_tokens = (16, 128, 32, 96, 64, 24, 112)
    jobs = []
    for i in range(n):
        text = texts[(i * 37) % len(texts)]
        start = (i * 211) % 1000
        prompt = text[start : start + prompt_chars[i % len(prompt_chars)]]
        jobs.append(Job(i, prompt, answer_tokens[i % len(answer_tokens)], i % 4 == 3, i % 2 == 0))
    return jobs


def call(client, job: Job, deadline: float) -> Answer:
    """One request; text, finish reason and usage as the client sees them, and its timings."""
    timeout = max(1.0, deadline - time.monotonic())
    kw = dict(model="tiny", max_tokens=job.max_tokens, temperature=0, timeout=timeout)
    messages = [{"role": "user", "content": job.prompt}]
    start = time.perf_counter()
    answer = Answer(job.index)
    try:
        if job.stream:
            kw["stream_options"] = {"include_usage": True}
            if job.chat:
                chunks = client.chat.completions.create(messages=messages, stream=True, **kw)
            else:
                chunks = client.completions.create(prompt=job.prompt, stream=True, **kw)
            for chunk in chunks:
                _take_chunk(answer, chunk, job.chat, start)
        else:
            if job.chat:
                reply = client.chat.completions.create(messages=messages, **kw)
                answer.text = reply.choices[0].message.content
            else:
                reply = client.completions.create(prompt=job.prompt, **kw)
                answer.text = reply.choices[0].text
            answer.finish = reply.choices[0].finish_reason
            answer.tokens = reply.usage.completion_tokens
            answer.ttft = time.perf_counter() - start  # the whole answer is its first token
    except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
        answer.error = f"{type(exc).__name__}: {exc}"[:300]
    answer.latency = time.perf_counter() - start
    return answer


def _take_chunk(answer: Answer, chunk, chat: bool, start: float) -> None:
    if chunk.usage is not None:
        answer.tokens = chunk.usage.completion_tokens
    if not chunk.choices:
        return
    choice = chunk.choices[0]
    piece = (choice.delta.content or "") if chat else choice.text
    if piece:
        now = time.perf_counter() - start
        if answer.events:
            answer.gaps.append(now - answer.last)
        answer.ttft = answer.ttft or now
        answer.last, answer.events = now, answer.events + 1
    answer.text += piece
    answer.finish = choice.finish_reason or answer.finish


def run_phase(client, jobs: list[Job], clients: int, deadline: float) -> Phase:
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    phase, lock = Phase(), threading.Lock()

    def worker():
        while time.monotonic() < deadline:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            answer = call(client, job, deadline)
            with lock:
                if job.index in phase.answers:  # would be a duplicate: keep both visible
                    answer.error = answer.error or "answered twice"
                phase.answers[job.index] = answer

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 5)
    phase.wall = time.perf_counter() - start
    return phase


def engine_alone(model_dir: Path, jobs: list[Job], slots: int, threads: int) -> float:
    """Tokens/s of the decode engine called in this process on the same requests (all submitted at
    once, no HTTP): the ceiling the server's figures are measured against."""
    import torch

    from onegpu.infer import InferConfig, load
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.requests import SamplingParams

    torch.set_num_threads(threads)
    loaded = load(InferConfig(model=str(model_dir)))
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_slots=slots, max_len=1024))
    tok = loaded.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": j.prompt}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        if j.chat
        else tok(j.prompt)["input_ids"]
        for j in jobs
    ]
    params = [SamplingParams(max_new_tokens=j.max_tokens) for j in jobs]
    engine.generate(prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in engine.generate(prompts, params))
    return tokens / (time.perf_counter() - start)


# ------------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    command: str, model: Path, port: int, args, log: Path, src: Path = ROOT / "src"
) -> subprocess.Popen:
    """``src``: the source tree the server runs (another checkout's, for an A/B of two commits)."""
    argv = shlex.split(command) + ["--model", str(model), "--served_name", "tiny"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--max_slots", str(args.clients)]
    argv += [
        "--queue_size",
        str(args.requests),
        "--max_len",
        "1024",
        *shlex.split(args.server_args),
    ]
    # torch's intra-op threads for the server: on a shared 2-core machine a decode step's small ops
    # split over 2 threads run many times slower than on 1 (benchmarks/results/grpo-rollouts-cpu.md)
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(args.server_threads))
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    sys.exit(f"the server did not start:\n{log.read_text(errors='replace')[-3000:]}")


COUNTERS = ("onegpu_prefix_cache_queries", "onegpu_prefix_cache_hits", "onegpu_num_preemptions")


def server_counters(port: int) -> dict:
    """The engine's counters in the server's /metrics after the rounds (warm-up included): prompt
    tokens looked up in the prefix cache and found there, sequences preempted. A server without
    them (the slot engine's) gives an empty dict."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.removesuffix("_total") in COUNTERS:
            found[name.removesuffix("_total")] = float(value)
    return found


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the two phases, interleaved")
    ap.add_argument("--time_limit", type=float, default=900, help="seconds for all rounds")
    ap.add_argument("--out", default="benchmarks/results/serve-load-cpu")
    ap.add_argument("--server", default=f"{sys.executable} -m onegpu serve", help="command")
    ap.add_argument("--server_args", default="", help="more flags for the server")
    ap.add_argument("--server_threads", type=int, default=1, help="the server's torch threads")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    from openai import OpenAI

    head = provenance.begin()
    jobs = make_jobs(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp) / "tiny")
        port = free_port()
        proc = start_server(args.server, Path(tmp) / "tiny", port, args, Path(tmp) / "server.log")
        said = (Path(tmp) / "server.log").read_text(errors="replace").splitlines()
        caching = "prefix caching: "
        prefills = next((line for line in said if line.startswith(caching)), caching + "?")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        deadline = time.monotonic() + args.time_limit
        rounds = []
        try:
            run_phase(client, jobs[:2], 2, deadline)  # warm-up: first-call costs out of the figures
            for _ in range(args.rounds):  # interleaved: each round one phase of each
                single = run_phase(client, jobs, 1, deadline)
                together = run_phase(client, jobs, args.clients, deadline)
                rounds.append((single, together))
            counters = server_counters(port)
        finally:
            exit_code = stop_server(proc)
        ceiling = {
            f"{n}_slots": engine_alone(Path(tmp) / "tiny", jobs, n, args.server_threads)
            for n in (args.clients, 1)
        }
    result = report(args, jobs, rounds, head, exit_code)
    result["server_prefix_caching"] = prefills.removeprefix(caching)
    result["engine_alone_tokens_per_s"] = ceiling
    result["server_counters"] = counters
    write(ROOT / args.out, result)
    print((ROOT / args.out).with_suffix(".md").read_text())
    ok = result["check"]
    return 0 if not (ok["n_errors"] or ok["lost"] or ok["differ"]) else 1


if __name__ == "__main__":
    sys.exit(main())
