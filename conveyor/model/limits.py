"""Bounds on what a model file may claim, shared by the GGUF and Hugging Face loaders: generous for any real model,
small enough that no loop, table or buffer is sized on an absurd number before the file is refused."""

MAX_CONTEXT_LENGTH = 1 << 24
"""16,777,216 tokens (the longest contexts models are trained for are a few million)."""
MAX_VOCAB = 1 << 22
MAX_WIDTH = 1 << 17
"""Hidden size."""
MAX_INTERMEDIATE = 1 << 20
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_HEAD_SIZE = 1 << 12
MAX_SCALE = 1e15
"""Rope bases and factors, soft caps and the like: any finite, positive value up to this."""
