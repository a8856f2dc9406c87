"""The KV cache's bookkeeping on the host: one pool of fixed-size blocks, each sequence's block
table, prefix hashing, reference counts and an LRU of cached free blocks. No torch here: the
tensors the blocks index live in ``paged_cache.py``.

The shape is nano-vllm's ``block_manager.py`` and vLLM v1's KV cache manager:

- a full block is named by a hash of (its parent's hash, its token ids, the adapter that computed
  it and the images whose placeholders it holds: ``SpanKeys``), so a hash names the whole prefix
  up to the block's end and what produced it;
  its key is kept beside it and compared on every hit, so a hash collision is a miss, not a
  wrong answer;
- a block is shared by reference count; at 0 it goes to the end of the free list but keeps its
  hash: a later request with the same prefix takes it back from there (a prefix cache hit), and
  a block is evicted only when it is the oldest free one and memory is needed;
- a sequence's blocks are released tail first, so the tails of prefixes go before their heads;
- block 0 is never handed out: rows of a decode batch that hold no sequence point their block
  tables at it, so their writes land where nobody reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Optional

NULL_BLOCK = 0


@dataclass(frozen=True)
class SpanKeys:
    """A sequence's key where it varies along it: ``base`` (its adapter's) in every block, and in
    each block that holds positions of a span ``(start, end, key)`` that span's key too (a
    prompt's images: infer/images.py). A block after a span carries it in its parent's hash."""

    base: Hashable
    spans: tuple[tuple[int, int, Hashable], ...] = ()

    def at(self, block: int, size: int) -> Hashable:
        lo, hi = block * size, (block + 1) * size
        inside = tuple(key for start, end, key in self.spans if start < hi and end > lo)
        return (self.base, inside) if inside else self.base


def block_key(key: Hashable, block: int, size: int) -> Hashable:
    """What block ``block`` of a sequence with ``key`` is hashed by beside its tokens."""
    return key.at(block, size) if isinstance(key, SpanKeys) else key


@dataclass
class PrefixStats:
    """Prefix-cache lookups, in tokens, as vLLM's ``prefix_cache_queries`` / ``_hits``."""

    queries: int = 0
    hits: int = 0


@dataclass
class _Block:
    ref: int = 0
    hash: Optional[int] = None
    key: Optional[tuple] = None  # (parent hash, token ids, block_key): what the hash names


