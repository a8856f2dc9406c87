"""Between the scheduler's plan and the device, for one engine step: the block tables of the rows
that run go up, the prompt pieces go through the runner and the last ones' first tokens through
the sampler (each such row then decodes from it), and the step's tokens come back in one copy."""

from __future__ import annotations

from itertools import groupby

import torch

from onegpu.infer.decode_step import Rows
from onegpu.infer.runner import ModelRunner, Pieces
from onegpu.infer.sampling import Needs, Sampler
from onegpu.infer.scheduler import Piece, Sequence


class StepIO:
    def __init__(self, rows: Rows, device):
        self.rows, self.device = rows, device
        self.written: dict[int, list[int]] = {}  # row -> the blocks its table holds

    def release(self, row: int) -> None:
        """``row`` holds no sequence any more: it stops decoding, its table points at the null
        block."""
        self.rows.retire(row)
        self.written.pop(row, None)

    def upload(self, seqs: list[Sequence]) -> None:
        dirty = False
        for seq in seqs:
            blocks = seq.table.blocks
            if self.written.get(seq.row) != blocks:
                self.rows.set_table(seq.row, blocks)
                self.written[seq.row] = list(blocks)
                dirty = True
        if dirty:
            self.rows.upload()

    def prefill(self, runner: ModelRunner, sampler: Sampler, pieces: list[Piece], adapters):
        """Run the pieces — neighbours of one length as one forward, in the plan's order (a piece
        may read blocks an earlier one of this step writes) — and sample the first token of each
        prompt they finish; ``[(sequence, token on the device)]``."""
        firsts = []
        for _, run in groupby(pieces, key=lambda p: p.end - p.start):
            group = list(run)
            seqs = [p.seq for p in group]
            rows = torch.tensor([s.row for s in seqs]).to(self.device)
            ids = torch.tensor([p.seq.tokens[p.start : p.end] for p in group])
            logits = runner.prefill(
                Pieces(
                    ids.to(self.device),
                    [p.start for p in group],
                    self.rows.tables.index_select(0, rows),
                    adapters(seqs),
                )
            )
            last = [i for i, p in enumerate(group) if p.last]
            if last:
                at = torch.tensor(last).to(self.device)
                firsts += self._first(sampler, logits[at], [group[i] for i in last], rows[at])
        return firsts

    def _first(self, sampler: Sampler, logits, pieces: list[Piece], rows: torch.Tensor):
        seqs = [p.seq for p in pieces]
        needs = Needs.of([s.params for s in seqs])
        counter = torch.tensor([s.generated for s in seqs]).to(self.device)
        tokens = sampler.sample(logits, rows, counter, needs)
        sampler.observe(rows, tokens, torch.ones_like(tokens, dtype=torch.bool), needs)
        out = []
        for k, (seq, piece) in enumerate(zip(seqs, pieces, strict=True)):
            self.rows.start(seq.row, tokens[k : k + 1], piece.end, seq.generated + 1, seq.params)
            out.append((seq, tokens[k]))
        return out

    def read_back(self, rows: int, steps: int, decode: list[Sequence], firsts) -> tuple[dict, dict]:
        """One device-to-host copy: each decode row's tokens (those it made while live), and the
        first token of each prompt finished."""
        parts = [self.rows.out[:rows, :steps].reshape(-1)]
        if firsts:
            parts.append(torch.stack([t for _, t in firsts]))
        flat = torch.cat(parts).tolist()
        table = {
            s: [t for t in flat[s.row * steps : (s.row + 1) * steps] if t >= 0] for s in decode
        }
        tail = flat[rows * steps :]
        return table, {seq: [tok] for (seq, _), tok in zip(firsts, tail, strict=True)}
