#!/usr/bin/env bash
# scripts/gpu_check.sh [STEP ...] - the GPU tier, then the quick benchmark presets, on a CUDA machine.
#
# Steps, in this order (default: all of them):
#   versions  GPU, compiler and library versions                          -> versions.txt
#   dry       every benchmark preset's dry run (arms, skips, estimates)     -> dry.log
#   tests     pytest -m gpu tests/gpu but the offload and engine tests     -> tests.log, tests.xml
#   offload   pytest -m gpu tests/gpu/test_gpu_offload.py                   -> offload.log, offload.xml
#   engine    pytest -m gpu tests/gpu/test_gpu_engine.py: the decode engine as CUDA graphs -> engine.log
#   infer     the generation engine's presets: onegpu bench infer --preset gpu -> infer.log, its results
#             ($INFER_ARGS, if set, is appended: e.g. "--settings engine+bf16+compile --repeats 3")
#   infer-quant  torchao int8/int4 under the compiled engine: bench infer --preset gpu-quant -> infer-quant.log
#   paged     the paged engine on the card: a decode step's attention over the pool three ways and
#             over a contiguous cache (benchmarks/paged_attention_ab.py), then the compiled engine at
#             the 1b and an 8B shape, bf16, batch 1 and 8, each policy row on and off, and int8
#             weight-only (benchmarks/engine_gpu_shapes.py) -> paged.log, paged-attention-cuda.*,
#             engine-gpu-shapes.json
#   infer-hf  onegpu bench infer --preset hf-gpu, reduced              -> infer-hf.log, infer-cuda-*.{json,md,png}
#   quick     benchmarks/bench_train.py gpu-quick                           -> quick.log, train-gpu-quick-*
#   best      benchmarks/bench_train.py gpu-best                            -> best.log, train-gpu-best-*
#   dpo       benchmarks/bench_train.py gpu-dpo (DPO vs TRL's DPOTrainer)   -> dpo.log, train-gpu-dpo-*
#   grpo      benchmarks/bench_train.py gpu-grpo (GRPO vs TRL's GRPOTrainer) -> grpo.log, train-gpu-grpo-*
#   fp8       FP8 training: bench_train.py gpu-fp8 (the 1b preset, bf16 compiled vs FP8 compiled vs
#             HF Trainer tuned)                                             -> fp8.log, train-gpu-fp8-*
#   fp8-3b    the same on Llama-3.2-3B's shape (bench_train.py gpu-fp8-3b)  -> fp8-3b.log, train-gpu-fp8-3b-*
#   simpeak   scripts/simgpu_vs_real.py: simulated peak vs real max_memory_allocated -> simpeak.log
# Every step runs under its own `timeout` (TIMEOUT_<STEP> seconds overrides it), so one hang does not
# eat the session; the steps after a failed or timed-out one still run. Every step's limit, with the
# 20 s `timeout` grants after it for the kill, stays under 600 s (tests/test_gpu_ready.py checks it).
# One 10-minute command on the GPU machine holds "versions dry tests", "offload infer-hf", "engine",
# "infer", "infer-quant", "paged", "quick", "best", "dpo", "grpo", "fp8" or "fp8-3b" (see
# benchmarks/README.md).
#
# Everything goes into one folder: $GPU_CHECK_DIR, else $OUT, else ./gpu-check-<date>. summary.txt
# there lists each step: PASS, FAIL (exit code), TIMEOUT or SKIP, its seconds and its log.
#
# Needs no venv and no network: python is $PYTHON, else python3; src/ is put on PYTHONPATH (the GPU
# machine's wheels are expected in /tmp/site via the runbook's prefix). Without a CUDA GPU the
# benchmark steps are skipped (GPU_CHECK_FORCE=1 runs them anyway); the tests then skip themselves.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
DIR=${GPU_CHECK_DIR:-${OUT:-$ROOT/gpu-check-$(date +%Y%m%d-%H%M)}}
mkdir -p "$DIR" || exit 2
DIR=$(cd "$DIR" && pwd)
SUMMARY=$DIR/summary.txt

export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false} PYTHONUNBUFFERED=1 MPLBACKEND=${MPLBACKEND:-Agg}
# The saved 1B model is written once here and reused by every preset (never into $OUT: 4 GB).
export ONEGPU_BENCH_WORKDIR=${ONEGPU_BENCH_WORKDIR:-/tmp/onegpu-bench-work}

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  CUDA=1
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}  # DeepSpeed's CUDA ops for the offload tests and arms
else
  CUDA=0
fi

PYTEST=("$PY" -m pytest -m gpu -rA --durations=0 --timeout 200 -p no:cacheprovider)
ALL=(versions dry tests offload engine infer infer-quant paged infer-hf quick best dpo grpo fp8 fp8-3b simpeak)
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=("${ALL[@]}")

default_timeout() {
  case $1 in
    versions) echo 30 ;; dry) echo 60 ;; tests) echo 450 ;; offload) echo 300 ;; engine) echo 240 ;; infer|infer-quant|paged) echo 540 ;;
    infer-hf) echo 240 ;; quick|best|dpo|grpo|fp8|fp8-3b) echo 560 ;; simpeak) echo 240 ;; *) echo 300 ;;
  esac
}

