#!/bin/bash
# One training step of one long row on this CPU, plain against activation offload + tiled MLP:
# peak resident memory by /usr/bin/time -v, loss and step time from the run's own output.
#   benchmarks/long_context_cpu.sh [TOKENS]      (default 16384; ~20 min an arm on 2 cores)
# The model is the `small` preset's shape saved with room for TOKENS positions (random weights,
# the preset tokenizer cached by an earlier `make demo`). Prints what docs/methods-b.md quotes.
set -euo pipefail
TOKENS=${1:-16384}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
cd "$ROOT"
.venv/bin/python - "$WORK/model" "$TOKENS" <<'PY'
import glob, os, sys, torch
from transformers import AutoTokenizer, LlamaForCausalLM
from onegpu.models import preset_config
cached = sorted(glob.glob(os.path.expanduser("~/.cache/onegpu/tokenizers/*")))
tok = next(t for t in map(AutoTokenizer.from_pretrained, cached) if len(t) == 4096)
torch.manual_seed(0)
model = LlamaForCausalLM(preset_config("small", tok, max_position_embeddings=int(sys.argv[2])))
model.save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])
PY
COMMON="--model.name $WORK/model --data.seq_len $TOKENS --training.micro_batch_size 1 \
 --training.grad_accum 1 --training.max_steps 1 --training.eval_every 0 \
 --techniques.precision fp32 --techniques.compile off --techniques.attention sdpa \
 --output.report_to none"
for arm in plain offload; do
  extra="--techniques.tiled_mlp off"
  [ $arm = offload ] && extra="--techniques.activation_offload true --techniques.tiled_mlp on"
  echo "== $arm, $TOKENS tokens, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
  /usr/bin/time -v .venv/bin/onegpu train $COMMON $extra --output.dir "$WORK/out-$arm" \
    > "$WORK/$arm.log" 2>&1
  grep -E "Maximum resident|Elapsed" "$WORK/$arm.log"
  grep -E "s/step|^done:" "$WORK/$arm.log" | tail -2
done
