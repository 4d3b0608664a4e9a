"""Data parallelism: replicas of the engine as Ray actors (replicas.py, replica.py, ray_cluster.py), the
prefix-affinity router that picks a replica per request (router.py), the offline LLM's fan-out (offline.py), and the
HTTP front with the replicas' own app (serving/)."""
