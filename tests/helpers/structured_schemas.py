"""Helpers of the structured-output tests: the random schemas (shared with the benchmark) and a small tokenizer."""

from __future__ import annotations

import random

from conveyor.bench.json_schemas import random_object, random_schema

__all__ = ["random_object", "random_schema", "save_small_tokenizer"]


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
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
