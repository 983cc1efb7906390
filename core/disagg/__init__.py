"""Prefill/decode disaggregation (docs/pd.md): one engine in two roles, KV pages moved by a kv_transfer plugin.

    router --(room, P's bootstrap address)--> P front end      D front end <--(same body)-- router
                                              |  rooms.py        | peers.py: GET P's /bootstrap/info (layout check),
                                              |  bootstrap.py <--+  POST /bootstrap/rooms/{room} (D's pages, endpoints)
    P leader: book.py (deadlines, states)     |                  D leader: book.py
    P ranks:  rank.py (hold pages, start) ----KV pages + metadata row----> D ranks: rank.py (reserve, expect, admit)

layout.py describes what both sides must agree on; the leaders decide every state change (from the ranks'
polls and their own deadlines) and broadcast it in the next round, so the TP ranks of a group move together.
"""