versions() {
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
  g++ --version 2>&1 | head -1 || echo "g++: not available"
  "$PY" - <<'PYEOF'
import importlib.metadata as md, platform
print("python", platform.python_version())
for pkg in ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "bitsandbytes", "torchao",
            "deepspeed", "jsonargparse", "pyarrow", "pytest", "pytest-timeout"):
    try:
        print(pkg, md.version(pkg))
    except md.PackageNotFoundError:
        print(pkg, "MISSING")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"capability {p.major}.{p.minor}")
PYEOF
}

step_cmd() {
  case $1 in
    versions) versions > "$DIR/versions.txt" 2>&1; local rc=$?; cat "$DIR/versions.txt"; return $rc ;;
    dry) "$PY" benchmarks/bench_train.py cpu headline cpu-dpo cpu-grpo gpu gpu-grpo gpu-fp8 gpu-fp8-3b --dry-run \
           && "$PY" -m onegpu.cli.main bench infer --preset hf-gpu --dry_run true ;;
    tests) "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_gpu_offload.py \
             --ignore=tests/gpu/test_gpu_engine.py --junitxml="$DIR/tests.xml" ;;
    engine) "${PYTEST[@]}" tests/gpu/test_gpu_engine.py ;;
    # DeepSpeed builds its CPU Adam the first time (a minute or two): a longer per-test limit
    offload) "${PYTEST[@]}" --timeout 280 tests/gpu/test_gpu_offload.py --junitxml="$DIR/offload.xml" ;;
    # ---- the generation engine's presets (src/onegpu/infer/): `onegpu bench infer --preset gpu`
    # (and gpu-quant) pick the settings, lengths and repeats for a card
    # shellcheck disable=SC2086  # INFER_ARGS is a list of flags
    infer) "$PY" -m onegpu.cli.main bench infer --preset gpu --out "$DIR" ${INFER_ARGS:-} ;;
    infer-quant) "$PY" -m onegpu.cli.main bench infer --preset gpu-quant --out "$DIR" \
                   --name "infer-quant-cuda-$(date +%Y%m%d)" ;;
    paged) "$PY" benchmarks/paged_attention_ab.py --device cuda --dtype bf16 \
             --out "$DIR/paged-attention-cuda" && "$PY" benchmarks/engine_gpu_shapes.py --out "$DIR" ;;
    # ---- HF generate's settings, reduced: one per family (dtype, bitsandbytes, torchao, static
    # cache + compile), 2 repeats
    infer-hf) "$PY" -m onegpu.cli.main bench infer --preset hf-gpu --out "$DIR" \
             --settings fp32,bf16,int8,nf4,ao-int8,bf16+static-compile --repeats 2 --new_tokens 32 ;;
    quick) "$PY" benchmarks/bench_train.py gpu-quick --bench.out "$DIR" ;;
    best) "$PY" benchmarks/bench_train.py gpu-best --bench.out "$DIR" ;;
    dpo) "$PY" benchmarks/bench_train.py gpu-dpo --bench.out "$DIR" ;;
    # GRPO vs TRL's GRPOTrainer; trains the default job's model first on a fresh machine (~1.5 min)
    grpo) "$PY" benchmarks/bench_train.py gpu-grpo --bench.out "$DIR" ;;
    # FP8: bf16 compiled against FP8 compiled (and HF Trainer tuned at 1b), interleaved
    fp8) "$PY" benchmarks/bench_train.py gpu-fp8 --bench.out "$DIR" ;;
    fp8-3b) "$PY" benchmarks/bench_train.py gpu-fp8-3b --bench.out "$DIR" ;;
    # the simulated tier's memory (fake tensors, MemTracker) against the card's allocator
    simpeak) "$PY" scripts/simgpu_vs_real.py ;;
    *) echo "unknown step '$1'; steps: ${ALL[*]}"; return 2 ;;
  esac
}

needs_gpu() { case $1 in infer|infer-quant|paged|infer-hf|quick|best|dpo|grpo|fp8|fp8-3b|simpeak) return 0 ;; *) return 1 ;; esac; }

failed=0
echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname); steps: ${STEPS[*]}; cuda=$CUDA" >> "$SUMMARY"
for step in "${STEPS[@]}"; do
  log=$DIR/$step.log
  if needs_gpu "$step" && [ "$CUDA" = 0 ] && [ "${GPU_CHECK_FORCE:-0}" != 1 ]; then
    printf '%-8s %-9s %6ss  %s\n' SKIP "$step" 0 "no CUDA GPU (GPU_CHECK_FORCE=1 runs it)" | tee -a "$SUMMARY"
    continue
  fi
  var=TIMEOUT_$(echo "$step" | tr '[:lower:]-' '[:upper:]_')  # infer-hf: TIMEOUT_INFER_HF
  limit=${!var:-$(default_timeout "$step")}
  echo "== $step (timeout ${limit}s) -> $log"
  start=$(date +%s)
  # The step runs in a child shell under `timeout`, so a hang is killed (TERM, then KILL 20 s later).
  timeout --kill-after=20 "$limit" bash -c "$(declare -f versions step_cmd); $(declare -p PY DIR PYTEST ALL); step_cmd $step" \
    > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  tail -n 25 "$log"
  if [ $rc -eq 0 ]; then status=PASS
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=TIMEOUT; failed=1
  else status="FAIL($rc)"; failed=1
  fi
  printf '%-8s %-9s %6ss  %s\n' "$status" "$step" "$secs" "$log" | tee -a "$SUMMARY"
done
echo "summary: $SUMMARY"
exit $failed
