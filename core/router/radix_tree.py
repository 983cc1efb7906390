"""The approximate radix tree of the cache-aware policy: request text, character by character, per worker.

One tree is shared by all workers. Each node holds an edge of text and the workers that have seen it,
each with the logical time it last did. A worker's share of the tree is prefix-closed (a worker that
saw a node saw all its ancestors), so the deepest node a text reaches names the workers with the
longest match. The tree only approximates what a worker's KV cache holds: it sees text, not tokens,
and it forgets on its own schedule: least recently used first, whenever an insert takes a worker's
share past the maximum (so the maximum holds at all times, not only after a periodic sweep).
"""

from __future__ import annotations

import array
import heapq
import itertools
import sys
from typing import Collection, Iterator, Sequence

import attrs

_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)


class Node:
    __slots__ = ("edge", "parent", "children", "seen")

    def __init__(self, edge: str, parent: Node | None):
        self.edge = edge
        self.parent = parent
        self.children: dict[str, Node] = {}  # first character of the child's edge -> child
        self.seen: dict[str, int] = {}  # worker -> logical time it last saw this node


@attrs.frozen
class Inserted:
    """What one insert added, so that a request the worker refused can be taken back out."""

    text: str
    worker: str
    time: int
    known: int  # leading characters of the text the worker had seen before this insert


@attrs.frozen
class Match:
    """The longest prefix of a text that some allowed worker has seen, and those workers."""

    length: int
    workers: dict[str, int]  # worker -> when it last saw the deepest matched node


def token_text(token_ids: Sequence[int]) -> str:
    """Token ids as text of one character each (ids are below 0x110000), so this tree serves token
    sequences too: the match length is then a number of tokens. Decoded from 32-bit code points in one C
    call (5x faster than a chr() per id on a 2k-token prompt); ids in the surrogate range pass as themselves."""
    return array.array(_UINT32, token_ids).tobytes().decode("utf-32-le" if sys.byteorder == "little" else "utf-32-be",
                                                           "surrogatepass")


def shared_length(edge: str, text: str, start: int) -> int:
    """How many leading characters of `edge` equal text[start:] (binary search on C-level comparisons)."""
    if text.startswith(edge, start):
        return len(edge)
    low, high = 0, min(len(edge), len(text) - start)  # edge[:low] matches, edge[:high + 1] does not
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(edge[:mid], start):
            low = mid
        else:
            high = mid - 1
    return low


class RadixTree:
    def __init__(self, max_size: int | None = None):
        """`max_size`: characters each worker's share holds at most (None: no bound)."""
        self.max_size = max_size
        self.root = Node("", None)
        self.sizes: dict[str, int] = {}  # worker -> characters of the tree it has seen
        self._clock = itertools.count(1)

    # --- reading ---------------------------------------------------------------------------------

    def match(self, text: str, allowed: Collection[str] | None = None) -> Match:
        """The longest prefix of `text` seen by a worker in `allowed` (every worker when None)."""
        node, depth = self.root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None or not self._seen_by(child, allowed):
                break
            shared = shared_length(child.edge, text, depth)
            node, depth = child, depth + shared
            if shared < len(child.edge):
                break
        if node is self.root:
            return Match(0, {})
        workers = {w: t for w, t in node.seen.items() if allowed is None or w in allowed}
        return Match(depth, workers)

    def size(self, worker: str) -> int:
        return self.sizes.get(worker, 0)

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # --- writing ---------------------------------------------------------------------------------

    def insert(self, text: str, worker: str) -> Inserted:
        """Record that `worker` saw `text` now; past the maximum, evict its least recently used text."""
        now = next(self._clock)
        node, depth, known = self.root, 0, len(text)
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                child = Node(text[depth:], node)
                node.children[text[depth]] = child
            shared = shared_length(child.edge, text, depth)
            if shared < len(child.edge):
                child = self._split(child, shared)
            if worker not in child.seen:
                known = min(known, depth)
            self._stamp(child, worker, now)
            node, depth = child, depth + shared
        if self.max_size is not None and self.size(worker) > self.max_size:
            # down to 7/8 of the maximum, so the sweep over the tree runs once per eighth of it inserted
            self._evict({worker}, self.max_size - self.max_size // 8)
        return Inserted(text, worker, now, known)

    def retract(self, inserted: Inserted) -> None:
        """Take back what `inserted` added for its worker, where no later insert has touched it."""
        worker, text = inserted.worker, inserted.text
        path, node, depth = [], self.root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None or worker not in child.seen or not text.startswith(child.edge, depth):
                break
            path.append((depth, child))
            node, depth = child, depth + len(child.edge)
        for start, node in reversed(path):
            if start < inserted.known or node.seen[worker] != inserted.time or not self._is_leaf_of(node, worker):
                break
            self._unstamp(node, worker)

    def remove_worker(self, worker: str) -> None:
        """Forget everything `worker` saw."""
        for node in list(self.nodes()):
            if worker in node.seen:
                self._unstamp(node, worker)
        self.sizes.pop(worker, None)

    def evict(self, max_size: int) -> dict[str, int]:
        """Drop each worker's least recently seen leaves until its share is at most `max_size` characters.

        Returns the characters dropped per worker. A node's time is never older than its children's
        (every insert stamps the whole path), so leaves-first in time order is LRU.
        """
        over = {w for w, size in self.sizes.items() if size > max_size}
        if not over:
            return {}
        return self._evict(over, max_size)

    # --- internals -------------------------------------------------------------------------------

    def _evict(self, over: set[str], max_size: int) -> dict[str, int]:
        leaves: dict[str, list] = {w: [] for w in over}
        order = itertools.count()  # breaks ties between equal times without comparing nodes
        for node in self.nodes():
            for worker in over & node.seen.keys():
                if self._is_leaf_of(node, worker):
                    leaves[worker].append((node.seen[worker], next(order), node))
        return {w: self._evict_worker(w, leaves[w], max_size, order) for w in over}

    def _evict_worker(self, worker: str, heap: list, max_size: int, order) -> int:
        heapq.heapify(heap)
        before = self.sizes[worker]
        while self.sizes[worker] > max_size and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._unstamp(node, worker)
            if parent is not self.root and self._is_leaf_of(parent, worker):
                heapq.heappush(heap, (parent.seen[worker], next(order), parent))
        return before - self.sizes[worker]

    @staticmethod
    def _seen_by(node: Node, allowed: Collection[str] | None) -> bool:
        # map over a bound method: no generator object per node (this runs for every node a match passes)
        return bool(node.seen) if allowed is None else any(map(allowed.__contains__, node.seen))

    @staticmethod
    def _is_leaf_of(node: Node, worker: str) -> bool:
        return worker in node.seen and not any(worker in child.seen for child in node.children.values())

    def _split(self, child: Node, at: int) -> Node:
        """Put a node holding child.edge[:at] between `child` and its parent; return it."""
        parent = child.parent
        middle = Node(child.edge[:at], parent)
        middle.seen = dict(child.seen)
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[at:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    def _stamp(self, node: Node, worker: str, now: int) -> None:
        if worker not in node.seen:
            self.sizes[worker] = self.sizes.get(worker, 0) + len(node.edge)
        node.seen[worker] = now

    def _unstamp(self, node: Node, worker: str) -> None:
        del node.seen[worker]
        self.sizes[worker] -= len(node.edge)
        if not node.seen:  # nobody saw it, so nobody saw anything below it either
            del node.parent.children[node.edge[0]]
