"""Run in a child process by gguf.py (its Converter): llama.cpp's converter (the steps of its
convert_hf_to_gguf.py main) on a model folder, with what onegpu decided and the converter cannot
know: the pre-tokenizer name when its hash table does not know a tokenizer trained here, the BOS
rule and the end-of-turn id. These go in through a subclass of the converter's model class, the
way the converter's own model classes specialise its base; its code is not changed.

One process serves a whole export: torch, gguf-py and the converter are imported once, and the
vocabulary step before anything is written (the up-front refusal) and the conversion after the
merge are two requests to it. Requests come on stdin, one JSON line each; each is answered on
stdout with one JSON line (the converter's own output goes to stderr).

Usage: python convert_driver.py LLAMA_DIR
Request: {"model_dir", "outfile", "outtype": f32, f16, bf16 or vocab (the vocabulary alone),
          "pre": name or null, "add_bos": bool, "eot": id or null}
Answer: {"rc": 0, "pid"}; {"rc": 3, "reason", "pid"} (the architecture or its vocabulary is not
supported); {"rc": 1, "pid", "errno" for an OSError} (anything else: the traceback is on
stderr)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    (llama_dir,) = argv
    answers, sys.stdout = sys.stdout, sys.stderr  # stdout carries answers only
    sys.path[:0] = [llama_dir, str(Path(llama_dir) / "gguf-py")]
    # imported before the first request arrives, while the parent still loads the tokenizer
    import conversion  # noqa: F401
    import gguf  # noqa: F401
    import torch

    for line in sys.stdin:
        request = json.loads(line)
        answer: dict = {"pid": os.getpid()}
        try:
            with torch.inference_mode():
                rc, reason = convert(request)
        except Exception as exc:  # the parent reports it with the converter's output (stderr)
            traceback.print_exc()
            rc, reason = 1, None
            if isinstance(exc, OSError) and exc.errno is not None:
                answer["errno"] = exc.errno  # a full disk is told apart from a converter's bug
        sys.stderr.flush()
        answer.update(rc=rc, **({"reason": reason} if reason else {}))
        print(json.dumps(answer), file=answers, flush=True)
    return 0


def convert(request: dict) -> tuple[int, str | None]:
    import gguf
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    ftypes = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    }
    model_dir, outtype = Path(request["model_dir"]), request["outtype"]
    hparams = ModelBase.load_hparams(model_dir, False)
    arch = get_model_architecture(hparams, ModelType.TEXT)
    hparams = as_the_converter_reads(arch, hparams)
    try:
        base = get_model_class(arch, mmproj=False)
    except NotImplementedError:
        return 3, f"llama.cpp's converter does not support {arch}"

    class Export(base):
        model_arch = base.model_arch  # the converter wants every model class to name it

        def get_vocab_base_pre(self, tokenizer) -> str:
            try:
                return super().get_vocab_base_pre(tokenizer)
            except NotImplementedError:  # a tokenizer llama.cpp's hash table does not know
                if request["pre"]:
                    return request["pre"]
                raise

        def set_vocab(self) -> None:
            super().set_vocab()
            written = {k for kv in self.gguf_writer.kv_data for k in kv}
            if gguf.Keys.Tokenizer.ADD_BOS not in written:
                self.gguf_writer.add_add_bos_token(bool(request["add_bos"]))
            if request["eot"] is not None and gguf.Keys.Tokenizer.EOT_ID not in written:
                self.gguf_writer.add_eot_token_id(int(request["eot"]))

    vocab_only = outtype == "vocab"  # the up-front step: the vocabulary alone, nothing kept
    ftype = ftypes["f16" if vocab_only else outtype]
    model = Export(model_dir, ftype, Path(request["outfile"]), eager=False, hparams=hparams)
    try:
        model.write_vocab() if vocab_only else model.write()
    except KeyError as exc:  # not a config key (those are filled above): a special token
        return 3, (
            f"llama.cpp's converter for {arch} takes the special token {exc} from the "
            "family's own tokenizer, and this model's tokenizer has no such token"
        )
    except (FileNotFoundError, ValueError) as exc:
        if "tokenizer.model" not in str(exc):
            raise
        return 3, (
            f"llama.cpp's converter for {arch} reads the vocabulary only from a "
            "SentencePiece tokenizer.model, and this model has a BPE tokenizer.json"
        )
    return 0, None


def as_the_converter_reads(arch: str, hparams: dict) -> dict:
    """The config with the keys llama.cpp's converter reads under names transformers 5 no longer
    writes (found by exporting the test zoo), each set to the value transformers' own model code
    uses."""
    h = dict(hparams)
    if arch == "GPT2LMHeadModel":  # GPT-2's context was n_ctx, always equal to n_positions
        h.setdefault("n_ctx", h.get("n_positions"))
    if arch == "GPTNeoXForCausalLM" and "rotary_pct" not in h:  # now rope_parameters'
        h["rotary_pct"] = (h.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    if (
        arch == "FalconForCausalLM"
        and h.get("multi_query")
        and not h.get("new_decoder_architecture")
    ):
        # transformers' FalconAttention has one K/V head here, whatever num_kv_heads (which
        # transformers 5 now writes, equal to the heads) says; the converter reads num_kv_heads
        h["num_kv_heads"] = 1
    if arch == "DeepseekV3ForCausalLM":
        # transformers' DeepseekV3 routes through a sigmoid always and writes no scoring_func;
        # without one, llama.cpp's deepseek2 falls back to DeepSeek-V2's softmax router (the
        # test zoo's model diverged at token 12, in f32 as in f16)
        h.setdefault("scoring_func", "sigmoid")
    return h


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
