"""Run in a child process by gguf.py and gguf_check.py: llama.cpp (through llama-cpp-python) on a
GGUF, so that a crash inside it (a segfault in a native kernel) fails the export's step with its
signal, not the onegpu process. Imports nothing of onegpu.

Usage: python llama_child.py SPEC_JSON OUT_NPZ
SPEC: {"op": "quantize", "src", "dst", "quant"} or
      {"op": "eval", "model", "n_ctx", "greedy": [[ids, n], ...], "forced": [ids, ...],
       "tokenize": [text, ...]}"""

from __future__ import annotations

import json
import sys

import numpy as np

FTYPES = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q5_k_m": "Q5_K_M", "q4_k_m": "Q4_K_M"}


def quantize(spec: dict) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{FTYPES[spec['quant']]}")
    rc = llama_cpp.llama_model_quantize(
        spec["src"].encode(), spec["dst"].encode(), llama_cpp.byref(params)
    )
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    return {}


def evaluate(spec: dict) -> dict:
    from llama_cpp import Llama

    llm = Llama(
        model_path=spec["model"], n_ctx=spec["n_ctx"], logits_all=True, verbose=False, seed=0
    )
    out: dict = {}
    for i, (ids, n) in enumerate(spec.get("greedy", [])):
        llm.reset()
        llm.eval(ids)
        tokens, rows = [], []
        for _ in range(n):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            rows.append(row)
            tokens.append(int(row.argmax()))
            llm.eval([tokens[-1]])
        out[f"greedy_tokens_{i}"] = np.array(tokens, dtype=np.int64)
        out[f"greedy_rows_{i}"] = np.stack(rows)
    for i, ids in enumerate(spec.get("forced", [])):
        llm.reset()
        llm.eval(ids)
        out[f"forced_{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32)
    for i, text in enumerate(spec.get("tokenize", [])):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        out[f"tokens_{i}"] = np.array(ids, dtype=np.int64)
    meta = {k: str(v) for k, v in llm.metadata.items() if not k.startswith("tokenizer.ggml.t")}
    out["metadata"] = np.array(json.dumps(meta))
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[0], encoding="utf-8").read())
    out = quantize(spec) if spec["op"] == "quantize" else evaluate(spec)
    np.savez(argv[1], **out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
