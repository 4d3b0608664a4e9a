#!/usr/bin/env bash
# End-of-session side-by-side checks: base (fcef4c3) vs the merged code (integ); run on a quiet machine.
set -x
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
O=/work/notes/s10/bench
uptime
# 1. default-model load time (LLM() construction, bf16), alternating
for r in 1 2; do for side in integ base; do
  (cd /tmp && /work/$side/.venv/bin/python -c "
import time; t=time.time(); from conveyor import LLM; t1=time.time(); llm=LLM(max_model_len=1024, kv_cache_memory='256MiB'); t2=time.time()
print('$side import %.2f s, LLM() %.2f s' % (t1-t, t2-t1)); llm.engine.close()" 2>&1 | grep LLM) | tee -a $O/load.txt
done; done
uptime
# 2. default W1 with OpenVINO: integ, then base
for side in integ base; do
  (cd /work/$side && timeout 600 .venv/bin/conveyor bench throughput --peer openvino --results-dir $O/w1_$side > $O/w1_${side}.txt 2>&1); uptime
done
# 3. 1B Q4_K_M single request vs llama.cpp (integ)
(cd /work/integ && timeout 900 .venv/bin/conveyor bench latency --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 \
   --input-len 128 --output-len 32 --runs 3 --peer llama-cpp --results-dir $O/lat1b_integ > $O/lat1b_integ.txt 2>&1); uptime
echo DONE
