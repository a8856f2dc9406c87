"""Which grammar library constrains `onegpu serve`'s structured output: xgrammar, llguidance and
outlines-core side by side, on the same byte-level BPE tokenizers and the same JSON schemas.

    flock /work/.bench.lock python benchmarks/grammar_libs.py \\
        --out benchmarks/results/grammar-libs-cpu

Per library and vocabulary (512, 32k and 128k tokens, BPEs trained here on local Python source):
the tokenizer's one-time preparation, the compile of each schema (no cache: a new compiler or
index each time), and the time to fill one row's token bitmask (int32, vocab/32 words) at each
token of a valid document, with the token then accepted. Each library runs in a subprocess under
``--timeout`` seconds per vocabulary, so one that stalls on a large vocabulary is reported, not
waited for. Writes <out>.json and <out>.md (machine, load, command, versions)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBS = ("xgrammar", "llguidance", "outlines_core")
VOCABS = (512, 32000, 128000)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "items", "paid", "note"],
    "additionalProperties": False,
}
SCHEMAS = {
    "person": (PERSON, {"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"]}),
    "order": (
        ORDER,
        {
            "id": "ABC-1234",
            "items": [{"sku": "x-1", "qty": 2, "price": 9.5}, {"sku": "y", "qty": 1, "price": 3}],
            "paid": True,
            "note": None,
        },
    ),
}


def tokenizer(vocab: int):
    """A byte-level BPE of ``vocab`` tokens trained on the Python files under sys.prefix (cached
    by onegpu's tokenizer cache)."""
    sys.path.insert(0, str(ROOT / "src"))
    from onegpu.data.tokenizer import train_tokenizer

    if vocab <= 4096:
        texts = [p.read_text(errors="replace") for p in _sources(4 * 2**20)]
    else:
        texts = [p.read_text(errors="replace") for p in _sources(160 * 2**20)]
    return train_tokenizer(texts, vocab_size=vocab, fingerprint=f"grammar-libs-{len(texts)}")


def _sources(budget: int) -> list[Path]:
    out, total = [], 0
    for p in sorted(Path(sys.prefix).rglob("*.py")):
        size = p.stat().st_size
        if size > 2**20:
            continue
        out.append(p)
        total += size
        if total >= budget:
            break
    return out


# ------------------------------------------------------------------------------ one library
def run_xgrammar(tok, schema: str, ids: list[int]):
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, len(tok))

    def step(token):
        matcher.fill_next_token_bitmask(mask, 0)
        assert _allowed(mask, token), token
        assert matcher.accept_token(token), token

    fills = [_timed(step, t) for t in ids]
    return prep, compile_s, fills, torch


def run_llguidance(tok, schema: str, ids: list[int]):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    compile_s = time.perf_counter() - t0
    mask = llguidance.torch.allocate_token_bitmask(1, len(tok))

    def step(token):
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        assert _allowed(mask, token), token
        assert matcher.consume_token(token), matcher.get_error()

    fills = [_timed(step, t) for t in ids]
    return prep, compile_s, fills, None


