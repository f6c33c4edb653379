"""The KV cache's blocks on the driver: reference counts, prefix caching and copy-on-write.

A block holds ``block_size`` consecutive tokens' keys and values. Several sequences may hold
the same block: the ``n`` sequences of one request share their prompt's blocks, and with prefix
caching requests whose prompts begin alike share the blocks of that beginning. A block goes
back when its last holder lets go.

Prefix caching. A *full* block is known by a hash of its tokens, the hash of the block before it
(so of every token before it) and the served adapter that computed it (a LoRA adapter changes
keys and values). A full block that no sequence holds any more stays in the cache, evictable,
and a new sequence whose prompt begins with the same blocks takes them instead of computing
them again. When no block is free the least recently released cached block is evicted.

Copy-on-write. A sequence writes only its last block. When that block is shared (the ``n``
sequences of one prompt after the prefill), the writer gets a block of its own, and the step
copies the shared block's slots into it on every rank first (:meth:`BlockManager.writable`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tessera.inference.cache import OutOfBlocksError


def block_hash(parent: int | None, tokens: Sequence[int], adapter: int) -> int:
    """The key of a full block: its tokens after the block keyed ``parent`` (None: the first)."""
    return hash((parent, tuple(tokens), adapter))


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` slots with reference counts and, when
    ``prefix_caching``, a cache of full blocks by content (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs at least one block of one slot, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # never cached (or evicted): pop() hands out block 0 first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> its content key, for cached blocks
        self._by_hash: dict[int, int] = {}  # content key -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no one holds, oldest first
        self.hit_blocks = 0  # full prompt blocks found in the cache
        self.queried_blocks = 0  # full prompt blocks looked up

    # ---- counts ----------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """Blocks a sequence can be given now (free, or cached and held by no one)."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        """Full blocks kept for their content (held or not)."""
        return len(self._hash_of)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` slots."""
        return -(-tokens // self.block_size)

    def refs(self, block: int) -> int:
        return self._refs[block]

    # ---- taking and giving back ------------------------------------------------------------
    def allocate(self) -> int:
        """A block of one's own: a free one, else the least recently released cached one."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        else:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        self._refs[block] = 1
        return block

    def allocate_many(self, count: int) -> list[int]:
        if count > self.free:
            raise OutOfBlocksError(f"asked for {count} KV blocks, {self.free} of {self.num_blocks} are free")
        return [self.allocate() for _ in range(count)]

    def share(self, blocks: Sequence[int]) -> list[int]:
        """Another holder of ``blocks`` (a forked sequence): the same blocks, one more reference."""
        for block in blocks:
            self._take(block)
        return list(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        """Let go of ``blocks``: a block no one holds is free again, or (cached) evictable."""
        for block in reversed(blocks):  # a sequence's last blocks are evicted first
            if self._refs[block] < 1:
                raise ValueError(f"KV block {block} is not in use: released twice or never allocated")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    # ---- copy-on-write ---------------------------------------------------------------------
    def writable(self, blocks: list[int], index: int) -> tuple[int, int] | None:
        """Make ``blocks[index]`` this sequence's own before it writes there: when shared, a new
        block replaces it in ``blocks`` and ``(source, new)`` is returned (the slots to copy);
        else None. A cached full block is never written (writes go past a sequence's end)."""
        block = blocks[index]
        if self._refs[block] == 1:
            return None
        new = self.allocate()
        self.release([block])
        blocks[index] = new
        return block, new

    # ---- prefix caching --------------------------------------------------------------------
    def match(self, tokens: Sequence[int], adapter: int, limit: int) -> tuple[list[int], list[int]]:
        """The cached blocks that begin ``tokens`` (at most ``limit`` tokens' worth, whole
        blocks), taken for the caller, and the keys of every full block of ``tokens[:limit]``
        (which the caller registers as it computes them)."""
        keys = self.keys(tokens, adapter, limit)
        found: list[int] = []
        if self.prefix_caching:
            for key in keys:
                block = self._by_hash.get(key)
                if block is None:
                    break
                self._take(block)
                found.append(block)
            self.queried_blocks += len(keys)
            self.hit_blocks += len(found)
        return found, keys

    def keys(self, tokens: Sequence[int], adapter: int, limit: int | None = None) -> list[int]:
        """The content keys of the full blocks of ``tokens[:limit]``."""
        size = self.block_size
        end = len(tokens) if limit is None else min(limit, len(tokens))
        keys: list[int] = []
        parent: int | None = None
        for start in range(0, end - size + 1, size):
            parent = block_hash(parent, tokens[start : start + size], adapter)
            keys.append(parent)
        return keys

    def register(self, block: int, key: int) -> None:
        """``block`` is full and holds the content ``key``: keep it for later requests (unless
        another block already holds that content)."""
        if not self.prefix_caching or block in self._hash_of or key in self._by_hash:
            return
        self._hash_of[block] = key
        self._by_hash[key] = block

    @property
    def hit_rate(self) -> float:
        """Full prompt blocks found in the cache over those looked up (0 before any lookup)."""
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0
