"""The GGUF check's per-quant thresholds, measured: for two model shapes (the `tiny` and `small`
presets, Llama, random weights at initializer_range 0.1 as the test zoo's), llama.cpp's quantizer
makes each type and the check's two figures are taken against onegpu's engine on the source:
teacher-forced top-1 agreement over the built-in prompts' 64-token continuations, and the
perplexity ratio on the held-out text. Prints a Markdown table.

    PYTHONPATH=src python benchmarks/export_agreement.py [--shapes tiny small] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

QUANTS = ("q8_0", "q6_k", "q5_k_m", "q4_k_m")


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


def measure_folder(src: Path, tokenizer, work: Path) -> dict[str, dict]:
    from onegpu.export.check import make_reference
    from onegpu.export.gguf import convert, run_child, tokenizer_facts
    from onegpu.export.gguf_check import check_gguf
    from onegpu.export.llama_setup import converter_dir
    from onegpu.export.prompts import BUILTIN_PROMPTS

    ref = make_reference(str(src), None, list(BUILTIN_PROMPTS), 64)
    facts = tokenizer_facts(src, tokenizer)
    f16 = convert(src, work, "f16", facts, converter_dir(), say=lambda s: None)
    out = {}
    for quant in QUANTS:
        target = f16.with_name(f"model-{quant}.gguf")
        run_child({"op": "quantize", "src": str(f16), "dst": str(target), "quant": quant})
        out[quant] = check_gguf(ref, target, quant).metrics
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--trained", nargs="*", default=[], help="model folders of trained runs to measure too"
    )
    args = parser.parse_args()
    from helpers import CORPUS
    from onegpu.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(CORPUS, vocab_size=512, fingerprint="tests-corpus")
    rows = []
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for i, folder in enumerate(args.trained):
            tok = AutoTokenizer.from_pretrained(folder)
            name = f"trained:{Path(folder).parent.name}"
            for quant, m in measure_folder(Path(folder), tok, Path(tmp) / f"t{i}").items():
                rows.append((name, 0, quant, m["top1_agreement"], m["perplexity_ratio"]))
                print(
                    f"{name} {quant}: agreement {m['top1_agreement']:.4f}, "
                    f"ppl ratio {m['perplexity_ratio']:.4f}",
                    flush=True,
                )
        for shape in args.shapes:
            for seed in args.seeds:
                for quant, m in measure(shape, seed, tokenizer, Path(tmp)).items():
                    rows.append((shape, seed, quant, m["top1_agreement"], m["perplexity_ratio"]))
                    print(
                        f"{shape} seed {seed} {quant}: agreement {m['top1_agreement']:.4f}, "
                        f"ppl ratio {m['perplexity_ratio']:.4f}",
                        flush=True,
                    )
    print(
        "\n| shape | quant | top-1 agreement (min / median / max) "
        "| perplexity ratio (min / median / max) |"
    )
    print("|---|---|---|---|")
    for shape in dict.fromkeys(r[0] for r in rows):
        for quant in QUANTS:
            a = sorted(r[3] for r in rows if r[0] == shape and r[2] == quant)
            p = sorted(r[4] for r in rows if r[0] == shape and r[2] == quant)
            print(
                f"| {shape} | {quant} | {a[0]:.4f} / {a[len(a) // 2]:.4f} / {a[-1]:.4f} | "
                f"{p[0]:.4f} / {p[len(p) // 2]:.4f} / {p[-1]:.4f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