def run_outlines_core(tok, schema: str, ids: list[int]):
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    vocab = Vocabulary(tok.eos_token_id, _byte_vocab(tok))
    prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(schema, whitespace_pattern=""), vocab)
    compile_s = time.perf_counter() - t0
    guide = Guide(index)
    mask = torch.zeros(1, (len(tok) + 31) // 32, dtype=torch.int32)

    def step(token):
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        assert _allowed(mask, token), token
        guide.advance(token)

    fills = [_timed(step, t) for t in ids]
    return prep, compile_s, fills, None


def _byte_vocab(tok) -> dict:
    """Token id -> its bytes (a byte-level BPE's characters map back to bytes), special tokens
    and the EOS left out (outlines-core adds the EOS itself)."""
    back = {c: b for b, c in _bytes_to_unicode().items()}
    out: dict = {}
    special = set(tok.all_special_ids)
    for piece, i in tok.get_vocab().items():
        if i in special:
            continue
        out.setdefault(bytes(back[c] for c in piece), []).append(i)
    return out


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character table, which byte-level BPEs spell tokens with."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _allowed(mask, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def _timed(fn, arg) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def child(lib: str, vocab: int) -> dict:
    tok = tokenizer(vocab)
    out = {"lib": lib, "vocab": len(tok), "schemas": {}}
    runner = {"xgrammar": run_xgrammar, "llguidance": run_llguidance}.get(lib, run_outlines_core)
    for name, (schema, doc) in SCHEMAS.items():
        ids = tok(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)["input_ids"]
        prep, compile_s, fills, _ = runner(tok, json.dumps(schema), ids)
        out["prep_s"] = prep
        out["schemas"][name] = {
            "compile_s": compile_s,
            "tokens": len(ids),
            "fill_median_us": statistics.median(fills) * 1e6,
            "fill_max_us": max(fills) * 1e6,
        }
    return out


# ------------------------------------------------------------------------------ the driver
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/grammar-libs-cpu")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--child", nargs=2, metavar=("LIB", "VOCAB"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    for vocab in VOCABS:  # trained once, outside the timed children
        tokenizer(vocab)
    rows, before = [], _uptime()
    for vocab in VOCABS:
        for lib in LIBS:
            rows.append(_one(lib, vocab, args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    write(Path(args.out), rows, before, _uptime(), apply_cost())


def _one(lib: str, vocab: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", lib, str(vocab)]
    env = dict(os.environ, OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"lib": lib, "vocab": vocab, "error": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        return {"lib": lib, "vocab": vocab, "error": done.stderr.strip().splitlines()[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def apply_cost(rows: int = 8, repeats: int = 21) -> list:
    """The other half of a constrained step: logit_rules.apply_token_bitmask over a batch of
    fp32 logits on this CPU (one thread), median of ``repeats`` calls, in microseconds."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from onegpu.infer.logit_rules import apply_token_bitmask

    torch.set_num_threads(1)
    out = []
    for vocab in (32000, 128000):
        logits = torch.randn(rows, vocab)
        words = (vocab + 31) // 32
        mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32)
        for label, args in (
            (f"all {rows} rows", (logits, mask)),
            (f"1 row of {rows}", (logits, mask[:1], torch.tensor([3]))),
        ):
            times = [_timed(lambda a: apply_token_bitmask(*a), args) for _ in range(repeats)]
            out.append({"rows": label, "vocab": vocab, "median_us": statistics.median(times) * 1e6})
    return out


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _versions() -> dict:
    from importlib.metadata import version

    names = ("torch", "transformers", "xgrammar", "llguidance", "outlines_core")
    return {n: version(n) for n in names}


def write(out: Path, rows: list, before: str, after: str, apply: list) -> None:
    meta = {
        "command": " ".join(sys.argv),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "versions": _versions(),
        "uptime_before": before,
        "uptime_after": after,
    }
    body = {"meta": meta, "rows": rows, "apply_token_bitmask": apply}
    out.with_suffix(".json").write_text(json.dumps(body, indent=1))
    lines = [
        "# Grammar libraries for structured output (CPU, one thread)",
        "",
        *(f"- {k}: {v}" for k, v in meta.items()),
        "",
        "| library | vocab | tokenizer prep s | schema | compile ms | fill median us "
        "| fill max us |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['lib']} | {r['vocab']} | - | - | {r['error']} | - | - |")
            continue
        for name, s in r["schemas"].items():
            lines.append(
                f"| {r['lib']} | {r['vocab']} | {r['prep_s']:.2f} | {name} | "
                f"{s['compile_s'] * 1e3:.1f} | {s['fill_median_us']:.0f} | {s['fill_max_us']:.0f} |"
            )
    lines += ["", "apply_token_bitmask (fp32 logits, CPU, one thread):", ""]
    lines += [f"- {a['rows']}, vocab {a['vocab']}: {a['median_us']:.0f} us" for a in apply]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
