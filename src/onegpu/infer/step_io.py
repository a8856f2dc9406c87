"""Between the scheduler's plan and the device, for one engine step: the block tables of the rows
that run go up, the prompt pieces go through the runner and the last ones' first tokens through
the sampler (each such row then decodes from it), and the step's tokens come back in one copy."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Optional

import torch

from onegpu.infer.decode_step import Rows
from onegpu.infer.logit_rules import token_logprobs
from onegpu.infer.requests import TokenLogprob
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

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s sequence now decodes in ``dst`` (its table goes up with the next
        ``upload``); ``src`` holds nothing."""
        self.rows.move(src, dst)
        self.written.pop(src, None)
        self.written.pop(dst, None)

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

    def prefill(
        self, runner: ModelRunner, sampler: Sampler, pieces: list[Piece], adapters, failed: dict
    ) -> list[First]:
        """Run the pieces — neighbours of one length as one forward, in the plan's order (a piece
        may read blocks an earlier one of this step writes) — and sample the first token of each
        prompt they finish. A piece that raises fails its sequence alone (into ``failed``, a
        sequence -> its error, which may hold some already): a forward of several that raises is
        run again a piece at a time to find which; a later piece that reads a block a failed one
        was to write fails with it (a prompt shared within the step)."""
        firsts: list[First] = []
        poisoned: set[int] = set()  # blocks a failed piece was to write
        size = runner.block_size
        # neighbours of one length, and apart those whose prompt's logprobs are asked for (their
        # forward keeps every token's logits)
        for _, run in groupby(pieces, key=lambda p: (p.end - p.start, _every(p))):
            group = []
            for p in run:
                if p.seq not in failed and poisoned.intersection(p.seq.table.blocks):
                    failed[p.seq] = RuntimeError("a prompt block it shares failed to compute")
                if p.seq in failed:
                    poisoned.update(p.writes(size))
                else:
                    group.append(p)
            if not group:
                continue
            try:
                firsts += self._forward(runner, sampler, group, adapters)
                continue
            except Exception as exc:  # noqa: BLE001 - whose it is decides who fails
                if len(group) == 1:
                    failed[group[0].seq] = exc
                    poisoned.update(group[0].writes(size))
                    continue
            for piece in group:
                try:
                    firsts += self._forward(runner, sampler, [piece], adapters)
                except Exception as exc:  # noqa: BLE001 - this sequence's alone
                    failed[piece.seq] = exc
                    poisoned.update(piece.writes(size))
        return firsts

    def _forward(self, runner: ModelRunner, sampler: Sampler, group: list[Piece], adapters):
        seqs = [p.seq for p in group]
        rows = torch.tensor([s.row for s in seqs]).to(self.device)
        ids = torch.tensor([p.seq.tokens[p.start : p.end] for p in group])
        every = _every(group[0])
        logits = runner.prefill(
            Pieces(
                ids.to(self.device),
                [p.start for p in group],
                self.rows.tables.index_select(0, rows),
                adapters(seqs),
            ),
            every,
        )
        if every:
            for k, piece in enumerate(group):
                prompt_logprobs(piece, logits[k])
            logits = logits[:, -1]
        last = [i for i, p in enumerate(group) if p.last]
        if not last:
            return []
        at = torch.tensor(last).to(self.device)
        return self._first(sampler, logits[at], [group[i] for i in last], rows[at])

    def _first(self, sampler: Sampler, logits, pieces: list[Piece], rows: torch.Tensor):
        seqs = [p.seq for p in pieces]
        needs = Needs.of([s.params for s in seqs])
        counter = torch.tensor([s.generated for s in seqs]).to(self.device)
        tokens = sampler.sample(logits, rows, counter, needs)
        logprobs = sampler.logprobs(logits, tokens, needs)
        sampler.observe(rows, tokens, torch.ones_like(tokens, dtype=torch.bool), needs)
        out = []
        for k, (seq, piece) in enumerate(zip(seqs, pieces, strict=True)):
            self.rows.start(seq.row, tokens[k : k + 1], piece.end, seq.generated + 1, seq.params)
            asked = logprobs is not None and seq.params.logprobs is not None
            out.append(First(seq, tokens[k], tuple(t[k] for t in logprobs) if asked else None))
        return out

    def read_back(self, rows: int, steps: int, decode: list[Sequence], firsts: list[First]):
        """One device-to-host copy: each decode row's tokens (those it made while live), the
        first token of each prompt finished, and the logprobs of those tokens for the requests
        that asked; ``(tokens by decode sequence, [first token] by sequence, [TokenLogprob] by
        sequence)``."""
        parts = [self.rows.out[:rows, :steps].reshape(-1)]
        if firsts:
            parts.append(torch.stack([f.token for f in firsts]))
        asking = [s for s in decode if s.params.logprobs is not None]
        firsts_asking = [f for f in firsts if f.logprobs is not None]
        if asking or firsts_asking:
            # the values ride in the same copy as the tokens: all as float64, which holds both
            # a token id and a float32 logprob exactly
            parts = [p.double() for p in parts] + self._logprobs(steps, asking, firsts_asking)
        flat = torch.cat(parts).tolist()
        ids = [int(t) for t in flat[: rows * steps + len(firsts)]]
        table = {s: [t for t in ids[s.row * steps : (s.row + 1) * steps] if t >= 0] for s in decode}
        first_tokens = {f.seq: [tok] for f, tok in zip(firsts, ids[rows * steps :], strict=True)}
        values = flat[rows * steps + len(firsts) :]
        top = self.rows.top_ids.shape[-1]
        found = unpack_logprobs(values, top, [(s, table[s], steps) for s in asking])
        firsts_values = values[len(asking) * steps * (1 + 2 * top) :]
        found.update(
            unpack_logprobs(
                firsts_values, top, [(f.seq, first_tokens[f.seq], 1) for f in firsts_asking]
            )
        )
        return table, first_tokens, found

    def _logprobs(self, steps: int, asking: list[Sequence], firsts: list[First]) -> list:
        """The logprobs of the asking decode rows' ``steps`` tokens, then of the asking firsts:
        per token its own, then the top ids, then their logprobs."""
        parts = []
        if asking:
            at = torch.tensor([s.row for s in asking]).to(self.device)
            st = self.rows
            for buf in (st.chosen, st.top_ids, st.top_logprobs):
                parts.append(
                    buf[:, :steps].index_select(0, at).double().reshape(len(asking), steps, -1)
                )
            parts = [torch.cat(parts, dim=-1).reshape(-1)]
        for f in firsts:
            chosen, ids, values = f.logprobs
            parts.append(torch.cat([chosen[None].double(), ids.double(), values.double()]))
        return parts


