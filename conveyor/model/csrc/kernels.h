// The kernels' entry points over raw pointers and sizes, one group per source file, for bindings.cpp (the only unit
// that sees torch: it checks the tensors and calls these) and for kernels that run others (decode_layers.cpp).
// Plain C++: nothing here includes a torch header. Element types are scalar_types.h's; a `DType` argument says
// which type the untyped pointers of a multi-dtype op point to. A kernel checks only what depends on its operands'
// values (a slot, a context length, a chunk's span), raising std::runtime_error; every shape, dtype and layout
// check is the caller's.
#pragma once

#include <cstdint>
#include <vector>

#include "gguf_dequant.h"
#include "kv_int8.h"
#include "scalar_types.h"

namespace conveyor_ops {

// norm_act.cpp: hidden [rows, dim] += delta (when not null), out = RMSNorm(hidden) * weight [dim]; and
// out [rows, inner] = silu(gate) * up for gate_up [rows, 2 inner].
void add_rms_norm(conveyor::DType dtype, void* hidden, const void* delta, const void* weight, void* out, int64_t rows,
                  int64_t dim, double eps);
void silu_and_mul(conveyor::DType dtype, const void* gate_up, void* out, int64_t rows, int64_t inner);

// rotary_cache.cpp: qkv [tokens, (heads + 2 kv_heads) head_dim], cos, sin [tokens, head_dim] -> qk [tokens, heads +
// kv_heads, head_dim]; each token's rotated K and its V written to its slot of the plain caches k_cache, v_cache
// (k_codes, v_codes null) or of the int8 pages k_codes, v_codes (laid out by `layout`; k_cache, v_cache null).
void rotary_and_cache(conveyor::DType dtype, const void* qkv, const void* cos, const void* sin, void* k_cache,
                      void* v_cache, int8_t* k_codes, int8_t* v_codes, const conveyor_kv_int8::PageLayout& layout,
                      const int64_t* slots, void* qk, int64_t tokens, int64_t heads, int64_t kv_heads,
                      int64_t head_dim);

// decode_attention.cpp: q [num_seqs, heads, head_dim] (rows and heads at the given strides) over the plain caches
// [num_blocks, block_size, kv_heads, head_dim] (k_codes, v_codes null) or int8 pages (k_cache, v_cache null) ->
// out [num_seqs, heads, head_dim] contiguous. Contexts checked by the caller (check_contexts, stack_parts.h).
void decode_attention(conveyor::DType dtype, const void* q, int64_t q_seq_stride, int64_t q_head_stride,
                      const void* k_cache, const void* v_cache, const int8_t* k_codes, const int8_t* v_codes,
                      const int64_t* block_tables, int64_t max_blocks, const int64_t* context_lens, int64_t num_seqs,
                      int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, void* out);

// token_bitmask.cpp: logits [batch, vocab] float32 (DType::kFloat) or bfloat16, rows `stride` apart; row_ids [k];
// bits [k, words]. check_bitmask_rows raises for a row id outside 0..batch - 1 (op names the op).
void check_bitmask_rows(const int64_t* row_ids, int64_t k, int64_t batch, const char* op);
void apply_token_bitmask(conveyor::DType dtype, void* logits, int64_t stride, int64_t vocab, const int64_t* row_ids,
                         int64_t k, const uint32_t* bits, int64_t words);
void argmax_allowed(conveyor::DType dtype, const void* logits, int64_t stride, int64_t vocab, const int64_t* row_ids,
                    int64_t k, const uint32_t* bits, int64_t words, int64_t* tokens);

// argmax_rows.cpp: logits [rows, vocab] float32 or bfloat16, rows `stride` apart -> tokens [rows].
void argmax_rows(conveyor::DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t stride,
                 int64_t* tokens);

// f32_linear.cpp (AVX-512): x [rows, K]; panels [num_panels, K, 32]; bias [out] or null -> y [rows, out].
constexpr int64_t kF32PanelCols = 32;
bool f32_linear_vectorized();
void f32_linear(const float* x, int64_t rows, int64_t K, const float* panels, int64_t num_panels, int64_t out_features,
                const float* bias, float* y);

// quant_linear.cpp (AVX-512 BF16): int4 blocks [num_blocks = out / 16, groups = in / 32, 320 bytes]; int8 codes
// [num_blocks, in, 16] with a float32 scale per output row, x widened to float32.
constexpr int64_t kQuantRows = 16, kQuantGroup = 32, kInt4BlockBytes = 320;
bool quant_linear_vectorized();
void int4_linear(const conveyor::BFloat16* x, int64_t rows, const uint8_t* blocks, int64_t num_blocks, int64_t groups,
                 const conveyor::BFloat16* bias, conveyor::BFloat16* y);
void int8_linear(const float* x, int64_t rows, int64_t in_features, const int8_t* codes, int64_t num_blocks,
                 const float* scale, conveyor::BFloat16* y);

// gguf_linear.cpp: products with weights in GGUF blocks. A row stack of matrices is given as parts, each output rows
// first.. of its own type (format: gguf_dequant.h's), row_bytes apart.
struct GgufPart {
  const uint8_t* blocks;
  int64_t kind;
  int64_t row_bytes;
  int64_t first;
  conveyor_gguf::Format format;
};
void gguf_dequantize(const conveyor_gguf::Format& format, const uint8_t* blocks, int64_t rows, int64_t row_bytes,
                     int64_t in_features, float* y);
// x [rows, in] float32, or bfloat16 where bf16 -> y [rows, out] in x's type (total_bytes: the stack's weight bytes);
// int8_dots: x quantized to int8 for the integer dot products of the types that have one (else every row exactly).
void gguf_linear_rows_parts(const std::vector<GgufPart>& parts, int64_t out_features, int64_t total_bytes, bool bf16,
                            bool int8_dots, const void* x, int64_t rows, int64_t in_features, void* y);
// On AMX tiles (only where conveyor_amx::available()): y [rows, out] = x W^T, or where silu_gate y [rows, out / 2].
void gguf_stack_product_amx(const std::vector<GgufPart>& parts, int64_t out_features, bool silu_gate,
                            const conveyor::BFloat16* x, int64_t rows, int64_t in_features, conveyor::BFloat16* y);
// The stack dequantized into bfloat16 tiles [row tiles][in / 32][16][32] as pack_bf16_tiles lays them out.
void gguf_pack_tiles(const std::vector<GgufPart>& parts, int64_t out_features, int64_t in_features, bool gate_up,
                     conveyor::BFloat16* tiles);

// prefill_attention.cpp (AMX): see the file.
bool prefill_attention_available();
void prefill_attention(const conveyor::BFloat16* q, int64_t tokens, int64_t q_row_stride, int64_t heads,
                       int64_t head_dim, const conveyor::BFloat16* k_cache, const conveyor::BFloat16* v_cache,
                       const int8_t* k_codes, const int8_t* v_codes, int64_t kv_heads, int64_t block_size,
                       const int64_t* block_tables, int64_t max_blocks, const int64_t* spans, int64_t num_chunks,
                       double scale, int64_t window, conveyor::BFloat16* out);

// decode_layers.cpp (AMX): a pure-decode step's plain Llama layers in one parallel region, bfloat16 throughout,
// plain caches. Per-layer arrays hold `layers` pointers; x .. delta are the caller's scratch.
struct DecodeStack {
  int64_t layers, tokens, width, heads, kv_heads, head_dim, inner;
  double eps, scale;
  conveyor::BFloat16* hidden;  // [tokens, width], updated in place
  conveyor::BFloat16 *x, *qkv, *qk, *attn, *attn_out, *act;
  conveyor::BFloat16* delta;  // [tokens, width]: the last layer's MLP output on return
  const conveyor::BFloat16 *cos, *sin;  // [tokens, head_dim]
  const int64_t *slots, *block_tables, *context_lens;
  int64_t max_blocks, block_size;
  const conveyor::BFloat16* const* input_norms;
  const conveyor::BFloat16* const* post_norms;
  const conveyor::BFloat16* const* qkv_tiles;
  const conveyor::BFloat16* const* o_tiles;
  const conveyor::BFloat16* const* gate_up_tiles;
  const conveyor::BFloat16* const* down_tiles;
  conveyor::BFloat16* const* k_caches;
  conveyor::BFloat16* const* v_caches;
};
void decode_layers_team(const DecodeStack& stack);

}  // namespace conveyor_ops
