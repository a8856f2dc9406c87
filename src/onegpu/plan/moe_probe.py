"""Routing for the activation probe of a Mixture-of-Experts model.

The probe's weights are never written and its matmuls are skipped (activations.py), so a router's
logits are whatever memory held, and the experts it picks change from one probe point to the next.
What an MoE block keeps depends on that choice: transformers' per-expert loop ("eager") keeps, per
expert it reaches, that expert's tokens and, under autocast, a 16-bit copy of the expert's weights
(a slice of the stacked tensor is no leaf, so autocast's cache never holds it), so a fit over
points with a varying number of experts hit is nonsense (12.1 GB predicted against 0.50 GB
measured on an H100, with negative terms: /work/shared/gpu/h100-20261125/gpu-tier-tests.log).

Here each router's choice is replaced by a fixed round robin, token t taking experts
(t * top_k + j) mod experts for j < top_k: the same at every point, every expert reached as soon
as tokens x top_k >= experts (true at every probe point for 8 experts of top 2 up to 128 of top 8),
and the load balanced as the router's auxiliary loss trains it to be.
"""

from __future__ import annotations

import torch

# Children that hold an MoE block's router in transformers' models (Mixtral, Qwen-MoE: gate;
# gpt-oss: router); each returns (logits, scores, indices).
ROUTERS = ("gate", "router")


def _round_robin(module, args, output):
    if not (isinstance(output, tuple) and len(output) == 3):
        return output
    logits, scores, indices = output
    if not (torch.is_tensor(indices) and indices.dim() == 2 and not indices.is_floating_point()):
        return output
    tokens, top_k = indices.shape
    experts = logits.shape[-1]
    picks = torch.arange(tokens * top_k, device=indices.device).reshape(tokens, top_k) % experts
    return logits, scores, picks.to(indices.dtype)


def route_round_robin(model) -> int:
    """Make every MoE router of ``model`` route by the fixed round robin (see the module
    docstring); returns the number of routers changed."""
    from onegpu.techniques.tiled_mlp import MOE_CHILDREN

    n = 0
    for module in model.modules():
        children = dict(module.named_children())
        if not MOE_CHILDREN & set(children):
            continue
        for name in ROUTERS:
            if name in children and "experts" in children:
                children[name].register_forward_hook(_round_robin)
                n += 1
    return n
