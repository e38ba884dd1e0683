"""Tensor parallelism inside one worker: the shard layout, the rank group and its follower
ranks (see engine/tp/ranks.py for how a worker's ranks start, follow rank 0 and stop)."""
