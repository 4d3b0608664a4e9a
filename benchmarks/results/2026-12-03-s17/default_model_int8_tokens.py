"""Session s17 check: the embedded default model (SmolLM2-135M-Instruct), 8 chat prompts x 64 greedy tokens, with
the exact and the int8 KV cache in float32 and bfloat16: where each pair's tokens first differ. The yardstick is
float32 against bfloat16 compute on the exact cache.

    .venv/bin/python benchmarks/results/2026-12-03-s17/default_model_int8_tokens.py
"""

from __future__ import annotations

from conveyor import LLM, SamplingParams

PROMPTS = ["What is the capital of France? Answer in two sentences.", "Write a haiku about the sea.",
           "Explain what a hash table is.", "List three uses of copper.", "Who wrote Hamlet?",
           "Give me a recipe for pancakes.", "What is 17 times 23?", "Describe the water cycle."]
TOKENS = 64
SETUPS = {"f32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
          "bf16_int8": dict(dtype="bfloat16", kv_cache_dtype="int8"),
          "f32_int8": dict(dtype="float32", kv_cache_dtype="int8")}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def main() -> None:
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    tokens = {}
    for name, options in SETUPS.items():
        llm = LLM(**options)
        outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outputs]
        del llm
    for a, b in (("f32", "bf16"), ("f32", "f32_int8"), ("bf16", "bf16_int8")):
        parts = [first_difference(x, y) for x, y in zip(tokens[a], tokens[b])]
        print(f"{a} vs {b}: first differing token per prompt {parts}; identical prompts "
              f"{sum(p == TOKENS for p in parts)}/{len(PROMPTS)}")


if __name__ == "__main__":
    main()
