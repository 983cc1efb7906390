"""`moeplex plan`: a performance model of a (PD-disaggregated, large-EP) deployment.

Offline only: nothing on the serving path imports this package. It prices one forward step from
measured per-operation costs (a hardware profile: profiles/*.json, every number with its source)
and a model of communication, then turns steps into tokens/s per node, TTFT and ITL.
"""
