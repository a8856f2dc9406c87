"""Under torchrun: shard a tiny Llama with FSDP2 as `onegpu train` does and print what is active.

    torchrun --nproc-per-node 2 tests/dist_scripts/fsdp2_check.py <model_dir> <full|hybrid>
    <fp32|bf16>

Prints one JSON line (rank 0): mesh shape and names, local shard size, compute dtype of the logits.
"""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from onegpu.config import from_dict
from onegpu.distributed import apply_fsdp2


def main(model_dir: str, sharding: str, precision: str) -> None:
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    cfg = from_dict({"distributed": {"strategy": "fsdp2", "fsdp_sharding": sharding}})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    model = apply_fsdp2(model, cfg, precision, SimpleNamespace(device=torch.device("cpu")))
    weight = model.model.layers[0].self_attn.q_proj.weight
    logits = model(input_ids=torch.arange(16).view(1, 16)).logits
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "mesh_shape": list(weight.device_mesh.shape),
                    "mesh_names": list(weight.device_mesh.mesh_dim_names),
                    "local_rows": weight.to_local().shape[0],
                    "full_rows": full_rows,
                    "master_dtype": str(weight.dtype),
                    "logits_dtype": str(logits.dtype),
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
