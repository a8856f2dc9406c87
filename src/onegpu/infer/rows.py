"""Every decode row's state on the device, with one owner: what the row feeds next and where, its
end, its block table, its LoRA adapter, its request's sampling settings and what the penalties have
seen, its grammar's mask, and whose KV its eager copy holds.

``apply(plan)`` is the one place a scheduler's plan changes rows: a moved sequence's state goes
with it (every per-row tensor at once), a freed row stops, a started request's settings are
written, the tables of the rows that run go up, a speculative row sits out the decode steps
(``settle`` sets it going after its verification). A decode step (decode_step.py) and the prompts'
first tokens (prefill.py) read the rows and advance them through ``advance`` and ``begin``, which
hold the one rule of a sequence's end on the device (``ended``); the host learns each row's end
from ``finish`` in the step's one read-back (``read_back``), and adds what only it knows (a stop
string, a complete grammar: output.py).

Tensors live at fixed addresses: a compiled step (a CUDA graph on a GPU) reads them where they
lie. The host writes block tables and grammar masks into host copies (on a CPU the device's own)
that go up in one copy each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from onegpu.errors import ConfigError
from onegpu.infer.logit_rules import bitmask_words, count_tokens
from onegpu.infer.mrope import delta_of
from onegpu.infer.requests import MAX_LOGPROBS
from onegpu.infer.sampling import Needs, RowParams

# Rows.finish: why a row stopped on the device (0: it has not); the host maps them to reasons
RUNNING, END_TOKEN, BUDGET = 0, 1, 2


@dataclass(frozen=True)
class ReadBack:
    """A step's tokens on the host: by decode sequence the tokens its row made while live, the
    first token of each prompt finished, each of those rows' ``finish`` code, and the logprob
    records (``values``) of the rows that asked, in ``read_back``'s order."""

    tokens: dict
    firsts: dict
    finish: dict
    values: list


