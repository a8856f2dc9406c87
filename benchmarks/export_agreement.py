"""The GGUF check's per-quant thresholds, measured: for each model, llama.cpp's quantizer makes
each type and the check's two figures are taken against onegpu's engine on the source:
teacher-forced top-1 agreement over the check's prompts' 64-token continuations, and the
perplexity ratio on the held-out text.

Models: ``--train SHAPES`` trains each preset a short run of the default job (the standard
library's code, the job's own tokenizer) and measures its final model with the prompts the export's
check takes from that run (its validation records); ``--trained DIRS`` measures model folders
already trained; ``--shapes`` random-weight Llamas at initializer_range 0.1 as the test zoo's
(the worst case: flat, chaotic logits), one per ``--seeds``. Prints a Markdown table; ``--out``
also writes a results file (.md and .json) with the provenance header.

    PYTHONPATH=src python benchmarks/export_agreement.py --train tiny wide --steps 150 \
        --shapes --out benchmarks/results/export-gguf-agreement-trained
    PYTHONPATH=src python benchmarks/export_agreement.py [--shapes tiny small] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

QUANTS = ("q8_0", "q6_k", "q5_k_m", "q4_k_m")
MAX_BYTES = 1_500_000  # of the standard library read for the trained runs


def measure(shape: str, seed: int, tokenizer, work: Path) -> dict[str, dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from onegpu.models import PRESETS

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **PRESETS[shape],
        vocab_size=len(tokenizer),
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    src = work / f"{shape}-{seed}"
    LlamaForCausalLM(cfg).save_pretrained(str(src))
    tokenizer.save_pretrained(str(src))
    return measure_folder(src, tokenizer, work / f"gguf-{shape}-{seed}")


# The trained shapes: the `tiny` preset (rows of 128: llama.cpp's k-quants fall back to legacy
# blocks there) and a 256-wide one (the smallest whose rows take the real k-quants)
TRAIN_SHAPES = {
    "tiny": {},
    "wide": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4),
}


def train_shape(shape: str, steps: int, work: Path) -> tuple[Path, dict]:
    """A short run of the default job's data (the standard library's code, its tokenizer) from a
    random Llama of ``shape``: (its final/ folder, its losses)."""
    import torch
    from transformers import LlamaForCausalLM

    from onegpu import train
    from onegpu.data.records import stdlib_source
    from onegpu.data.tokenizer import train_tokenizer
    from onegpu.models import preset_config
    from onegpu.report import read_metrics

    files = stdlib_source(MAX_BYTES, 0.0).train_files
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    tok = train_tokenizer(texts, 4096, f"export-agreement-stdlib-{MAX_BYTES}")
    torch.manual_seed(0)
    start_dir = work / f"init-{shape}"
    model_cfg = preset_config("tiny", tok, **TRAIN_SHAPES[shape])
    LlamaForCausalLM(model_cfg).save_pretrained(str(start_dir))
    tok.save_pretrained(str(start_dir))
    cfg = {
        "model": {"name": str(start_dir)},
        "data": {"seq_len": 64, "num_proc": 1, "max_bytes": MAX_BYTES},
        "training": {
            "max_steps": steps,
            "micro_batch_size": 8,
            "lr": 2e-3,  # from scratch (auto would take a folder for a fine-tune)
            "warmup_steps": 10,
            "eval_every": steps,
            "eval_batches": 8,
            "log_every": 10,
            "seed": 0,
        },
        "output": {"dir": str(work), "name": f"trained-{shape}", "report_to": "none"},
    }
    start = time.perf_counter()
    run = train(cfg).run_dir
    metrics = read_metrics(run / "metrics.jsonl")
    train_loss = [r["loss"] for r in metrics if r["split"] == "train" and "loss" in r]
    val_loss = [r["loss"] for r in metrics if r["split"] == "val" and "loss" in r]
    info = {
        "hidden": model_cfg.hidden_size,
        "layers": model_cfg.num_hidden_layers,
        "steps": steps,
        "first_train_loss": train_loss[0] if train_loss else None,
        "last_train_loss": train_loss[-1] if train_loss else None,
        "val_loss": val_loss[-1] if val_loss else None,
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    return run / "final", info


def measure_folder(src: Path, tokenizer, work: Path, run_prompts: bool = False) -> dict:
    from onegpu.export.check import make_reference
    from onegpu.export.gguf import convert, run_child, tokenizer_facts
    from onegpu.export.gguf_check import check_gguf
    from onegpu.export.llama_setup import converter_dir
    from onegpu.export.prompts import BUILTIN_PROMPTS, CheckPrompts, check_prompts, run_config_of

    prompts = (
        check_prompts([], run_config_of(str(src), None), tokenizer)
        if run_prompts
        else CheckPrompts(list(BUILTIN_PROMPTS), None, "built-in")
    )
    ref = make_reference(str(src), None, prompts.texts, 64, ids=prompts.ids)
    facts = tokenizer_facts(src, tokenizer)
    f16 = convert(src, work, "f16", facts, converter_dir(), say=lambda s: None)
    out = {}
    for quant in QUANTS:
        target = f16.with_name(f"model-{quant}.gguf")
        run_child({"op": "quantize", "src": str(f16), "dst": str(target), "quant": quant})
        out[quant] = {**check_gguf(ref, target, quant).metrics, "prompts": prompts.source}
    return out


def _row(name: str, seed: int, quant: str, m: dict) -> dict:
    print(
        f"{name} seed {seed} {quant}: agreement {m['top1_agreement']:.4f}, "
        f"ppl ratio {m['perplexity_ratio']:.4f} (source ppl {m['perplexity_source']:.1f})",
        flush=True,
    )
    return {
        "model": name,
        "seed": seed,
        "quant": quant,
        "top1_agreement": m["top1_agreement"],
        "perplexity_ratio": m["perplexity_ratio"],
        "perplexity_source": m["perplexity_source"],
        "positions": m["positions"],
        "prompts": m["prompts"],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model | quant | top-1 agreement (min / median / max) "
        "| perplexity ratio (min / median / max) | source perplexity |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        for quant in QUANTS:
            mine = [r for r in rows if r["model"] == name and r["quant"] == quant]
            a = sorted(r["top1_agreement"] for r in mine)
            p = sorted(r["perplexity_ratio"] for r in mine)
            s = sorted(r["perplexity_source"] for r in mine)
            lines.append(
                f"| {name} | {quant} | {a[0]:.4f} / {a[len(a) // 2]:.4f} / {a[-1]:.4f} | "
                f"{p[0]:.4f} / {p[len(p) // 2]:.4f} / {p[-1]:.4f} | {s[len(s) // 2]:.1f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=["tiny", "small"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--train", nargs="*", default=[], help=f"shapes to train and measure: {list(TRAIN_SHAPES)}"
    )
    parser.add_argument("--steps", type=int, default=150, help="steps of each --train run")
    parser.add_argument(
        "--trained", nargs="*", default=[], help="model folders of trained runs to measure too"
    )
    parser.add_argument("--out", default="", help="write <out>.md and <out>.json")
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)  # a shared machine: one thread each runs steadier than two

    from helpers import CORPUS
    from onegpu.bench import provenance
    from onegpu.data.tokenizer import train_tokenizer

    head = provenance.begin()
    rows, runs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = [(f"trained:{Path(f).parent.name}", Path(f)) for f in args.trained]
        for shape in args.train:
            final, info = train_shape(shape, args.steps, Path(tmp) / "runs")
            runs[shape] = info
            print(f"trained {shape}: {info}", flush=True)
            folders.append((f"trained {shape}", final))
        for i, (name, folder) in enumerate(folders):
            tok = AutoTokenizer.from_pretrained(str(folder))
            measured = measure_folder(folder, tok, Path(tmp) / f"t{i}", run_prompts=True)
            rows += [_row(name, 0, q, m) for q, m in measured.items()]
        if args.shapes:
            tokenizer = train_tokenizer(CORPUS, vocab_size=512, fingerprint="tests-corpus")
        for shape in args.shapes:
            for seed in args.seeds:
                for quant, m in measure(shape, seed, tokenizer, Path(tmp)).items():
                    rows.append(_row(f"random {shape}", seed, quant, m))
    text = table(rows)
    print("\n" + text)
    if args.out:
        doc = {**provenance.end(head), "runs": runs, "rows": rows}
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        out.with_suffix(".md").write_text(
            "# GGUF quantized check on trained models: top-1 agreement and perplexity ratio\n\n"
            + provenance.markdown(doc)
            + "\n"
            + "\n".join(f"- trained `{k}`: {v}" for k, v in runs.items())
            + "\n\n"
            + text
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
