"""Prefix cache: a radix tree over token ids at page granularity whose values are KV pages (RadixAttention)."""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import attrs

from .kv_cache import KVPool


class _Node:
    """An edge of whole pages: `tokens` holds len(pages) * page_size token ids, `pages` their KV pages.

    `lock_count` counts the locks on this node and on every node below it, so a node is evictable
    exactly when its count is 0, and then so is its whole subtree.
    """

    __slots__ = ("id", "parent", "children", "tokens", "pages", "lock_count", "last_access")

    def __init__(self, id: int, parent: _Node | None, tokens: tuple[int, ...], pages: list[int]):
        self.id = id  # breaks ties between equally old leaves, so eviction order is deterministic
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}  # keyed by the child's first page of tokens
        self.tokens = tokens
        self.pages = pages
        self.lock_count = 0
        self.last_access = 0

    def is_evictable_leaf(self) -> bool:
        return not self.children and self.lock_count == 0 and self.parent is not None  # the root holds no pages

    def __repr__(self) -> str:
        return f"_Node(id={self.id}, pages={self.pages}, locks={self.lock_count})"


@attrs.frozen
class Match:
    pages: list[int]  # the cached prefix's page ids, in order
    num_tokens: int  # len(pages) * page_size
    node: _Node  # the deepest matched node (the root when nothing matched): what to lock


@attrs.frozen
class Insert:
    node: _Node  # the deepest node now covering the inserted full pages
    pages: list[int]  # the tree's pages for them, in order: the caller uses these from now on
    duplicates: list[int]  # the caller's pages the tree did not adopt (it held those tokens already)


