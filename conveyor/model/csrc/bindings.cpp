// The Python module of Conveyor's native CPU kernels (one op per source file beside this one).
#include <torch/extension.h>

#include "kernels.h"

// Every op releases the GIL while it computes, as torch's own ops do: on CPU the engine's host thread
// (async batching, runtime/overlap.py) runs Python while the forward pass is in these kernels.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, no_gil, "Paged decode attention over block tables (CPU)");
  m.def("prefill_attention_available", &prefill_attention_available,
        "Whether prefill_attention can run here (AMX-BF16 granted)");
  m.def("prefill_attention", &prefill_attention, no_gil,
        "Causal attention of prompt chunks over their paged K/V, all chunks in one call, bfloat16 on AMX (CPU)");
  m.def("add_rms_norm", &add_rms_norm, no_gil, "hidden += delta (in place), then RMSNorm(hidden) * weight (CPU)");
  m.def("silu_and_mul", &silu_and_mul, no_gil, "silu(gate) * up for gate_up = [gate | up] (CPU)");
  m.def("quant_linear_vectorized", &quant_linear_vectorized, "Whether int4/int8_linear were built with AVX-512 BF16");
  m.def("int4_linear", &int4_linear, no_gil, "x @ W^T for int4 weights packed by conveyor.model.quant (CPU)");
  m.def("int8_linear", &int8_linear, no_gil, "x @ W^T for int8 rows packed by conveyor.model.quant (CPU)");
  m.def("f32_linear_vectorized", &f32_linear_vectorized, "Whether f32_linear was built with AVX-512");
  m.def("f32_linear", &f32_linear, no_gil, "x @ W^T for float32 weights in panels (conveyor.model.layers, CPU)");
  m.def("rotary_and_cache", &rotary_and_cache, no_gil,
        "Rotary Q/K from fused QKV rows, K/V written to cache slots (CPU)");
  m.def("apply_token_bitmask_", &apply_token_bitmask_, no_gil,
        "Tokens a row's grammar bitmask forbids set to -inf in the logits, in place (CPU)");
  m.def("argmax_allowed", &argmax_allowed, no_gil,
        "Each masked row's first largest logit among the tokens its grammar bitmask allows (CPU)");
  m.def("argmax_rows", &argmax_rows, no_gil,
        "Each row's first largest logit (the first NaN where there is one), as torch's max(dim=-1).indices (CPU)");
  m.def("bf16_amx_available", &bf16_amx_available, "Whether bf16_linear_amx can run here (AMX-BF16 granted)");
  m.def("bf16_linear_amx", &bf16_linear_amx, no_gil, "x @ W^T, W bfloat16 packed in AMX tiles at load (CPU)");
  m.def("bf16_linear_argmax_amx", &bf16_linear_argmax_amx, no_gil,
        "argmax over x @ W^T per row, W bfloat16 packed in AMX tiles, the product never written (CPU)");
  m.def("bf16_silu_gate_amx", &bf16_silu_gate_amx, no_gil,
        "silu(x @ Wg^T) * (x @ Wu^T), [Wg; Wu] bfloat16 packed in AMX tiles with rows interleaved (CPU)");
  m.def("decode_layers", &decode_layers, no_gil,
        "A pure-decode step's plain Llama layers (AMX-packed bfloat16 weights) in one call, kernel by kernel (CPU)");
  m.def("gguf_linear_vectorized", &gguf_linear_vectorized, "Whether gguf_linear_* were built with AVX-512 BF16/VNNI");
  m.def("gguf_dequantize", &gguf_dequantize, no_gil, "GGUF-quantized rows -> float32 (CPU)");
  m.def("gguf_linear_rows", &gguf_linear_rows, no_gil, "x @ W^T, W in GGUF blocks, few rows of x (CPU)");
  m.def("gguf_linear_rows_parts", &gguf_linear_rows_parts, no_gil,
        "x @ [W_1; W_2; ...]^T, each W in GGUF blocks of its own type, few rows of x, x quantized once (CPU)");
  m.def("gguf_linear_tiles", &gguf_linear_tiles, no_gil, "x @ W^T, W in GGUF blocks, tiles into a GEMM (CPU)");
  m.def("gguf_amx_available", &gguf_amx_available, "Whether gguf_linear_amx can run here (AMX-BF16 granted)");
  m.def("gguf_linear_amx", &gguf_linear_amx, no_gil, "x @ W^T, W in GGUF blocks, bfloat16 x, on AMX tiles (CPU)");
  m.def("gguf_linear_amx_parts", &gguf_linear_amx_parts, no_gil,
        "x @ [W_1; W_2; ...]^T, each W in GGUF blocks of its own type, bfloat16 x, on AMX tiles, one call (CPU)");
  m.def("gguf_silu_gate_amx_parts", &gguf_silu_gate_amx_parts, no_gil,
        "silu(x Wg^T) * (x Wu^T) for a [Wg; Wu] stack in GGUF blocks, bfloat16 x, on AMX tiles, one call (CPU)");
  m.def("gguf_pack_tiles", &gguf_pack_tiles, no_gil,
        "A row stack of GGUF matrices -> bfloat16 AMX tiles as pack_bf16_tiles lays them out, into `tiles` (CPU)");
}