class Rows:
    """``rows`` decode rows of at most ``blocks`` blocks each, for a ``vocab``-token model whose
    end tokens are ``eos_ids``; ``sync_every`` decode steps between read-backs."""

    # a request's own, moved with it (``apply``); the grammar's mask is written by every step
    _REQUEST = ("tokens", "positions", "live", "budget", "generated", "ignore_eos", "finish")
    _REQUEST += ("lora", "temperature", "top_k", "top_p", "penalty", "seed", "seen")
    _REQUEST += ("presence", "frequency", "counts", "bias", "min_tokens", "rope_delta")

    def __init__(
        self, rows: int, blocks: int, vocab: int, eos_ids, sync_every: int, device
    ) -> None:
        def z(dtype, *shape, fill=0):
            return torch.full(shape or (rows,), fill, dtype=dtype, device=device)

        self.device = torch.device(device)
        self.top = min(MAX_LOGPROBS, vocab)  # alternatives computed per token, when asked
        ids = sorted({t for t in eos_ids if 0 <= t < vocab})
        # decoding: the token to feed next, its position, whether the row decodes, its budget,
        # the tokens it made, why it stopped, its blocks and its adapter (batched_lora's index)
        self.tokens, self.positions = z(torch.long), z(torch.long)
        self.live, self.budget, self.generated = z(torch.bool), z(torch.long), z(torch.long)
        self.ignore_eos, self.finish = z(torch.bool), z(torch.long)
        self.tables, self.lora = z(torch.long, rows, blocks), z(torch.long)
        # an mrope model's rotary positions past the KV slots (mrope.py; the runner reads it there)
        self.rope_delta = z(torch.long)
        self.eos = torch.tensor(ids or [-2], dtype=torch.long).to(device)
        # the steps since the last read-back: tokens, their logprobs, each step's likeliest
        self.out = z(torch.long, rows, sync_every, fill=-1)
        self.chosen = z(torch.float, rows, sync_every)
        self.top_ids = z(torch.long, rows, sync_every, self.top)
        self.top_logprobs = z(torch.float, rows, sync_every, self.top)
        # sampling: transformers' settings, OpenAI's penalties with the counts they read, the
        # tokens seen (repetition penalty), logit_bias and min_tokens, the grammar's mask
        self.temperature, self.top_k = z(torch.float), z(torch.long)
        self.top_p, self.penalty = z(torch.float, fill=1.0), z(torch.float, fill=1.0)
        self.seed, self.seen = z(torch.long), z(torch.bool, rows, vocab)
        self.presence, self.frequency = z(torch.float), z(torch.float)
        self.counts = z(torch.int32, rows, vocab)
        self.bias, self.min_tokens = z(torch.float, rows, vocab), z(torch.long)
        self.bitmask = z(torch.int32, rows, bitmask_words(vocab), fill=-1)
        self.masked = z(torch.bool)
        self.end_ids = torch.tensor(ids, dtype=torch.long).to(device)  # what min_tokens masks
        cuda = self.device.type == "cuda"
        if cuda:  # CUDA graphs replay on fixed addresses
            for t in vars(self).values():
                if isinstance(t, torch.Tensor):
                    torch._dynamo.mark_static_address(t)
        # the host's copies of what it writes (on a CPU the device's own)
        self.host_tables = self.tables.cpu() if cuda else self.tables
        self.host_bitmask = self.bitmask.cpu() if cuda else self.bitmask
        self.host_masked = self.masked.cpu() if cuda else self.masked
        # host bookkeeping: the blocks each row's table holds on the device, whose KV each row's
        # eager copy holds (decode_window.py), the rows whose mask is not all ones
        self.written: dict[int, list[int]] = {}
        self.holders: dict[int, tuple] = {}
        self.mask_rows: set[int] = set()

    # -- the plan ------------------------------------------------------------------------------
    def apply(self, plan) -> dict:
        """Moves, frees, starts and tables of ``plan`` (scheduler.Plan); the started sequences
        whose settings were refused, each with its error (it alone fails)."""
        for src, dst in plan.moved:
            for name in self._REQUEST:
                t = getattr(self, name)
                t[dst] = t[src]
            self.free(src)
            self.written.pop(dst, None)
            self.holders.pop(dst, None)  # its copy holds another sequence: gathered anew
        for row in plan.freed:
            self.free(row)
        failed = {}
        for seq in plan.started:
            try:
                self._settings(seq.row, seq.params, seq.tokens, seq.generated)
                self.rope_delta[seq.row] = delta_of(seq.images)
            except Exception as exc:  # noqa: BLE001 - this request's own settings: it alone fails
                failed[seq] = exc
        self._tables([*plan.decode, *(s for s, _ in plan.spec), *(p.seq for p in plan.pieces)])
        self.pause([s.row for s, _ in plan.spec])  # verified apart, after the decode steps
        return failed

    def free(self, row: int) -> None:
        """``row`` holds no sequence: it stops, its table points at the null block (its writes
        land where nobody reads)."""
        self.live[row], self.positions[row], self.lora[row] = False, 0, 0
        self.finish[row] = RUNNING
        host = self.host_tables
        host[row] = 0
        if host is not self.tables:
            self.tables[row] = 0
        self.written.pop(row, None)
        self.holders.pop(row, None)

    def _tables(self, seqs) -> None:
        dirty = False
        for seq in seqs:
            blocks = seq.table.blocks
            if self.written.get(seq.row) != blocks:
                host = self.host_tables
                host[seq.row, : len(blocks)] = torch.tensor(blocks, dtype=host.dtype)
                host[seq.row, len(blocks) :] = 0
                self.written[seq.row] = list(blocks)
                dirty = True
        if dirty and self.host_tables is not self.tables:
            self.tables.copy_(self.host_tables, non_blocking=True)

    def _settings(self, row: int, params, tokens: list[int], generated: int) -> None:
        """Row ``row`` samples for a request with ``params`` whose tokens so far are ``tokens``
        (its prompt, or prompt and output when recomputed after preemption), the last
        ``generated`` of them its output (what the presence/frequency penalties count)."""
        vocab = self.bias.shape[1]
        if params.logit_bias and max(t for t, _ in params.logit_bias) >= vocab:
            raise ConfigError(
                f"logit_bias names token {max(t for t, _ in params.logit_bias)}, past the "
                f"model's vocabulary ({vocab} tokens).",
                hint="bias ids of the model's own tokenizer",
            )
        self.temperature[row], self.top_k[row] = params.temperature, params.top_k
        self.top_p[row], self.penalty[row] = params.top_p, params.repetition_penalty
        self.seed[row] = params.seed
        self.presence[row], self.frequency[row] = params.presence_penalty, params.frequency_penalty
        self.seen[row] = False
        if params.repetition_penalty != 1.0:
            self.seen[row, torch.tensor(tokens).to(self.device)] = True
        self.counts[row] = 0
        if generated and (params.presence_penalty != 0 or params.frequency_penalty != 0):
            out = torch.tensor(tokens[len(tokens) - generated :])
            self.counts[row] = torch.bincount(out, minlength=vocab).to(self.device, torch.int32)
        self.bias[row] = 0.0
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias[row, torch.tensor(ids).to(self.device)] = torch.tensor(values).to(self.device)
        self.min_tokens[row] = params.min_tokens

    def set_adapters(self, ids: list[int]) -> None:
        """Each row's adapter as batched LoRA's index (0: the base model)."""
        self.lora[: len(ids)].copy_(torch.tensor(ids, dtype=self.lora.dtype))

    def set_masks(self, masks: dict) -> None:
        """The grammar masks of the rows this step samples (row -> its bitmask row, int32), every
        other row all ones; the rows written go up."""
        host, marks = self.host_bitmask, self.host_masked
        touched = self.mask_rows | set(masks)
        for row in self.mask_rows - set(masks):
            host[row].fill_(-1)
            marks[row] = False
        for row, bits in masks.items():
            host[row].copy_(bits)
            marks[row] = True
        self.mask_rows = set(masks)
        if touched and host is not self.bitmask:
            n = max(touched) + 1
            self.bitmask[:n].copy_(host[:n], non_blocking=True)
            self.masked[:n].copy_(marks[:n], non_blocking=True)

    def fresh_windows(self, seqs) -> list[int]:
        """The rows of ``seqs`` (decoding now) whose eager copy holds another sequence (a new
        one, or one recomputed after preemption): gathered before the run."""
        holders = {s.row: (s.id, s.preemptions) for s in seqs}
        fresh = [r for r, who in holders.items() if self.holders.get(r) != who]
        self.holders.update(holders)
        return fresh

    # -- on the device -------------------------------------------------------------------------
    def params(self, rows, counter: torch.Tensor, needs: Needs) -> RowParams:
        """The sampling settings of ``rows`` (a slice, or row indices); ``counter``: each row's
        tokens generated so far (its noise's counter)."""
        return RowParams(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.penalty[rows],
            self.seed[rows],
            counter,
            self.seen[rows],
            self.presence[rows],
            self.frequency[rows],
            self.counts[rows] if needs.penalties else None,
            self.bitmask[rows] if needs.constraints else None,
            self.masked[rows] if needs.constraints else None,
            self.bias[rows] if needs.biased else None,
            self.min_tokens[rows],
            self.end_ids,
        )

    def ended(self, tokens: torch.Tensor, count: torch.Tensor, rows) -> torch.Tensor:
        """The one rule of a sequence's end on the device: why each of ``rows`` stops after
        ``tokens``, its ``count``-th (RUNNING: it goes on): an end token it does not ignore, else
        its budget spent."""
        eos = torch.isin(tokens, self.eos) & ~self.ignore_eos[rows]
        spent = count >= self.budget[rows]
        return torch.where(eos, END_TOKEN, torch.where(spent, BUDGET, RUNNING))

    def begin(self, row: int, token: torch.Tensor, position: int, generated: int, params) -> None:
        """Row ``row`` decodes from ``token`` (on the device: the first token of its answer, or
        the next one after a recompute) at ``position``, its ``generated``-th."""
        self.tokens[row : row + 1] = token
        self.positions[row], self.generated[row] = position, generated
        self.budget[row], self.ignore_eos[row] = params.max_new_tokens, params.ignore_eos
        why = self.ended(token, self.generated[row : row + 1], slice(row, row + 1))
        self.finish[row : row + 1] = why
        self.live[row : row + 1] = why == RUNNING

    def advance(self, rows: int, nxt: torch.Tensor, live: torch.Tensor, pos: torch.Tensor):
        """The first ``rows`` rows chose ``nxt`` (those ``live`` at the step's start, at ``pos``):
        each live row feeds it next, one position on, and stops where ``ended`` says."""
        generated = self.generated[:rows]
        count = generated + 1
        why = self.ended(nxt, count, slice(0, rows))
        self.tokens[:rows] = torch.where(live, nxt, self.tokens[:rows])
        self.positions[:rows] = pos + live.long()
        self.generated[:rows] = torch.where(live, count, generated)
        self.finish[:rows] = torch.where(live, why, self.finish[:rows])
        self.live[:rows] = live & (why == RUNNING)

    def observe(self, rows: torch.Tensor, tokens: torch.Tensor, live: torch.Tensor, needs: Needs):
        """Rows ``rows`` (indices) chose ``tokens`` (where ``live``): the penalties see them. The
        counts are only kept while a penalising row runs: a row that does not penalise multiplies
        its (stale) counts by 0, and a row that does has them kept at every step it runs."""
        if needs.penalty:
            self.seen[rows, tokens] = self.seen[rows, tokens] | live
        if needs.penalties:
            count_tokens(self.counts, tokens, live, rows)

    def pause(self, rows: list[int]) -> None:
        """``rows`` (speculative this step: verified apart) sit out the step's decode steps, which
        leave a row that is not live as it is; ``settle`` sets them going again."""
        if rows:
            self.live[torch.tensor(rows).to(self.device)] = False

    def settle(self, rows: list[int], tokens: torch.Tensor, accepted: torch.Tensor, needs: Needs):
        """``rows`` verified proposals: ``tokens [len(rows), k + 1]`` the target's
        token at each position, of which the first ``accepted + 1`` are kept. Each row's run ends
        at the first of them ``ended`` stops it at; the row then decodes from its last kept token
        one position per token on (as a row that just finished its prompt, ``begin``), and the
        penalties see the kept tokens. The kept tokens, -1 past them ``[len(rows), k + 1]``."""
        at = torch.tensor(rows, dtype=torch.long).to(self.device)
        width = tokens.shape[1]
        offsets = torch.arange(width, device=tokens.device)[None]
        generated = self.generated[at]
        why = self.ended(tokens, generated[:, None] + offsets + 1, at[:, None])
        stops = (why != RUNNING) & (offsets <= accepted[:, None])
        # the first stop within the accepted run, else the run's last token
        end = torch.where(stops, offsets, width).amin(-1).clamp_max(accepted)
        kept = offsets <= end[:, None]
        last = tokens.gather(1, end[:, None])[:, 0]
        self.tokens[at] = last
        self.positions[at] = self.positions[at] + end + 1
        self.generated[at] = generated + end + 1
        code = why.gather(1, end[:, None])[:, 0]
        self.finish[at], self.live[at] = code, code == RUNNING
        for row in rows:
            self.holders.pop(row, None)  # its eager copy lacks the verified positions
        flat_rows = at[:, None].expand(-1, width).reshape(-1)
        self.observe(flat_rows, tokens.reshape(-1), kept.reshape(-1), needs)
        return torch.where(kept, tokens, -1)

    def record(self, column: int, rows: int, tokens: torch.Tensor, logprobs=None) -> None:
        """A decode step's tokens (and their logprobs ``(chosen, top ids, top logprobs)`` when the
        step computed them), kept on the device until the step's read-back."""
        self.out[:rows, column] = tokens
        if logprobs is not None:
            chosen, ids, values = logprobs
            self.chosen[:rows, column] = chosen
            self.top_ids[:rows, column] = ids
            self.top_logprobs[:rows, column] = values

    # -- to the host ---------------------------------------------------------------------------
    def read_back(self, rows: int, steps: int, decode, firsts, spec=()) -> ReadBack:
        """One device-to-host copy: each decode row's tokens (those it made while live) and its
        finish code, the first token of each prompt finished (``firsts``: prefill.First) and its
        row's code, the kept tokens of each speculative row (``spec``: (sequence, [k + 1] tokens,
        -1 past the kept ones)) and its code, and the logprob records of the rows that asked: per
        token its own logprob, the top ids, their logprobs (``1 + 2 * top`` numbers), the decode
        rows' first."""
        decode_rows = torch.tensor([s.row for s in decode], dtype=torch.long).to(self.device)
        first_rows = torch.tensor([f.seq.row for f in firsts], dtype=torch.long).to(self.device)
        parts = [self.out[:rows, :steps].reshape(-1), self.finish[decode_rows]]
        if firsts:
            parts += [torch.stack([f.token for f in firsts]), self.finish[first_rows]]
        if spec:
            spec_rows = torch.tensor([s.row for s, _ in spec], dtype=torch.long).to(self.device)
            parts += [torch.cat([t for _, t in spec]), self.finish[spec_rows]]
        asking = [s for s in decode if s.params.logprobs is not None]
        firsts_asking = [f for f in firsts if f.logprobs is not None]
        if asking or firsts_asking:
            # the values ride in the same copy as the tokens: all as float64, which holds both
            # a token id and a float32 logprob exactly
            parts = [p.double() for p in parts] + self._logprobs(steps, asking, firsts_asking)
        flat = torch.cat(parts).tolist()
        n, k = rows * steps, len(decode)
        ids = [int(t) for t in flat[:n]]
        tokens = {
            s: [t for t in ids[s.row * steps : (s.row + 1) * steps] if t >= 0] for s in decode
        }
        finish = {s: int(c) for s, c in zip(decode, flat[n : n + k], strict=True)}
        at = n + k
        first_tokens = {}
        if firsts:
            m = len(firsts)
            first_tokens = {f.seq: [int(t)] for f, t in zip(firsts, flat[at : at + m], strict=True)}
            finish.update(
                {f.seq: int(c) for f, c in zip(firsts, flat[at + m : at + 2 * m], strict=True)}
            )
            at += 2 * m
        if spec:
            for seq, kept in spec:
                width = kept.shape[0]
                tokens[seq] = [int(t) for t in flat[at : at + width] if t >= 0]
                at += width
            finish.update(
                {s: int(c) for (s, _), c in zip(spec, flat[at : at + len(spec)], strict=True)}
            )
            at += len(spec)
        return ReadBack(tokens, first_tokens, finish, flat[at:])

    def _logprobs(self, steps: int, asking, firsts) -> list:
        parts = []
        if asking:
            at = torch.tensor([s.row for s in asking]).to(self.device)
            for buf in (self.chosen, self.top_ids, self.top_logprobs):
                parts.append(
                    buf[:, :steps].index_select(0, at).double().reshape(len(asking), steps, -1)
                )
            parts = [torch.cat(parts, dim=-1).reshape(-1)]
        for f in firsts:
            chosen, ids, values = f.logprobs
            parts.append(torch.cat([chosen[None].double(), ids.double(), values.double()]))
        return parts


def finish_reason(code: int) -> Optional[str]:
    """A row's finish code as the request's reason (None: it goes on)."""
    return {END_TOKEN: "stop", BUDGET: "length"}.get(code)
