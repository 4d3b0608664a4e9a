"""The HTTP side of data parallelism: the front that relays OpenAI requests to replicas (front.py), its metrics,
the replica's own app, and `conveyor serve --data-parallel-size N` (serve_replicas.py). It sits above
conveyor.server (it reuses the server's protocol and error shapes); the rest of conveyor.data_parallel sits below it."""
