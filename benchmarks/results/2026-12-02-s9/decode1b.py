import sys, time, random, os
from conveyor import LLM
from conveyor.params import SamplingParams
path = sys.argv[1]; rows = int(sys.argv[2]); n = int(sys.argv[3])
llm = LLM(model=path, max_model_len=1024)
random.seed(0)
prompts = [[random.randrange(100, 40000) for _ in range(128)] for _ in range(rows)]
llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
for k in (2, n):
    t = time.perf_counter(); llm.generate(prompts, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True), use_tqdm=False)
    d = time.perf_counter() - t; print(k, "tokens", d, flush=True)
    if k == 2: base = d
print("decode ms/step", (d - base) / (n - 2) * 1000)
open("/tmp/decode_ready", "w").write("x")
llm.close()
