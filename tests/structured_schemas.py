"""Random JSON schemas for structured-output tests (deterministic per seed)."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["red", "green", "blue", "cat", "dog", "alpha", "beta", "x", "yes", "no"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Nested objects, arrays, enums, bounded numbers, required / optional, additionalProperties false."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 8)}
        if rng.random() < 0.3:
            schema["minLength"] = 1
        return schema
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.choice([-10.0, 0.0, 0.5, 3.0])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1.0, 10.0, 100.0])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        values: list[Any] = rng.sample(WORDS, rng.randint(1, 4))
        if rng.random() < 0.3:
            values.append(rng.randint(0, 9))
        return {"enum": values}
    if kind == "array":
        low = rng.randint(0, 1)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "pos", "meta"], rng.randint(1, 4))
    properties = {n: random_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def save_small_tokenizer(folder: str, vocab_size: int = 500) -> None:
    """A byte-level BPE tokenizer of `vocab_size` tokens ("<s>" = 0, "</s>" = 1) trained on JSON, saved as
    Hugging Face files: grammars compile against a real (small) vocabulary, and a step's sampling
    stays cheap for a tiny random model."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [json.dumps(random_object(rng)) for _ in range(300)]
    corpus += ["Answer in JSON: yes no maybe Paris London Rome 0123456789 abcdef xyz!"] * 5
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
