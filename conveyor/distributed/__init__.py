"""Data parallelism (replicas of the engine). So far: the prefix-affinity router the front process will use
to pick a replica (router.py); the replicas as Ray actors are not built yet (see README)."""
