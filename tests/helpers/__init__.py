"""What the tests share: tiny random models, the transformers parity references, llama.cpp's GGUF converter,
a server in a child process, random JSON schemas, and the repository's paths."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository's root folder (the one holding conveyor/ and tests/)."""
PACKAGE_ROOT = REPO_ROOT / "conveyor"
