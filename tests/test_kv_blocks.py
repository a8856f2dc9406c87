"""The KV pool's bookkeeping (infer/kv_blocks.py): blocks shared by reference count, a full block
found again by (its parent, its tokens, the adapter), freed blocks kept findable until memory is
needed (the oldest first, a sequence's tail before its head), and nothing found with caching off
or after a reset."""

from __future__ import annotations

import pytest

from onegpu.infer.kv_blocks import NULL_BLOCK, BlockPool, BlockTable

TOKENS = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 and 8 more


def _seq(pool: BlockPool, tokens, adapter=None) -> BlockTable:
    """A sequence whose KV holds ``tokens``: its cached prefix taken, the rest allocated."""
    table = BlockTable()
    cached = pool.match(tokens, adapter, len(tokens) - 1)
    pool.acquire(cached)
    table.blocks = cached + pool.allocate(pool.blocks_for(len(tokens)) - len(cached))
    pool.register(table, tokens, adapter)
    return table


def test_a_prefix_is_found_block_by_block_and_shared_by_reference():
    pool = BlockPool(10, 16)
    a = _seq(pool, TOKENS)
    assert len(a.blocks) == 3 and NULL_BLOCK not in a.blocks and len(a.hashes) == 2
    # the same first 35 tokens: the two full blocks are found, the third is not (not full)
    assert pool.match(TOKENS[:35], None, 34) == a.blocks[:2]
    # limit: only whole blocks within it (a prompt's last token is always computed)
    assert pool.match(TOKENS[:32], None, 31) == a.blocks[:1]
    b = _seq(pool, TOKENS[:20] + [7] * 20)  # shares the first block only
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert pool.ref(a.blocks[0]) == 2 and pool.ref(a.blocks[1]) == 1
    pool.release(a)
    assert pool.ref(b.blocks[0]) == 1 and pool.free_count() == 9 - len(b.blocks)


def test_the_hash_names_the_parent_the_tokens_and_the_adapter():
    pool = BlockPool(10, 16)
    a = _seq(pool, TOKENS, adapter="one")
    assert pool.match(TOKENS, "two", 39) == []  # other weights computed other KV
    assert pool.match(TOKENS, None, 39) == []
    moved = [0] + TOKENS[1:]  # the second block's tokens alone are the same: its parent differs
    assert pool.match(moved, "one", 39) == []
    assert pool.match(TOKENS, "one", 39) == a.blocks[:2]


def test_a_hash_whose_key_differs_is_a_miss_not_a_wrong_answer():
    pool = BlockPool(10, 16)
    a = _seq(pool, TOKENS)
    pool._blocks[a.blocks[0]].key = ("another prefix with the same hash",)
    assert pool.match(TOKENS, None, 39) == []


def test_freed_blocks_stay_findable_until_needed_oldest_and_tails_first():
    pool = BlockPool(6, 16)  # 5 usable
    a = _seq(pool, TOKENS)  # 3 blocks
    pool.release(a)
    assert pool.free_count() == 5
    assert len(pool.match(TOKENS, None, 39)) == 2  # still cached while free
    pool.allocate(2)  # the two never-used blocks go first
    assert len(pool.match(TOKENS, None, 39)) == 2
    pool.allocate(1)  # then the oldest freed: a's tail (released first), not its head
    assert len(pool.match(TOKENS, None, 39)) == 2
    pool.allocate(1)  # now the second block: the prefix is found up to the first
    assert len(pool.match(TOKENS, None, 39)) == 1
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)


def test_a_cached_free_block_is_taken_back_not_reallocated():
    pool = BlockPool(6, 16)
    a = _seq(pool, TOKENS)
    first = list(a.blocks)
    pool.release(a)
    b = _seq(pool, TOKENS)
    assert b.blocks[:2] == first[:2] and pool.ref(first[0]) == 1
    assert pool.free_count() == 5 - 3


def test_no_prefix_is_found_with_caching_off_or_after_a_reset():
    off = BlockPool(10, 16, caching=False)
    _seq(off, TOKENS)
    assert off.match(TOKENS, None, 39) == []
    pool = BlockPool(10, 16)
    held = _seq(pool, TOKENS)
    pool.reset_cache()
    assert pool.match(TOKENS, None, 39) == []
    pool.release(held)  # blocks in use when the cache was reset go back as usual
    assert pool.free_count() == 9


def test_a_request_the_pool_cannot_hold_yet_does_not_hold_the_decode_to_one_step():
    """A waiting request whose prompt the pool cannot hold yet is no prompt work: the running
    sequences decode sync_every steps between read-backs (one each would read back at every
    token until a sequence ends); one that fits is admitted, with one decode step beside it."""
    from onegpu.infer.requests import SamplingParams
    from onegpu.infer.scheduler import Scheduler, SchedulerConfig, Sequence

    def seq(i: int, length: int) -> Sequence:
        prompt = list(range(100 * i, 100 * i + length))  # no prefix shared with another
        return Sequence(i, prompt, SamplingParams(max_new_tokens=64), None, None)

    sched = Scheduler(BlockPool(7, 16), SchedulerConfig(4, 256, 256, 8))  # 6 usable blocks
    first = seq(0, 40)  # 3 blocks
    sched.add(first)
    assert sched.schedule().pieces[0].seq is first
    sched.extend(first, [7])  # its prompt computed and its first token made: it decodes
    sched.add(seq(1, 50))  # 4 blocks: 3 are free
    plan = sched.schedule()
    assert plan.steps == 8 and plan.decode == (first,) and not plan.pieces
    assert len(sched.waiting) == 1
    small = seq(2, 10)  # 1 block: it fits, and goes ahead of nothing (the queue is in order)
    small.tokens = list(small.prompt)  # as add() sets them
    sched.waiting.appendleft(small)
    plan = sched.schedule()
    assert plan.steps == 1 and [p.seq for p in plan.pieces] == [small]


def test_admission_holds_back_only_the_blocks_the_next_steps_take():
    """A waiting prompt is admitted beside what the running sequences take in their next
    sync_every decode steps, not a block each whatever their need (vLLM admits the same way)."""
    from onegpu.infer.requests import SamplingParams
    from onegpu.infer.scheduler import Scheduler, SchedulerConfig, Sequence

    def run(computed: int) -> bool:
        sched = Scheduler(BlockPool(7, 16), SchedulerConfig(4, 256, 256, 8))  # 6 usable blocks
        first = Sequence(0, list(range(computed)), SamplingParams(max_new_tokens=64), None, None)
        sched.add(first)
        sched.schedule()
        sched.extend(first, [0])  # its first token made: decoding, its KV holding `computed`
        second = Sequence(1, list(range(500, 540)), SamplingParams(max_new_tokens=8), None, None)
        sched.add(second)  # 3 blocks: what is free
        return any(p.seq is second for p in sched.schedule().pieces)

    assert run(39)  # 3 blocks hold its next 8 tokens: nothing held back
    assert not run(44)  # its next 8 tokens need a 4th block: the second waits
