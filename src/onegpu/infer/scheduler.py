"""Which sequences run in the next engine step, under a token budget: the decode rows (one token
each) and pieces of prompts (several tokens each), and how many decode steps run before the host
looks again.

- Admission counts free blocks, not worst-case sequences: a request is admitted when a decode row
  is free and the blocks its prompt still needs (after its longest cached prefix) are free, beside
  the blocks the running sequences take in their next ``sync_every`` decode steps (the most a step
  runs before the next plan; as vLLM, no more is held back: a sequence that cannot grow later
  preempts the youngest).
- A prompt is computed in pieces that end at multiples of ``chunk`` positions of its own, one or
  more per step as the budget allows, so a long prompt never stalls the running streams for its
  whole prefill and its pieces are the same whatever else runs.
- Running sequences hold the lowest rows: when one ends below another, the one in the highest row
  moves down into its row (``Plan.moved``), so a decode step's first rows are all live — a row
  left empty below a running one would be computed for nothing at every step (vLLM builds each
  step's batch of the running sequences alone).
- When a running sequence cannot grow (no free block), the youngest running sequence is
  preempted: its blocks are released (their hashes stay: much of it is found in the cache when it
  comes back) and it waits at the head of the queue to be computed again from its prompt and the
  tokens it had made (vLLM's recompute). A lone sequence always fits the pool (the engine checks
  it at start), so no request ever fails for lack of blocks.

Sequences are served first come, first served: the oldest waiting one is admitted first, and the
youngest running one gives way first. The oldest waiting one waits while the next block of its
prompt is one a running sequence is still computing (many requests with one system prompt
arriving at once): admitted a step later, it finds that block in the cache instead of computing
it again.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

from onegpu.infer.images import PromptImages, piece_end, usable_prefix
from onegpu.infer.kv_blocks import BlockPool, BlockTable
from onegpu.infer.requests import SamplingParams

WAITING, PREFILL, DECODE = "waiting", "prefill", "decode"


@dataclass(eq=False)  # one object per request: compared (and hashed) by identity
class Sequence:
    """One request as the engine runs it. ``tokens``: prompt and output so far; ``computed``:
    the tokens whose KV is in the cache; ``cache_key``: what its blocks' hashes name besides the
    tokens (the adapter whose weights computed them)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    adapter: Optional[str]
    cache_key: Optional[str]
    tokens: list[int] = field(default_factory=list)
    table: BlockTable = field(default_factory=BlockTable)
    computed: int = 0
    row: int = -1
    state: str = WAITING
    cancelled: bool = False
    preemptions: int = 0
    computing: list[int] = field(default_factory=list)  # its prompt's block hashes, in PREFILL
    images: Optional[PromptImages] = None  # the prompt's images (infer/images.py)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass
