"""A GGUF file's tokenizer, built by transformers from the file's metadata and cached.

Building it takes seconds, so the result is saved once under ~/.cache/conveyor (or $CONVEYOR_CACHE), keyed by a hash
of the bytes of the file's header and metadata (all the tokenizer is built from): a file whose metadata is
unchanged reuses it wherever it lies, one whose metadata changed never gets a stale tokenizer. The metadata is
checked first (gguf_metadata.check_tokenizer); whatever transformers still refuses is a ModelLoadError naming the
file and transformers' reason, never a traceback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_file import GGUFFile, read_gguf
from conveyor.model.model_checks import check_tokenizer_works

logger = logging.getLogger(__name__)


def tokenizer_cache_dir(reader: GGUFFile) -> str:
    with open(reader.path, "rb") as f:
        header = f.read(reader.metadata_end)
    key = hashlib.sha256(header).hexdigest()[:16]
    cache_root = os.environ.get("CONVEYOR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "conveyor"))
    return os.path.join(cache_root, "tokenizers", key)


def load_gguf_tokenizer(path: str, reader: GGUFFile | None = None) -> Any:
    """The tokenizer (and chat template) of a GGUF file; `reader`: the file already read (else it is read)."""
    from transformers import AutoTokenizer

    cache_dir = tokenizer_cache_dir(reader or read_gguf(path))
    if os.path.isfile(os.path.join(cache_dir, "tokenizer.json")):
        try:
            return check_tokenizer_works(AutoTokenizer.from_pretrained(cache_dir), path)
        except Exception:  # a damaged cache entry: rebuild it below
            logger.warning("tokenizer cache %s is unreadable; rebuilding it from the GGUF file", cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except Exception as exc:  # transformers' builder: IndexError, UnicodeError, its own validation errors, ...
        raise ModelLoadError(
            f"{path}: transformers cannot build a tokenizer from the file's tokenizer.* metadata "
            f"({type(exc).__name__}: {str(exc)[:300]})"
        ) from None
    check_tokenizer_works(tokenizer, path)
    try:
        tmp = f"{cache_dir}.tmp{os.getpid()}"
        tokenizer.save_pretrained(tmp)
        if os.path.exists(cache_dir):
            shutil.rmtree(cache_dir, ignore_errors=True)
        os.replace(tmp, cache_dir)
    except Exception as exc:  # a full disk, a read-only cache, a tokenizer that cannot be saved
        logger.info("could not cache the tokenizer in %s (%s); it will be rebuilt next time", cache_dir, exc)
    return tokenizer
