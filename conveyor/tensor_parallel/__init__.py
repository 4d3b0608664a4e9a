"""Tensor parallelism: sharded weights (shard.py), the collectives between ranks (group.py), the worker
processes (worker.py) and their launch from the engine (launch.py)."""