class PrefixCache:
    """A radix tree over token ids at page granularity (RadixAttention): each edge holds whole pages of
    tokens and their KV page ids from the KVPool. The tree owns the pages in it; a node has a lock count and
    a last-access time; unlocked leaves are evicted least recently used first.

    A request owns only its private pages (those past what it matched or had adopted); every page has
    one owner. A `Match` must be locked before anything can evict (the next `evict` or `flush`), and
    stays locked while the request uses its pages.
    """

    def __init__(self, kv: KVPool):
        self.kv = kv
        self.page_size = kv.page_size
        self._ids = itertools.count()
        self._clock = itertools.count(1)  # a monotonic counter, not wall time: eviction order is reproducible
        self.root = _Node(next(self._ids), None, (), [])
        self._num_pages = 0
        self._locked_pages = 0
        # counters for metrics
        self.reset_counters()

    @property
    def num_pages(self) -> int:
        """Pages the tree owns."""
        return self._num_pages

    @property
    def evictable_pages(self) -> int:
        """Pages the tree owns that no lock protects."""
        return self._num_pages - self._locked_pages

    def match(self, token_ids: Sequence[int], max_tokens: int) -> Match:
        """The longest cached page-aligned prefix of token_ids of at most max_tokens tokens.

        Callers pass max_tokens = len(prompt) - 1 so that at least one token is computed. An edge
        matched part way is split, so that the returned node covers exactly the matched pages.
        """
        node, pages = self._walk(tuple(token_ids[: self._usable(token_ids, max_tokens)]))
        return Match(pages, len(pages) * self.page_size, node)

    def peek(self, token_ids: Sequence[int], max_tokens: int) -> int:
        """How many tokens `match` would find, without splitting an edge or touching a node's access time
        (so a scheduler may rank the queue by it: looking is not using)."""
        P = self.page_size
        tokens = tuple(token_ids[: self._usable(token_ids, max_tokens)])
        node, matched = self.root, 0
        while matched < len(tokens):
            child = node.children.get(tokens[matched : matched + P])
            if child is None:
                break
            common = self._common_pages(child, tokens, matched)
            matched += common * P
            if common < len(child.pages):
                break
            node = child
        return matched

    def record_lookup(self, queried: int, hit: int) -> None:
        """Count one request's admission: `queried` prompt tokens looked up, `hit` of them found.

        The scheduler calls this once per request, when it is admitted for the first time, so a request
        retried for want of pages or resumed after preemption is not counted twice."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> Insert:
        """Cache the full pages of token_ids; pages[i] holds tokens [i * page_size, (i + 1) * page_size).

        The tree adopts the pages for tokens it did not have; where it already had the tokens it keeps
        its own pages, and the caller's pages there (unless they are the tree's own) come back as duplicates.
        """
        P = self.page_size
        num_full = len(token_ids) // P
        if len(pages) < num_full:
            raise ValueError(f"{num_full} full pages of tokens but only {len(pages)} page ids")
        tokens = tuple(token_ids[: num_full * P])
        node, tree_pages = self._walk(tokens)
        duplicates = [mine for mine, theirs in zip(pages, tree_pages) if mine != theirs]
        if len(tree_pages) < num_full:
            adopted = list(pages[len(tree_pages) : num_full])
            leaf = _Node(next(self._ids), node, tokens[len(tree_pages) * P :], adopted)
            leaf.last_access = node.last_access
            node.children[leaf.tokens[:P]] = leaf
            self._num_pages += len(adopted)
            node = leaf
            tree_pages = tree_pages + adopted
        return Insert(node, tree_pages, duplicates)

    def lock(self, node: _Node) -> None:
        """Protect node and every ancestor from eviction until the matching unlock."""
        for n in self._path(node):
            if n.lock_count == 0:
                self._locked_pages += len(n.pages)
            n.lock_count += 1

    def unlock(self, node: _Node) -> None:
        if node.lock_count <= 0:
            raise ValueError(f"unlock of {node}, which is not locked")
        for n in self._path(node):
            n.lock_count -= 1
            if n.lock_count == 0:
                self._locked_pages -= len(n.pages)

    def evict(self, num_pages: int) -> int:
        """Free up to num_pages pages of unlocked leaves, least recently used first; returns how many.

        A leaf is trimmed from its end when fewer pages are needed than it holds: its remaining pages
        still cache a valid prefix.
        """
        leaves = [(n.last_access, n.id, n) for n in self._nodes() if n.is_evictable_leaf()]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, leaf = heapq.heappop(leaves)
            take = min(num_pages - freed, len(leaf.pages))
            released = leaf.pages[len(leaf.pages) - take :]
            self.kv.release(released)
            freed += take
            if take < len(leaf.pages):
                del leaf.pages[-take:]
                leaf.tokens = leaf.tokens[: len(leaf.pages) * self.page_size]
                continue
            parent = leaf.parent
            del parent.children[leaf.tokens[: self.page_size]]
            leaf.parent = None
            if parent.is_evictable_leaf():
                heapq.heappush(leaves, (parent.last_access, parent.id, parent))
        self._num_pages -= freed
        self.evicted_pages += freed
        return freed

    def flush(self) -> bool:
        """Empty the tree, releasing every page, if no node holding pages is locked; else do nothing."""
        if self._locked_pages:
            return False
        self.kv.release([p for n in self._nodes() for p in n.pages])
        for child in self.root.children.values():
            child.parent = None
        self.root.children = {}
        self._num_pages = 0
        return True

    def reset_counters(self) -> None:
        """Zero the counters metrics read: tokens looked up and found (`record_lookup`), pages freed by `evict`."""
        self.queried_tokens = self.hit_tokens = self.evicted_pages = 0

    def _usable(self, token_ids: Sequence[int], max_tokens: int) -> int:
        """The page-aligned length a lookup may match: at most max_tokens and the whole of token_ids."""
        return max(0, min(len(token_ids), max_tokens)) // self.page_size * self.page_size

    def _walk(self, tokens: tuple[int, ...]) -> tuple[_Node, list[int]]:
        """Follow tokens (whole pages) down the tree, touching every node passed; the deepest node reached
        and the pages along the way. An edge matched part way is split after the last common page."""
        P = self.page_size
        now = next(self._clock)
        node, pages = self.root, []
        node.last_access = now
        while len(pages) * P < len(tokens):
            start = len(pages) * P
            child = node.children.get(tokens[start : start + P])
            if child is None:
                break
            common = self._common_pages(child, tokens, start)
            if common < len(child.pages):
                child = self._split(child, common)
            child.last_access = now
            node = child
            pages.extend(child.pages)
        return node, pages

    def _common_pages(self, node: _Node, tokens: tuple[int, ...], start: int) -> int:
        """Leading pages of node's edge equal to tokens[start:] (the first is, by its key): one C-level comparison
        of the whole edge, else a binary search of them (a page-by-page loop costs a slice pair per page)."""
        P = self.page_size
        limit = min(len(node.pages), (len(tokens) - start) // P)
        if node.tokens[: limit * P] == tokens[start : start + limit * P]:
            return limit
        low, high = 1, limit - 1  # pages[:low] match, pages[:high + 1] do not
        while low < high:
            mid = (low + high + 1) // 2
            if node.tokens[: mid * P] == tokens[start : start + mid * P]:
                low = mid
            else:
                high = mid - 1
        return low

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut node's edge after num_pages pages; the new upper node is returned.

        The node object keeps the lower part, so handles callers hold (and lock) still name the deepest
        point they matched; the upper node inherits the lock count, which counts the same locks.
        """
        P = self.page_size
        parent = node.parent
        upper = _Node(next(self._ids), parent, node.tokens[: num_pages * P], node.pages[:num_pages])
        upper.lock_count = node.lock_count
        upper.last_access = node.last_access
        parent.children[upper.tokens[:P]] = upper
        node.tokens = node.tokens[num_pages * P :]
        node.pages = node.pages[num_pages:]
        node.parent = upper
        upper.children[node.tokens[:P]] = node
        return upper

    def _path(self, node: _Node) -> list[_Node]:
        """node and its ancestors up to the root; an error for a node no longer in the tree."""
        path = [node]
        while path[-1] is not self.root:
            if path[-1].parent is None:
                raise ValueError(f"{node} was evicted or flushed: lock a match before anything can evict")
            path.append(path[-1].parent)
        return path

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
