"""Session s17 check: the embedded default model (SmolLM2-135M-Instruct), 8 chat prompts x 64 greedy tokens, with
the exact and the int8 KV cache in float32 and bfloat16: where each pair's tokens first differ. The yardstick is
float32 against bfloat16 compute on the exact cache.

    .venv/bin/python benchmarks/results/2026-12-03-s17/default_model_int8_tokens.py
"""
from conveyor import LLM, SamplingParams

prompts = ["What is the capital of France? Answer in two sentences.", "Write a haiku about the sea.",
           "Explain what a hash table is.", "List three uses of copper.", "Who wrote Hamlet?",
           "Give me a recipe for pancakes.", "What is 17 times 23?", "Describe the water cycle."]
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=1)
runs = {}
for name, kw in {"f32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
                 "bf16_int8": dict(dtype="bfloat16", kv_cache_dtype="int8"),
                 "f32_int8": dict(dtype="float32", kv_cache_dtype="int8")}.items():
    llm = LLM(**kw)
    runs[name] = [o.outputs[0].token_ids for o in llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)]
    del llm
def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
for x, y in (("f32", "bf16"), ("f32", "f32_int8"), ("bf16", "bf16_int8")):
    d = [first_diff(a, b) for a, b in zip(runs[x], runs[y])]
    print(f"{x} vs {y}: first differing token per prompt {d}; identical prompts {sum(v == 64 for v in d)}/8")
