"""The MoE layer pipeline owned by the core: router -> replica selector -> dispatch -> kernel -> combine."""
