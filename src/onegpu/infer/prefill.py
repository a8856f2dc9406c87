"""A plan's prompt pieces through the runner, and the first token of each prompt they finish
through the sampler (its row then decodes from it: ``Rows.begin``). Neighbours of one length run
as one forward, in the plan's order (a piece may read blocks an earlier one of this step writes).
A piece that raises fails its sequence alone: a forward of several that raises is run again a
piece at a time to find whose it is, and a later piece that reads a block a failed one was to
write fails with it (a prompt shared within the step). Nothing here is written but the rows'
state and the KV the pieces compute: the first tokens, the prompts' logprobs and the failures are
returned."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import Optional

import torch

from onegpu.infer import sampling
from onegpu.infer.images import feeds
from onegpu.infer.logit_rules import token_logprobs
from onegpu.infer.requests import TokenLogprob
from onegpu.infer.rows import Rows
from onegpu.infer.runner import ModelRunner, Pieces
from onegpu.infer.sampling import Needs
from onegpu.infer.scheduler import Piece, Sequence


@dataclass
class First:
    """The first token a prompt's computation chose (on the device), and its logprobs
    ``(chosen, top ids, top logprobs)`` when the request asked for them."""

    seq: Sequence
    token: torch.Tensor
    logprobs: Optional[tuple] = None


@dataclass
class Prefilled:
    """What a step's pieces gave: the first tokens, each asking sequence's prompt logprobs of
    this step as ``(index of the first in its prompt, [TokenLogprob])``, the failures."""

    firsts: list[First] = field(default_factory=list)
    prompt_logprobs: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)


def prefill(
    runner: ModelRunner, rows: Rows, pieces: list[Piece], adapters, failed: dict
) -> Prefilled:
    """Run ``pieces``; ``failed``: the sequences this step has failed already (their pieces are
    skipped, and what reads their blocks fails too); ``adapters``: seqs -> PEFT's names or None."""
    out = Prefilled()
    poisoned: set[int] = set()  # blocks a failed piece was to write
    size = runner.block_size

    def fail(piece: Piece, exc: BaseException) -> None:
        out.failed[piece.seq] = exc
        poisoned.update(piece.writes(size))

    for _, run in groupby(pieces, key=_kind):
        group = []
        for p in run:
            if p.seq in failed or p.seq in out.failed:
                poisoned.update(p.writes(size))
            elif poisoned.intersection(p.seq.table.blocks):
                fail(p, RuntimeError("a prompt block it shares failed to compute"))
            else:
                group.append(p)
        if not group:
            continue
        try:
            _forward(runner, rows, group, adapters, out)
            continue
        except Exception as exc:  # noqa: BLE001 - whose it is decides who fails
            if len(group) == 1:
                fail(group[0], exc)
                continue
        for piece in group:
            try:
                _forward(runner, rows, [piece], adapters, out)
            except Exception as exc:  # noqa: BLE001 - this sequence's alone
                fail(piece, exc)
    return out


def _forward(runner: ModelRunner, rows: Rows, group: list[Piece], adapters, out: Prefilled):
    seqs = [p.seq for p in group]
    at_rows = torch.tensor([s.row for s in seqs]).to(rows.device)
    ids = torch.tensor([p.seq.tokens[p.start : p.end] for p in group])
    every = _every(group[0])
    logits = runner.prefill(
        Pieces(
            ids.to(rows.device),
            [p.start for p in group],
            rows.tables.index_select(0, at_rows),
            adapters(seqs),
            group[0].seq.images if len(group) == 1 else None,
            rows.rope_delta.index_select(0, at_rows),
        ),
        every,
    )
    if every:
        found = {p.seq: prompt_logprobs(p, logits[k]) for k, p in enumerate(group)}
        logits = logits[:, -1]
    else:
        found = {}
    last = [i for i, p in enumerate(group) if p.last]
    firsts = []
    if last:
        at = torch.tensor(last).to(rows.device)
        firsts = _first(rows, logits[at], [group[i] for i in last], at_rows[at])
    # a group that raises leaves nothing: it is run again piece by piece
    out.prompt_logprobs.update({s: v for s, v in found.items() if v is not None})
    out.firsts += firsts


def _first(rows: Rows, logits, pieces: list[Piece], at: torch.Tensor) -> list[First]:
    seqs = [p.seq for p in pieces]
    needs = Needs.of([s.params for s in seqs])
    counter = torch.tensor([s.generated for s in seqs]).to(rows.device)
    tokens = sampling.sample(logits, rows.params(at, counter, needs), needs)
    logprobs = sampling.logprobs(logits, tokens, needs, rows.top)
    rows.observe(at, tokens, torch.ones_like(tokens, dtype=torch.bool), needs)
    out = []
    for k, (seq, piece) in enumerate(zip(seqs, pieces, strict=True)):
        rows.begin(seq.row, tokens[k : k + 1], piece.end, seq.generated + 1, seq.params)
        asked = logprobs is not None and seq.params.logprobs is not None
        out.append(First(seq, tokens[k], tuple(t[k] for t in logprobs) if asked else None))
    return out


def _kind(piece: Piece) -> tuple:
    """Pieces that may share a forward: one length; apart those whose prompt's logprobs are
    asked for (their forward keeps every token's logits); a piece with its images alone."""
    alone = piece.seq.id if feeds(piece.seq.images, piece.start) else -1
    return piece.end - piece.start, _every(piece), alone


def _every(piece: Piece) -> bool:
    return piece.seq.params.prompt_logprobs is not None


def prompt_logprobs(piece: Piece, logits: torch.Tensor) -> Optional[tuple[int, list]]:
    """The logprobs of the prompt tokens that ``piece``'s logits ``[length, vocab]`` predict (the
    token after each of its positions, up to the prompt's last) as ``(index of the first in the
    prompt, [TokenLogprob])``; None where it predicts none. Read back here, a copy of its own:
    few requests ask for them (completions' echo, an evaluation's scoring)."""
    seq, k = piece.seq, piece.seq.params.prompt_logprobs
    first = piece.start + 1
    last = min(piece.end, len(seq.prompt) - 1)  # the prompt's last predicts the answer's first
    if first > last:
        return None
    at = logits[first - 1 - piece.start : last - piece.start]
    targets = torch.tensor(seq.tokens[first : last + 1]).to(at.device)
    chosen, ids, values = (t.tolist() for t in token_logprobs(at, targets, k))
    return first, [
        TokenLogprob(t, lp, tuple(zip(i, v, strict=True)))
        for t, lp, i, v in zip(targets.tolist(), chosen, ids, values, strict=True)
    ]
