"""The step-time prediction's cache term: which bytes a replayed step finds in the cache.

Layer: analysis (pure: numbers and keys only); imports: nothing of the package.

The memory model's replay (``simulate``) notes each buffer's first and last step,
which buffers each step reads, and which kernel runs at each step.  This module
walks those steps in order and sorts every byte a kernel moves into *cached* or
*from memory*, by LRU stack distance: the distinct bytes touched since the buffer
was last touched.  A read is cached when that distance, plus the buffer, fits the
last-level cache.  A write goes to memory the allocator freed: where a freed buffer
at least as large was last touched within the cache's reach, the write is cached
(the allocator hands back recently freed memory); otherwise it goes to memory last
touched a step ago.  Where the step's whole footprint (its predicted peak) fits the
cache, every byte is cached.

On the tanh chain this is the whole difference between plans: plain
``tf.gradients`` keeps 100 MB of activations and reads each back from memory,
``'memory'`` recomputes 10 MB segments whose gradients find them in the cache.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Mapping, Sequence, Tuple

#: How many of the most recently freed buffers a write looks through for memory to
#: reuse (bounds the walk; older ones are out of the cache's reach on any model).
RECYCLE_WINDOW = 64


class _Distances:
    """Distinct bytes touched since a time: a Fenwick tree over access times, one
    entry per buffer at its last access."""

    def __init__(self, size: int):
        self.tree = [0] * (size + 1)
        self.total = 0

    def add(self, index: int, nbytes: int) -> None:
        self.total += nbytes
        index += 1
        while index < len(self.tree):
            self.tree[index] += nbytes
            index += index & -index

    def up_to(self, index: int) -> int:
        """Bytes of the buffers last touched at access times ``0..index``."""
        found, index = 0, index + 1
        while index > 0:
            found += self.tree[index]
            index -= index & -index
        return found

    def since(self, index: int) -> int:
        """Bytes of the buffers last touched after access time ``index``."""
        return self.total - self.up_to(index)


def cached_traffic(
    buffers: Mapping[Hashable, Sequence[float]],
    reads: Iterable[Tuple[float, Hashable]],
    steps: Iterable[float],
    cache_bytes: int,
    fits: bool = False,
) -> dict:
    """Per step of ``steps``: ``(cached bytes, bytes from memory)`` of what it reads
    and writes.

    ``buffers``: key -> ``(first step, last step, bytes)`` (a last step of infinity:
    kept to the end); ``reads``: ``(step, key)`` for every read; ``fits``: the step's
    footprint fits the cache (every byte is cached).
    """
    reads_at: dict = {}
    for step, key in reads:
        reads_at.setdefault(step, set()).add(key)
    writes_at: dict = {}
    frees = []
    for key, (start, end, nbytes) in buffers.items():
        if nbytes:
            writes_at.setdefault(start, []).append(key)
            if end != float("inf"):
                frees.append((end, len(frees), key))
    frees.sort()
    wanted = set(steps)
    order = sorted(set(reads_at) | set(writes_at) | wanted)
    accesses = sum(len(keys) for keys in reads_at.values()) + sum(map(len, writes_at.values()))
    distances = _Distances(accesses)
    last: dict = {}  # key -> (access time, bytes counted there)
    pool: list = []  # freed buffers' memory: [access time, bytes, key]
    now, freed, traffic = 0, 0, {}
    for step in order:
        while freed < len(frees) and frees[freed][0] < step:
            key = frees[freed][2]
            if key in last:
                pool.append([last[key][0], buffers[key][2], key])
            freed += 1
        cached = uncached = 0
        touched = []
        for key in reads_at.get(step, ()):
            nbytes = int(buffers[key][2])
            if not nbytes:
                continue
            seen = last.get(key)
            if fits or (seen is not None and distances.since(seen[0]) + nbytes <= cache_bytes):
                cached += nbytes
            else:
                uncached += nbytes
            touched.append((key, nbytes))
        for key in writes_at.get(step, ()):
            nbytes = int(buffers[key][2])
            if fits or _recycle(pool, nbytes, distances, last, cache_bytes):
                cached += nbytes
            else:
                uncached += nbytes
            touched.append((key, nbytes))
        for key, nbytes in touched:
            seen = last.get(key)
            if seen is not None:
                distances.add(seen[0], -seen[1])
            distances.add(now, nbytes)
            last[key] = (now, nbytes)
            now += 1
        if step in wanted:
            traffic[step] = (cached, uncached)
    return traffic


def _recycle(pool: list, nbytes: int, distances: _Distances, last: dict, cache_bytes: int) -> bool:
    """Takes ``nbytes`` from the smallest recently freed buffer that holds them and was
    last touched within the cache's reach; False where there is none."""
    best = None
    for entry in pool[-RECYCLE_WINDOW:]:
        if entry[1] >= nbytes and (best is None or entry[1] < best[1]):
            if distances.since(entry[0]) + nbytes <= cache_bytes:
                best = entry
    if best is None:
        return False
    best[1] -= nbytes
    key = best[2]
    time, counted = last[key]
    taken = min(counted, nbytes)  # the freed buffer's memory is the new one's now
    distances.add(time, -taken)
    last[key] = (time, counted - taken)
    if best[1] <= 0:
        pool.remove(best)
    return True


def step_seconds(
    traffic: Mapping[float, Tuple[int, int]],
    executed: Mapping[float, object],
    price: Callable[[object, int, int], float],
) -> float:
    """The seconds of every kernel run: ``price(what ran, cached bytes, bytes from
    memory)`` at each step of ``executed``."""
    return sum(price(what, *traffic.get(step, (0, 0))) for step, what in executed.items())
