"""The processes of one engine: every rank, and rank 0 leading them.

    launcher.py  starts this node's ranks (one process each), hosts the rendezvous, names the rank that failed
    worker.py    what every rank does each round: apply the commands, step, report (RankWorker; Follower on ranks 1..N-1)
    group.py     rank 0's side of the rounds: queue commands, pick each request's DP group, run a round on every rank
    leader.py    rank 0 under `moeplex serve`: the front end's commands in through a pipe, one report per round out
    warmup.py    rank 0's prefill steps of every size class before a server takes requests
    offline.py   `moeplex generate` on every rank: prompts shared out to DP groups, results back on rank 0

The vocabulary they speak with each other and with the front end is core/messages.py.
"""