@dataclass
class First:
    """The first token a prompt's computation chose (on the device), and its logprobs
    ``(chosen, top ids, top logprobs)`` when the request asked for them."""

    seq: Sequence
    token: torch.Tensor
    logprobs: Optional[tuple] = None


def _every(piece: Piece) -> bool:
    return piece.seq.params.prompt_logprobs is not None


def prompt_logprobs(piece: Piece, logits: torch.Tensor) -> None:
    """The logprobs of the prompt tokens that ``piece``'s logits ``[length, vocab]`` predict (the
    token after each of its positions, up to the prompt's last), onto its sequence's list; those
    it holds already (a prompt computed again after preemption) are not repeated. Read back here,
    a copy of its own: few requests ask for them (completions' echo, an evaluation's scoring)."""
    seq, k = piece.seq, piece.seq.params.prompt_logprobs
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # the first token: nothing precedes it
    first = max(piece.start + 1, len(seq.prompt_logprobs))
    last = min(piece.end, len(seq.prompt) - 1)  # the prompt's last predicts the answer's first
    if first > last:
        return
    at = logits[first - 1 - piece.start : last - piece.start]
    targets = torch.tensor(seq.tokens[first : last + 1]).to(at.device)
    chosen, ids, values = (t.tolist() for t in token_logprobs(at, targets, k))
    seq.prompt_logprobs += [
        TokenLogprob(t, lp, tuple(zip(i, v, strict=True)))
        for t, lp, i, v in zip(targets.tolist(), chosen, ids, values, strict=True)
    ]


def unpack_logprobs(values: list[float], top: int, rows: list[tuple]) -> dict:
    """``values``: for each ``(sequence, its tokens read back, steps)`` of ``rows``, ``steps``
    records of ``1 + 2 * top`` numbers (the token's logprob, the top ids, their logprobs); one
    TokenLogprob per token read back (the first ones: a row's live steps come first), its top cut
    to the request's own k."""
    out, at, width = {}, 0, 1 + 2 * top
    for seq, tokens, steps in rows:
        k = seq.params.logprobs
        got = []
        for j, token in enumerate(tokens):
            rec = values[at + j * width : at + (j + 1) * width]
            alternatives = zip(rec[1 : 1 + k], rec[1 + top : 1 + top + k], strict=True)
            got.append(TokenLogprob(token, rec[0], tuple((int(i), lp) for i, lp in alternatives)))
        out[seq] = got
        at += steps * width
    return out