class Piece:
    """Tokens ``[start, end)`` of ``seq.tokens`` to compute; ``last``: they end its prefill (the
    step samples its next token from the last one's logits)."""

    seq: Sequence
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.seq.tokens)

    def writes(self, block_size: int) -> list[int]:
        """The blocks of ``seq``'s table this piece writes KV into."""
        return self.seq.table.blocks[self.start // block_size : -(-self.end // block_size)]


@dataclass(frozen=True)
class Plan:
    """One step's work, a value: the decode rows' sequences and the decode steps they run, the
    prompt pieces in order, the sequences that took a row, the rows preempted sequences gave
    back, the rows moved (from, to; applied first), and the speculative rows: decode sequences
    whose next positions are verified this step, each with the tokens proposed (their blocks
    hold every position verified; they are not among ``decode``)."""

    decode: tuple[Sequence, ...] = ()
    steps: int = 0
    pieces: tuple[Piece, ...] = ()
    started: tuple[Sequence, ...] = ()
    freed: tuple[int, ...] = ()
    moved: tuple[tuple[int, int], ...] = ()
    spec: tuple[tuple[Sequence, tuple[int, ...]], ...] = ()


@dataclass
class _Draft:
    """A plan while the scheduler builds it (a preemption takes a sequence out of it)."""

    decode: list[Sequence] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    moved: list[tuple[int, int]] = field(default_factory=list)
    spec: list[tuple[Sequence, tuple[int, ...]]] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    rows: int
    """Sequences running at once at most (decode rows)."""
    token_budget: int
    """Tokens computed in one engine step (decode rows + prompt pieces)."""
    chunk: int
    """The longest prompt piece; pieces end at multiples of it."""
    sync_every: int
    """Decode steps in an engine step that computes no prompt piece."""
    compact: bool = True
    """Move running sequences down into the rows ended ones left below them."""


class Scheduler:
    def __init__(self, pool: BlockPool, config: SchedulerConfig):
        self.pool, self.config = pool, config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # by id: the oldest first
        self.free_rows = list(range(config.rows))
        self.preemptions = 0
        self.computing: Counter = Counter()  # hashes of the prompt blocks being computed

    def add(self, seq: Sequence) -> None:
        seq.tokens = list(seq.prompt)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self, most_steps: Optional[int] = None, propose=None) -> Plan:
        """This step's work. ``most_steps`` caps the decode steps of a step with no prompt to
        compute below sync_every (the engine's flush_ms). ``propose``: a decode sequence -> the
        tokens to verify for it this step (speculative decoding; () for none): a step with any
        runs one decode step for the other rows."""
        plan = _Draft()
        if self.config.compact:
            self._compact(plan)
        decoding = [s for s in self.running if s.state == DECODE]
        # a prompt to compute (one running, or one waiting with a row free for it): one decode
        # step beside its piece; a request with a grammar: one step, so the host advances its
        # matcher before the next token's mask; else sync_every before the host looks again
        # a waiting request counts only where the pool has its blocks: one that must wait for a
        # sequence to end would otherwise hold every step to one decode step, read back each
        prefill_work = any(s.state == PREFILL for s in self.running)
        prefill_work = prefill_work or bool(
            self.waiting and self.free_rows and self._fits(self.waiting[0]) is not None
        )
        guided = any(s.params.constraint is not None for s in self.running)
        steps = 1 if prefill_work or guided else self.config.sync_every
        if most_steps is not None:
            steps = max(1, min(steps, most_steps))
        if decoding:
            left = min(s.params.max_new_tokens - s.generated for s in decoding)
            steps = max(1, min(steps, left))
        proposed = {s: tuple(propose(s)) for s in decoding} if propose else {}
        if any(proposed.values()):
            steps = 1
        for seq in decoding:
            guess = proposed.get(seq, ())
            if seq.state == DECODE and self._grow(seq, seq.computed + steps + len(guess), plan):
                if guess:
                    plan.spec.append((seq, guess))
                else:
                    plan.decode.append(seq)
        budget = self.config.token_budget - len(plan.decode)
        budget -= sum(len(guess) + 1 for _, guess in plan.spec)
        for seq in [s for s in self.running if s.state == PREFILL]:
            budget = self._piece(seq, budget, plan)
        while budget > 0 and self.waiting and self.free_rows and self._admit(self.waiting[0], plan):
            budget = self._piece(self.waiting.popleft(), budget, plan)
        return Plan(
            tuple(plan.decode),
            steps if plan.decode else 0,
            tuple(plan.pieces),
            tuple(plan.started),
            tuple(plan.freed),
            tuple(plan.moved),
            tuple(plan.spec),
        )

    def _compact(self, plan: _Draft) -> None:
        """While a row below a running sequence's is free, the sequence of the highest row
        moves into the lowest free row (before anything else is planned: admissions then take
        the rows above the running ones). Moving the highest each time, no row moves twice."""
        while self.free_rows and self.running:
            top = max(self.running, key=lambda s: s.row)
            if self.free_rows[0] > top.row:
                return
            hole = self.free_rows.pop(0)
            self.free_rows.append(top.row)
            self.free_rows.sort()
            plan.moved.append((top.row, hole))
            top.row = hole

    def _piece(self, seq: Sequence, budget: int, plan: _Draft) -> int:
        """Schedule ``seq``'s next piece if the budget holds it (the first piece of a step always
        goes, so a prompt always advances); the budget left."""
        if seq.state != PREFILL:
            return budget
        chunk = self.config.chunk
        end = min(len(seq.tokens), (seq.computed // chunk + 1) * chunk)
        end = piece_end(seq.images, seq.computed, end, len(seq.tokens))
        if end - seq.computed > budget and plan.pieces:
            return budget
        plan.pieces.append(Piece(seq, seq.computed, end))
        # its blocks are found from now on: a piece later in this step that reads them runs
        # after this one has written them (the runner keeps the plan's order)
        self.pool.register(seq.table, seq.tokens[:end], seq.cache_key)
        return budget - (end - seq.computed)

    def _fits(self, seq: Sequence) -> Optional[list[int]]:
        """The cached blocks of ``seq``'s prompt if the pool holds the rest of it beside the
        running sequences' next growth (``_growth``), else None."""
        pool = self.pool
        # the last token is always computed: its logits choose the next one; a request that
        # asks for its prompt's logprobs computes all of it (a cached block kept no logits)
        every = seq.params.prompt_logprobs is not None
        cached = [] if every else pool.match(seq.tokens, seq.cache_key, len(seq.tokens) - 1)
        cached = cached[: usable_prefix(seq.images, len(cached), pool.block_size)]
        if not every and self._being_computed(seq, len(cached)):
            return None
        reviving = sum(1 for b in cached if pool.ref(b) == 0)  # cached but free: they count
        fresh = pool.blocks_for(len(seq.tokens)) - len(cached)
        return cached if fresh + reviving + self._growth() <= pool.free_count() else None

    def _growth(self) -> int:
        """The blocks the running sequences take in their next ``sync_every`` decode steps."""
        ahead = self.config.sync_every + 1
        return sum(
            max(0, self.pool.blocks_for(s.computed + ahead) - len(s.table.blocks))
            for s in self.running
            if s.state == DECODE
        )

    def _admit(self, seq: Sequence, plan: _Draft) -> bool:
        """Give ``seq`` a row and the blocks of its whole prompt (its cached prefix taken from the
        cache), if free; False leaves it waiting."""
        pool = self.pool
        cached = self._fits(seq)
        if cached is None:
            return False
        fresh = pool.blocks_for(len(seq.tokens)) - len(cached)
        pool.count_query(len(seq.tokens), len(cached) * pool.block_size)
        pool.acquire(cached)
        seq.table.blocks = cached + pool.allocate(fresh)
        seq.computed = len(cached) * pool.block_size
        pool.register(seq.table, seq.tokens[: seq.computed], seq.cache_key)
        seq.row, seq.state = self.free_rows.pop(0), PREFILL
        self._computes(seq, +1)
        self.running.append(seq)
        self.running.sort(key=lambda s: s.id)
        plan.started.append(seq)
        return True

    def _being_computed(self, seq: Sequence, found: int) -> bool:
        """Whether the block after the ``found`` cached ones is one a running sequence is
        computing (it would be found in the cache a step or two from now)."""
        size = self.pool.block_size
        if not self.computing or (found + 1) * size > len(seq.tokens) - 1:
            return False
        return self.pool.chain(seq.tokens, seq.cache_key, found + 1)[-1] in self.computing

    def _computes(self, seq: Sequence, sign: int) -> None:
        """Count (+1, at admission) or uncount (-1, when it leaves PREFILL) the hashes of
        ``seq``'s prompt blocks while it is computed."""
        if sign > 0 and self.pool.caching:
            full = (len(seq.tokens) - 1) // self.pool.block_size
            seq.computing = self.pool.chain(seq.tokens, seq.cache_key, full)
        for digest in seq.computing:
            self.computing[digest] += sign
            if self.computing[digest] <= 0:
                del self.computing[digest]
        if sign < 0:
            seq.computing = []

    def _grow(self, seq: Sequence, positions: int, plan: _Draft) -> bool:
        """Blocks for ``positions`` of ``seq``, preempting the youngest running sequences while
        none are free; False when ``seq`` itself was the one preempted."""
        need = self.pool.blocks_for(positions) - len(seq.table.blocks)
        while need > self.pool.free_count():
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        if need > 0:
            seq.table.blocks += self.pool.allocate(need)
        return True

    def _preempt(self, seq: Sequence, plan: _Draft) -> None:
        if seq.state == PREFILL:
            self._computes(seq, -1)
        self.pool.release(seq.table)
        plan.freed.append(seq.row)
        self._leave(seq)
        seq.computed, seq.state = 0, WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        if seq in plan.decode:
            plan.decode.remove(seq)
        plan.spec = [(s, guess) for s, guess in plan.spec if s is not seq]

    def _leave(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_rows.append(seq.row)
        self.free_rows.sort()
        seq.row = -1

    # ------------------------------------------------------------------ after a step
    def computed(self, seq: Sequence, upto: int) -> None:
        """``seq``'s KV now holds its first ``upto`` tokens: hash its newly full blocks."""
        seq.computed = upto
        self.pool.register(seq.table, seq.tokens[:upto], seq.cache_key)

    def extend(self, seq: Sequence, tokens: list[int]) -> None:
        """``seq`` made ``tokens``: its KV holds every token before the last. A sequence's first
        tokens after its prompt (or after its recompute) start its decoding: only then, not when
        a piece happens to end one token short of its prompt's end (that piece does not sample)."""
        seq.tokens += tokens
        if seq.state == PREFILL:
            self._computes(seq, -1)
            seq.state = DECODE
        self.computed(seq, len(seq.tokens) - 1)

    def trim(self, seq: Sequence) -> None:
        """After a speculative step: the blocks past those ``seq``'s tokens need (the positions
        of the tokens it rejected) go back to the pool."""
        self.pool.release_tail(seq.table, self.pool.blocks_for(len(seq.tokens)))

    def finish(self, seq: Sequence) -> None:
        """``seq`` ended (or was cancelled): its row and blocks go back."""
        if seq in self.running:
            if seq.state == PREFILL:
                self._computes(seq, -1)
            self.pool.release(seq.table)
            self._leave(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.state = WAITING
