"""Verifying a step's proposals: each speculative row's tokens ``[last, p1 .. pk]`` at positions
``computed .. computed + k`` through the runner over the paged KV (a prompt piece's forward,
prefill's path, eager), the logits of every position; the target's token at each position under
the row's own settings, exactly as plain decoding would draw it there (its penalties counting the
proposals before it, its noise's counter, its grammar's mask at that point); the acceptance rule
(sampling.speculative_accept); the rows' state after it (Rows.settle). Reads nothing back: the kept
tokens ride in the step's one read-back."""

from __future__ import annotations

from dataclasses import replace
from itertools import groupby

import torch

from onegpu.infer import sampling
from onegpu.infer.rows import Rows
from onegpu.infer.runner import ModelRunner, Pieces
from onegpu.infer.sampling import Needs


def verify(runner: ModelRunner, rows: Rows, spec, adapters, masks) -> list[tuple]:
    """Verify ``spec`` (Plan.spec: (sequence, proposal)); ``adapters``: seqs -> PEFT's names or
    None; ``masks``: sequence -> its grammar's masks ``[k + 1, words]`` (guided.Guides.walk), for
    the constrained ones. Each sequence with its kept tokens ``[k + 1]`` (-1 past them)."""
    out = []
    # neighbours with as many proposals run as one forward
    for _, run in groupby(spec, key=lambda item: len(item[1])):
        group = list(run)
        kept = _verify(runner, rows, group, adapters, masks)
        out += [(seq, kept[i]) for i, (seq, _) in enumerate(group)]
    return out


def _verify(runner: ModelRunner, rows: Rows, group, adapters, masks) -> torch.Tensor:
    seqs = [seq for seq, _ in group]
    k = len(group[0][1])
    device = rows.device
    ids = torch.tensor([[seq.tokens[-1], *guess] for seq, guess in group])
    at = torch.tensor([s.row for s in seqs]).to(device)
    logits = runner.prefill(
        Pieces(
            ids.to(device),
            [s.computed for s in seqs],
            rows.tables.index_select(0, at),
            adapters(seqs),
            deltas=rows.rope_delta.index_select(0, at),
        ),
        every=True,
    )  # [rows, k + 1, vocab]
    needs = replace(Needs.of([s.params for s in seqs]), logprobs=False)
    width = k + 1
    flat = at.repeat_interleave(width)  # row r's positions 0 .. k, row after row
    offsets = torch.arange(width, device=device).repeat(len(seqs))
    params = rows.params(flat, rows.generated[flat] + offsets, needs)
    params = _with_proposals(params, ids, needs, masks, seqs)
    targets = sampling.sample(logits.reshape(len(seqs) * width, -1), params, needs)
    targets = targets.view(len(seqs), width)
    proposals = ids[:, 1:].to(device)
    accepted = sampling.speculative_accept(targets, proposals)
    return rows.settle([s.row for s in seqs], targets, accepted, needs)


def _with_proposals(params, ids: torch.Tensor, needs: Needs, masks, seqs):
    """Each position's settings as plain decoding would have them there: the penalties count
    the proposals before it, the grammar's mask is the one after them."""
    rows, width = ids.shape
    flat = torch.arange(rows * width).view(rows, width)
    before_rows, before_tokens = [], []
    for r in range(rows):
        for i in range(1, width):  # position i follows proposals 1 .. i
            before_rows += [int(flat[r, i])] * i
            before_tokens += ids[r, 1 : i + 1].tolist()
    device = params.seen.device
    where = (torch.tensor(before_rows).to(device), torch.tensor(before_tokens).to(device))
    changes = {}
    if needs.penalty and before_rows:
        seen = params.seen.clone()
        seen[where] = True
        changes["seen"] = seen
    if needs.penalties and before_rows:
        counts = params.counts.clone()
        counts.index_put_(
            where, torch.ones(len(before_rows), dtype=counts.dtype, device=device), accumulate=True
        )
        changes["counts"] = counts
    if needs.constraints:
        bits, marked = params.bitmask.clone(), params.masked.clone()
        for r, seq in enumerate(seqs):
            mask = masks.get(seq)
            if mask is not None:
                bits[r * width : (r + 1) * width] = mask.to(device)
                marked[r * width : (r + 1) * width] = True
        changes["bitmask"], changes["masked"] = bits, marked
    return replace(params, **changes) if changes else params
