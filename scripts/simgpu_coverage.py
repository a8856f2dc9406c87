"""Coverage of the CUDA-only lines of src/ by the simulated-GPU tier (tests/simgpu).

    .venv/bin/python scripts/simgpu_coverage.py        # runs the tier, writes the report

Runs `pytest tests/simgpu` under coverage (the card processes included: coverage's subprocess
patch), finds the lines of src/onegpu that run only on a CUDA GPU by reading the code, and writes
benchmarks/results/simgpu-coverage.md: each such line executed, or named with why it did not run.

A line is CUDA-only when it is
- inside a branch taken only on CUDA: ``if`` on ``torch.cuda.is_available()``, ``device.type ==
  "cuda"``, ``device_type == "cuda"``, ``is_gpu``, ``on_gpu``, ``on_cuda``, ``.is_cuda``, a flag
  named ``cuda``; or after
  the negated form's early ``return``/``raise`` in the same block; or
- a call into ``torch.cuda`` (other than asking ``is_available``) or ``.cuda()``.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "onegpu"
CUDA_TEST = re.compile(
    r"torch\.cuda\.is_available\(\)"
    r'|(device_type|device|\.type|device\.type)\s*[!=]=\s*"cuda"'
    r"|\bis_gpu\b|\bon_gpu\b|\bon_cuda\b|\.is_cuda\b"
    r"|^cuda$"  # a flag named for it: cuda = device.type == "cuda"
)
NOT_CUDA = re.compile(r'\bnot\s+[\w.]*(is_available\(\)|is_gpu|on_gpu|on_cuda|is_cuda)|!=\s*"cuda"')
CUDA_CALL = re.compile(r"torch\.cuda\.(?!is_available\b)\w+|\.cuda\(\)|torch\._C\._cuda_\w+")
# Why a line cannot run on a simulated card: a real kernel with no fake implementation.
NO_FAKE = [
    (
        re.compile(r"torchao|\bao\.|tinygemm|Int4|quantization"),
        "torchao's int4 CUDA kernel (tinygemm; no fake)",
    ),
    (
        re.compile(r"bitsandbytes|bnb|compiled_with_cuda|device_map", re.IGNORECASE),
        "bitsandbytes' CUDA kernels (no fake)",
    ),
    (
        re.compile(r"flash_attn|FLASH2|flash_attention_2"),
        "the flash_attn package (CUDA only, not installed)",
    ),
    (
        re.compile(r"deepspeed|DeepSpeed|ds_config|zero", re.IGNORECASE),
        "DeepSpeed's CUDA/CPU-Adam build and launcher",
    ),
    (
        re.compile(r"compile|inductor|triton|reduce-overhead", re.IGNORECASE),
        "torch.compile's CUDA code generation (triton)",
    ),
    (
        re.compile(r"nvidia-smi|getDriverVersion|set_rng_state|get_rng_state"),
        "the real driver / CUDA RNG state",
    ),
    (
        re.compile(r"^(rollout|multiturn)$"),
        "GRPO's sampling: a fake tensor has no values to sample from",
    ),
    (
        re.compile(r"^reward_models$"),
        "the planner's bytes per reward-model weight on a GPU: a pure function of on_gpu, "
        "tested on CPU (tests/test_plan_grpo.py)",
    ),
    (
        re.compile(r"^kv_budget$"),
        "the server's KV budget on a GPU: the tier starts no server (the budget arithmetic after "
        "it is tested on CPU with a given budget)",
    ),
]


def _negated(cond: str) -> bool:
    return bool(NOT_CUDA.search(cond))


def _lines(nodes: list[ast.stmt]) -> set[int]:
    out = set()
    for n in nodes:
        out.update(range(n.lineno, (n.end_lineno or n.lineno) + 1))
    return out


def cuda_only_lines(path: Path) -> set[int]:
    text = path.read_text()
    tree = ast.parse(text)
    src = text.splitlines()
    found: set[int] = set()
    for parent in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if not isinstance(block, list):
                continue
            for i, node in enumerate(block):
                if not isinstance(node, ast.If):
                    continue
                cond = ast.get_source_segment(text, node.test) or ""
                if not CUDA_TEST.search(cond):
                    continue
                if " or " in cond:  # a CUDA test beside others: the branch is not CUDA-only
                    continue
                if _negated(cond):
                    if " and " in cond:  # "no GPU and something": neither branch is CUDA-only
                        continue
                    found |= _lines(node.orelse)
                    if node.body and isinstance(node.body[-1], (ast.Return, ast.Raise)):
                        found |= _lines(block[i + 1 :])
                else:
                    found |= _lines(node.body)
    for no, line in enumerate(src, 1):
        code = line.split("#")[0]
        if CUDA_CALL.search(code) and " if " not in code:
            found.add(no)
    # blank lines, comments and docstrings are not code
    code_lines = {
        no for no, line in enumerate(src, 1) if line.strip() and not line.strip().startswith("#")
    }
    return found & code_lines & _statement_lines(tree)


def _statement_lines(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        ):
            out.add(node.lineno)
    return out


def reason(line: str, path: Path) -> str:
    for pattern, why in NO_FAKE:
        if pattern.search(line) or pattern.search(path.stem):
            return why
    return "not reached by the tier yet"


def run_tier(data: Path) -> None:
    rc = data / "coveragerc"
    rc.write_text(
        f"[run]\nsource = {SRC}\nparallel = true\ndata_file = {data / '.coverage'}\n"
        "patch = subprocess\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), COVERAGE_RCFILE=str(rc))
    cmd = [
        sys.executable,
        "-m",
        "coverage",
        "run",
        f"--rcfile={rc}",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/simgpu",
    ]
    subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    subprocess.run(
        [sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}"],
        cwd=ROOT,
        env=env,
        check=True,
    )


def executed(data: Path) -> dict[str, set[int]]:
    import coverage

    cov = coverage.CoverageData(basename=str(data / ".coverage"))
    cov.read()
    return {str(Path(f).resolve()): set(cov.lines(f) or ()) for f in cov.measured_files()}


def report(ran: dict[str, set[int]]) -> str:
    rows_ok, rows_no = [], []
    for path in sorted(SRC.rglob("*.py")):
        if "bench" in path.parts:  # benchmark drivers: their GPU arms are run by gpu_check.sh
            continue
        src = path.read_text().splitlines()
        hit = ran.get(str(path.resolve()), set())
        rel = path.relative_to(ROOT)
        for no in sorted(cuda_only_lines(path)):
            line = src[no - 1].strip()
            (rows_ok if no in hit else rows_no).append((f"{rel}:{no}", line, reason(line, path)))
    out = [
        "# CUDA-only lines of src/ under the simulated-GPU tier",
        "",
        (
            "Regenerate: `.venv/bin/python scripts/simgpu_coverage.py` (runs `pytest tests/simgpu` "
            "under coverage, card processes included). CUDA-only: inside a branch taken only on "
            "CUDA, or a call into `torch.cuda` (see the script's docstring); `bench/` is left to "
            "`scripts/gpu_check.sh`."
        ),
        "",
        (
            f"**{len(rows_ok) + len(rows_no)} CUDA-only lines: {len(rows_ok)} executed on a "
            f"simulated card, {len(rows_no)} not** (each named with why below)."
        ),
        "",
        f"## Not executed ({len(rows_no)})",
        "",
        "| line | code | why |",
        "|---|---|---|",
    ]
    out += [f"| {where} | `{code[:90]}` | {why} |" for where, code, why in rows_no]
    out += ["", f"## Executed ({len(rows_ok)})", "", "| line | code |", "|---|---|"]
    out += [f"| {where} | `{code[:90]}` |" for where, code, _ in rows_ok]
    return "\n".join(out).replace("|`", "| `") + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "simgpu-coverage.md"))
    ap.add_argument("--data", help="reuse coverage data in this folder instead of running the tier")
    args = ap.parse_args()
    data = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="simgpu-cov-"))
    if not args.data:
        run_tier(data)
    text = report(executed(data))
    Path(args.out).write_text(text)
    print(text.splitlines()[4])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
