// The ops of Conveyor's native CPU kernels, one definition per source file beside this one: bound to Python by
// bindings.cpp, and called from C++ where one op runs others (decode_layers.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale);
bool prefill_attention_available();
void prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_tables, const torch::Tensor& spans, double scale, int64_t window,
                       torch::Tensor& out);
torch::Tensor add_rms_norm(torch::Tensor& hidden, const c10::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
torch::Tensor rotary_and_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                               int64_t heads, int64_t kv_heads);
bool quant_linear_vectorized();
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& blocks, const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale);
bool f32_linear_vectorized();
torch::Tensor f32_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features,
                         const c10::optional<torch::Tensor>& bias);
void apply_token_bitmask_(torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& bitmask);
torch::Tensor argmax_allowed(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& bitmask);
torch::Tensor argmax_rows(const torch::Tensor& logits);
bool bf16_amx_available();
torch::Tensor bf16_linear_amx(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features);
torch::Tensor bf16_silu_gate_amx(const torch::Tensor& x, const torch::Tensor& tiles, int64_t inner);
torch::Tensor bf16_linear_argmax_amx(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features);
torch::Tensor decode_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& input_norms,
                            const std::vector<torch::Tensor>& qkv_tiles, const std::vector<torch::Tensor>& o_tiles,
                            const std::vector<torch::Tensor>& post_norms,
                            const std::vector<torch::Tensor>& gate_up_tiles,
                            const std::vector<torch::Tensor>& down_tiles, std::vector<torch::Tensor> k_caches,
                            std::vector<torch::Tensor> v_caches, const torch::Tensor& cos_table,
                            const torch::Tensor& sin_table, const torch::Tensor& positions,
                            const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                            const torch::Tensor& context_lens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t inner, double eps, double scale);
bool gguf_linear_vectorized();
torch::Tensor gguf_dequantize(const torch::Tensor& blocks, int64_t kind, int64_t in_features);
torch::Tensor gguf_linear_rows(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind, int64_t in_features);
torch::Tensor gguf_linear_rows_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                                     const std::vector<int64_t>& kinds, int64_t in_features);
torch::Tensor gguf_linear_tiles(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind, int64_t in_features);
bool gguf_amx_available();
torch::Tensor gguf_linear_amx(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind, int64_t in_features);
torch::Tensor gguf_linear_amx_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                                    const std::vector<int64_t>& kinds, int64_t in_features);
torch::Tensor gguf_silu_gate_amx_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                                       const std::vector<int64_t>& kinds, int64_t in_features);
void gguf_pack_tiles(const std::vector<torch::Tensor>& blocks, const std::vector<int64_t>& kinds,
                     int64_t in_features, bool gate_up, torch::Tensor& tiles);