@dataclass
class BlockTable:
    """One sequence's blocks, in order, and how many of them are full and hashed."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of blocks[: len(hashes)], all full

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` positions (block 0 reserved). ``caching`` False:
    blocks are never hashed, so no prefix is ever shared (``onegpu serve --prefix_caching
    false``)."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a pool needs 2 blocks of 1 position: {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._blocks[NULL_BLOCK].ref = 1  # never free
        # free blocks, oldest first: the next to be handed out (and lose its hash) is the first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._by_hash: dict[int, int] = {}
        self.stats = PrefixStats()
        # one past the highest block ever handed out: never-used blocks sit at the front of the
        # free list in order, so they are handed out in order, before any freed one
        self.high_water = 1

    # ------------------------------------------------------------------ counting
    @property
    def usable(self) -> int:
        """Blocks a sequence can hold (all but the null block)."""
        return self.num_blocks - 1

    def free_count(self) -> int:
        return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def match(self, tokens: Sequence[int], adapter: Hashable, limit: int) -> list[int]:
        """The cached blocks that hold the longest prefix of ``tokens`` within the first
        ``limit`` tokens (whole blocks only). Takes no reference: ``acquire`` does."""
        if not self.caching:
            return []
        found, parent = [], None
        size = self.block_size
        for start in range(0, limit - size + 1, size):
            key = self._key(parent, tokens, adapter, start // size)
            block = self._by_hash.get(hash(key))
            if block is None or self._blocks[block].key != key:
                break
            found.append(block)
            parent = self._blocks[block].hash
        return found

    def chain(self, tokens: Sequence[int], adapter: Hashable, blocks: int) -> list[int]:
        """The hashes the first ``blocks`` full blocks of ``tokens`` have (or will have) once
        computed."""
        out, parent = [], None
        for i in range(blocks):
            parent = hash(self._key(parent, tokens, adapter, i))
            out.append(parent)
        return out

    def _key(self, parent: Optional[int], tokens: Sequence[int], adapter: Hashable, i: int):
        """What block ``i`` of ``tokens`` is named by: its parent's hash, its tokens, its key."""
        size = self.block_size
        return (parent, tuple(tokens[i * size : (i + 1) * size]), block_key(adapter, i, size))

    def count_query(self, queried: int, hit: int) -> None:
        self.stats.queries += queried
        self.stats.hits += hit

    def register(self, table: BlockTable, tokens: Sequence[int], adapter: Hashable) -> None:
        """Hash the blocks of ``table`` that ``tokens`` (the sequence's tokens whose KV is in the
        cache) fill and that are not hashed yet, so later requests can find them."""
        if not self.caching:
            return
        size = self.block_size
        full = min(len(tokens) // size, len(table.blocks))
        for i in range(len(table.hashes), full):
            parent = table.hashes[-1] if table.hashes else None
            key = self._key(parent, tokens, adapter, i)
            digest = hash(key)
            block = self._blocks[table.blocks[i]]
            if block.hash is None:  # a block taken from the cache keeps the hash it has
                block.hash, block.key = digest, key
                self._by_hash.setdefault(digest, table.blocks[i])
            table.hashes.append(digest)

    def forget(self, blocks: list[int]) -> None:
        """Forget the hashes of ``blocks`` (a failed computation left them without their KV):
        no later request finds them; their holders keep them."""
        for b in blocks:
            block = self._blocks[b]
            if block.hash is not None and self._by_hash.get(block.hash) == b:
                del self._by_hash[block.hash]
            block.hash = block.key = None

    def reset_cache(self) -> None:
        """Forget every hash (the weights changed: a cached block no longer holds their KV).
        Blocks in use stay with their sequences; they are simply no longer found."""
        self._by_hash.clear()
        for block in self._blocks:
            block.hash = block.key = None

    # ------------------------------------------------------------------ allocation
    def acquire(self, blocks: list[int]) -> None:
        """Take a reference to each of ``blocks`` (found by ``match``)."""
        for b in blocks:
            block = self._blocks[b]
            if block.ref == 0:
                del self._free[b]
            block.ref += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (the oldest free first; a cached one loses its hash). The caller
        checks ``free_count`` first: asking for more than is free is a bug."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            block = self._blocks[b]
            if block.hash is not None and self._by_hash.get(block.hash) == b:
                del self._by_hash[block.hash]
            block.hash = block.key = None
            block.ref = 1
            out.append(b)
            self.high_water = max(self.high_water, b + 1)
        return out

    def release(self, table: BlockTable) -> None:
        """Drop the sequence's references, tail first; its hashed blocks stay findable until
        evicted."""
        for b in reversed(table.blocks):
            block = self._blocks[b]
            block.ref -= 1
            if block.ref == 0:
                self._free[b] = None
        table.blocks.clear()
        table.hashes.clear()

    def release_tail(self, table: BlockTable, keep: int) -> None:
        """Drop the references to the blocks of ``table`` past its first ``keep`` (positions a
        speculative step computed for tokens it then rejected), tail first. They hold no hash:
        only blocks full of accepted tokens are hashed (``register``)."""
        for b in reversed(table.blocks[keep:]):
            block = self._blocks[b]
            block.ref -= 1
            if block.ref == 0:
                self._free[b] = None
        del table.blocks[keep:]
        del table.hashes[keep:]

    def ref(self, block: int) -> int:
        return self._blocks[block].ref
