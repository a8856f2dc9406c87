"""Run in a child process by gguf.py: llama.cpp's converter (the steps of its
convert_hf_to_gguf.py main) on a merged model folder, with what onegpu decided and the converter
cannot know: the pre-tokenizer name when its hash table does not know a tokenizer trained here, the
BOS rule and the end-of-turn id. These go in through a subclass of the converter's model class, the
way the converter's own model classes specialise its base; its code is not changed.

Usage: python convert_driver.py LLAMA_DIR MODEL_DIR OUTFILE OUTTYPE SPEC_JSON
OUTTYPE: f32, f16, bf16, or vocab (write the vocabulary alone: the up-front probe).
SPEC_JSON: {"pre": name or null, "add_bos": bool, "eot": id or null}. Exit 3: the architecture or
its vocabulary is not supported (the reason on stderr)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    llama_dir, model_dir, outfile, outtype, spec_json = argv
    spec = json.loads(spec_json)
    sys.path[:0] = [llama_dir, str(Path(llama_dir) / "gguf-py")]
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    ftypes = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    }
    hparams = ModelBase.load_hparams(Path(model_dir), False)
    arch = get_model_architecture(hparams, ModelType.TEXT)
    hparams = as_the_converter_reads(arch, hparams)
    try:
        base = get_model_class(arch, mmproj=False)
    except NotImplementedError:
        print(f"llama.cpp's converter does not support {arch}", file=sys.stderr)
        return 3

    class Export(base):
        model_arch = base.model_arch  # the converter wants every model class to name it

        def get_vocab_base_pre(self, tokenizer) -> str:
            try:
                return super().get_vocab_base_pre(tokenizer)
            except NotImplementedError:  # a tokenizer llama.cpp's hash table does not know
                if spec["pre"]:
                    return spec["pre"]
                raise

        def set_vocab(self) -> None:
            super().set_vocab()
            written = {k for kv in self.gguf_writer.kv_data for k in kv}
            if gguf.Keys.Tokenizer.ADD_BOS not in written:
                self.gguf_writer.add_add_bos_token(bool(spec["add_bos"]))
            if spec["eot"] is not None and gguf.Keys.Tokenizer.EOT_ID not in written:
                self.gguf_writer.add_eot_token_id(int(spec["eot"]))

    with torch.inference_mode():
        vocab_only = outtype == "vocab"  # the up-front probe: the vocabulary alone, nothing kept
        ftype = ftypes["f16" if vocab_only else outtype]
        model = Export(Path(model_dir), ftype, Path(outfile), eager=False, hparams=hparams)
        try:
            model.write_vocab() if vocab_only else model.write()
        except KeyError as exc:  # not a config key (those are filled above): a special token
            print(
                f"llama.cpp's converter for {arch} takes the special token {exc} from the "
                "family's own tokenizer, and this model's tokenizer has no such token",
                file=sys.stderr,
            )
            return 3
        except (FileNotFoundError, ValueError) as exc:
            if "tokenizer.model" not in str(exc):
                raise
            print(
                f"llama.cpp's converter for {arch} reads the vocabulary only from a "
                "SentencePiece tokenizer.model, and this model has a BPE tokenizer.json",
                file=sys.stderr,
            )
            return 3
    return 0


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
