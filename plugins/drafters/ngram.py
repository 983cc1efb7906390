"""Prompt-lookup drafts: the request's own earlier tokens predict what follows a repeated n-gram.

Code edits, quoting answers and extraction repeat long runs of the prompt; where the last n tokens
occurred before, what followed them then is a good guess for what follows now. No weights, no KV,
every architecture.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moeplex.interfaces import DraftRequest, Drafter, DrafterCaps, Drafts


def lookup(ids: np.ndarray, max_n: int, min_n: int, count: int) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix of `ids`
    of length max_n .. min_n (an occurrence must be followed by at least one token).

    One comparison over the sequence finds the earlier positions holding the last token; the suffix is then
    matched backwards from those few candidates only: O(len(ids) + candidates x max_n), not O(len x max_n).
    """
    last = len(ids) - 1
    ends = np.flatnonzero(ids[:last] == ids[last])  # where an occurrence may end
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched backwards from each end
    for k in range(1, max_n):
        more = (matched == k) & (ends >= k)
        more[more] = ids[ends[more] - k] == ids[last - k]
        if not more.any():
            break
        matched += more
    n = int(matched.max())
    if n < min_n:
        return []
    start = int(ends[np.flatnonzero(matched == n)[-1]]) + 1
    return ids[start : start + count].tolist()


class NgramDrafter(Drafter):
    caps = DrafterCaps(cheap_proposals=True)  # a suffix match over the host token list
    max_n = 4  # longest suffix matched
    min_n = 1  # shortest suffix matched
    window = 4096  # only the latest tokens are searched: a step costs O(window), not O(sequence)

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        tokens = []
        for request in requests:
            ids = np.asarray(request.token_ids[-self.window :], dtype=np.int64)
            tokens.append(lookup(ids, self.max_n, self.min_n, self.num_steps) if ids.size > 1 else [])
        return Drafts(tokens)
