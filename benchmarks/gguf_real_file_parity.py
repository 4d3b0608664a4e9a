"""The real llama.cpp Q4_K_M 1B file: compact float32 (the file's blocks, exact float path) against the same
file dequantized at load by gguf and run with torch's ops in float32; greedy, 12 tokens, 3 prompts."""
import gc, time
from conveyor import LLM, SamplingParams
path = "/work/ckpt/llama-1b-q4_k_m.gguf"
prompts = [[1, 500, 600, 700, 800], [1, 42, 4242, 17, 99, 1000, 2000], [1, 3, 5, 7, 11, 13]]
params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
outs = {}
for name, kw in (("compact", dict(gguf_weights="compact", kernels="native")),
                 ("reference", dict(gguf_weights="auto", kernels="torch"))):
    t = time.time()
    llm = LLM(model=path, dtype="float32", kv_cache_memory="64MiB", max_model_len=256, **kw)
    outs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    print(name, "done in", round(time.time() - t), "s", flush=True)
    del llm; gc.collect()
for a, b in zip(outs["compact"], outs["reference"]):
    gaps = [lp.top[0][1] - lp.top[1][1] for lp in b.logprobs]
    print(a.token_ids == b.token_ids, a.token_ids, b.token_ids, "min ref gap", round(min(gaps), 4))
