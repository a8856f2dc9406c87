#!/usr/bin/env bash
# llama-cpp-python for `onegpu export --format gguf|ollama`, built once and cached the way pip caches
# wheels: its sdist (which also vendors llama.cpp's converter) is downloaded by pip, built into a wheel
# with the pinned CMAKE_ARGS below, kept in the cache and installed from there on every later run.
#   bash scripts/build_llama_cpp.sh          (PYTHON=... picks the environment; default .venv/bin/python)
# Cache: $ONEGPU_LLAMA_CPP_DIR, else ${ONEGPU_CACHE:-~/.cache/onegpu}/llama-cpp/0.3.36.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
PY=${PYTHON:-.venv/bin/python}
ROOT=${ONEGPU_LLAMA_CPP_DIR:-${ONEGPU_CACHE:-$HOME/.cache/onegpu}/llama-cpp/$VERSION}
# Native builds (GGML_NATIVE, pip's default) crash on the first decode of a quantized GGUF on Intel
# Xeons with AVX-512 and AMX; built for AVX2 every type decodes. Kept equal to
# src/onegpu/export/llama_setup.py's CMAKE_ARGS.
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF"

if "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  echo "llama-cpp-python $VERSION: installed"
else
  wheel=$(ls "$ROOT"/wheels/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    for tool in cmake cc c++; do
      command -v "$tool" >/dev/null || {
        echo "error: building llama-cpp-python needs a C/C++ compiler and cmake; '$tool' is missing." >&2
        echo "  fix: apt-get install build-essential cmake (Debian/Ubuntu), then rerun" >&2
        exit 2
      }
    done
    mkdir -p "$ROOT/sdist" "$ROOT/wheels" "$ROOT/logs"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT/sdist"
    log="$ROOT/logs/build.log"
    echo "building llama-cpp-python $VERSION from source, once (20-30 min on 2 busy cores); log: $log"
    start=$(date +%s)
    CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      "$PY" -m pip wheel --no-deps -w "$ROOT/wheels.partial" "$ROOT/sdist/llama_cpp_python-$VERSION.tar.gz" \
      >"$log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
      sleep 60
      kill -0 "$pid" 2>/dev/null && echo "  still building llama-cpp-python ($(( $(date +%s) - start ))s)"
    done
    wait "$pid" || { echo "error: the build failed; the end of $log:" >&2; tail -n 20 "$log" >&2; exit 1; }
    mv "$ROOT"/wheels.partial/*.whl "$ROOT/wheels/" && rmdir "$ROOT/wheels.partial"
    echo "built in $(( $(date +%s) - start ))s"
    wheel=$(ls "$ROOT"/wheels/llama_cpp_python-"$VERSION"-*.whl | head -n1)
  fi
  echo "installing $wheel"
  "$PY" -m pip install -q "$wheel"
fi
# the converter comes from the same sdist, unpacked beside the wheel
ONEGPU_LLAMA_CPP_DIR="$ROOT" PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -c "from onegpu.export.llama_setup import converter_dir; print('converter:', converter_dir())"
