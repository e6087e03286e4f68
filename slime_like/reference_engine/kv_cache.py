"""KV storage of the reference engine: a slot pool for running requests and a radix prefix cache.

Each running request owns one slot of `context_len` positions, so a batched forward only
gathers `[B, Hkv, S, D]` by slot index (no paging). Finished prompts+outputs are copied into
a radix tree over token ids; a new request copies the KV of its longest cached prefix into
its slot and prefills only the rest. Weight updates do not touch the tree: stale KV stays
until `/flush_cache`, as in sglang.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from slime_like.models.config import ModelConfig


class KVPool:
    """`num_slots` x `slot_len` positions of K and V for every layer: [L, 2, slots, Hkv, len, D]."""

    def __init__(self, config: ModelConfig, num_slots: int, slot_len: int,
                 device: torch.device | str, dtype: torch.dtype):
        self.shape = (config.num_hidden_layers, 2, num_slots, config.num_key_value_heads,
                      slot_len, config.head_dim)
        self.device, self.dtype = torch.device(device), dtype
        self.num_slots, self.slot_len = num_slots, slot_len
        self.kv: torch.Tensor | None = None
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.allocate()

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds when allocated."""
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def released(self) -> bool:
        """True after release_memory_occupation(kv_cache)."""
        return self.kv is None

    def allocate(self) -> None:
        """(Re)create the storage, zero-filled."""
        # Zeros, not empty: padded query rows attend to position 0 and must stay finite.
        self.kv = torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Drop the storage (release_memory_occupation kv_cache); every slot must be free."""
        self.kv = None

    @property
    def num_free(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot, or None when every slot is taken."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        """Return a slot; its contents are overwritten by the next owner."""
        self._free.append(slot)


class BatchKV:
    """The KVCache a forward pass writes through: new K/V go to their slots, all K/V come back.

    Row b has `starts[b]` positions already in slot `slots[b]` and `lens[b]` new tokens
    (padded to T); after the write the row attends to positions [0, S).
    """

    def __init__(self, pool: KVPool, slots: list[int], starts: list[int], lens: list[int]):
        assert pool.kv is not None, "KV pool is released"
        dev = pool.device
        self.pool = pool
        self.total = max(s + n for s, n in zip(starts, lens, strict=True))
        self.single = slots[0] if len(slots) == 1 else None
        self.slots = torch.tensor(slots, device=dev)
        self.decode = all(n == 1 for n in lens)
        if self.decode:
            self.pos = torch.tensor(starts, device=dev)
        else:
            b_idx, t_idx, pos = [], [], []
            for b, (s, n) in enumerate(zip(starts, lens, strict=True)):
                b_idx.extend([b] * n)
                t_idx.extend(range(n))
                pos.extend(range(s, s + n))
            self.b_idx = torch.tensor(b_idx, device=dev)
            self.t_idx = torch.tensor(t_idx, device=dev)
            self.w_slot = self.slots[self.b_idx]
            self.pos = torch.tensor(pos, device=dev)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's K/V into the slots; return K/V over [0, S) per row."""
        kv = self.pool.kv
        keys, values = kv[layer_idx, 0], kv[layer_idx, 1]
        if self.decode:
            keys[self.slots, :, self.pos] = k[:, :, 0]
            values[self.slots, :, self.pos] = v[:, :, 0]
        else:
            keys[self.w_slot, :, self.pos] = k[self.b_idx, :, self.t_idx]
            values[self.w_slot, :, self.pos] = v[self.b_idx, :, self.t_idx]
        if self.single is not None:  # a view, no gather copy
            s = self.single
            return keys[s:s + 1, :, :self.total], values[s:s + 1, :, :self.total]
        return keys[self.slots, :, :self.total], values[self.slots, :, :self.total]


def extend_mask(starts: list[int], lens: list[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(attn_mask [B,1,T,S] bool, position_ids [B,T]) for rows extending their slots.

    Query t of row b sits at position starts[b]+t and sees positions <= its own. Padded
    queries (t >= lens[b]) see a few stale positions; their outputs are discarded and
    position 0 keeps every row finite.
    """
    t_max = max(lens)
    total = max(s + n for s, n in zip(starts, lens, strict=True))
    start = torch.tensor(starts, device=device)
    positions = start[:, None] + torch.arange(t_max, device=device)[None, :]
    mask = torch.arange(total, device=device)[None, None, :] <= positions[:, :, None]
    return mask[:, None], positions


def _shared_prefix(key: tuple[int, ...], ids: list[int], pos: int) -> int:
    """How many leading tokens of `key` equal `ids[pos:]`."""
    n, limit = 0, min(len(key), len(ids) - pos)
    while n < limit and key[n] == ids[pos + n]:
        n += 1
    return n


class _Node:
    __slots__ = ("key", "kv", "children", "parent", "last_used")

    def __init__(self, key: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None):
        self.key = key
        self.kv = kv  # [L, 2, Hkv, len(key), D]
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_used = 0


class PrefixCache:
    """Radix tree over token ids holding the KV of each edge; LRU eviction of leaves."""

    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.root = _Node((), None, None)
        self.num_tokens = 0
        self._clock = itertools.count(1)
        self.hits = 0
        self.queries = 0

    def reset(self) -> None:
        """Forget every cached prefix (/flush_cache)."""
        self.root = _Node((), None, None)
        self.num_tokens = 0

    def match(self, ids: list[int]) -> tuple[int, list[torch.Tensor]]:
        """Length of the longest cached prefix of `ids` and its KV pieces, in order."""
        node, pos, pieces = self.root, 0, []
        tick = next(self._clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            key = child.key
            n = _shared_prefix(key, ids, pos)
            child.last_used = tick
            pieces.append(child.kv if n == len(key) else child.kv[:, :, :, :n])
            pos += n
            if n < len(key):
                break
            node = child
        self.queries += len(ids)
        self.hits += pos
        return pos, pieces

    def insert(self, ids: list[int], pool: KVPool, slot: int) -> None:
        """Cache the KV of `ids`, which occupy positions [0, len(ids)) of `slot`."""
        if self.capacity <= 0 or pool.kv is None:
            return
        node, pos = self.root, 0
        tick = next(self._clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                key = tuple(ids[pos:])
                kv = pool.kv[:, :, slot, :, pos:len(ids)].clone()
                new = _Node(key, kv, node)
                new.last_used = tick
                node.children[ids[pos]] = new
                self.num_tokens += len(key)
                break
            key = child.key
            n = _shared_prefix(key, ids, pos)
            child.last_used = tick
            if n < len(key):
                self._split(child, n)
            pos += n
            node = child
        if self.num_tokens > self.capacity:
            # Evict down to 90% so a full cache does not rescan the tree on every insert.
            self._evict(self.num_tokens - int(self.capacity * 0.9))

    def _split(self, child: _Node, n: int) -> None:
        """Cut `child`'s edge after n tokens so a diverging suffix can hang off the cut."""
        tail = _Node(child.key[n:], child.kv[:, :, :, n:].clone(), child)
        tail.children = child.children
        for c in tail.children.values():
            c.parent = tail
        tail.last_used = child.last_used
        child.children = {tail.key[0]: tail}
        child.key = child.key[:n]
        child.kv = child.kv[:, :, :, :n].clone()

    def _evict(self, num_tokens: int) -> None:
        leaves = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append((node.last_used, id(node), node))
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        self.num_tokens -= freed
