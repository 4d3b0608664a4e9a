// The Python module of Conveyor's native CPU kernels: the one unit that includes torch. Each op checks its tensors
// here (device, dtype, shape, contiguity: every message the ops have always given), allocates its output, and calls
// the kernel (kernels.h) with raw pointers and sizes; the kernels are plain C++ compiled without torch's headers.
// Kernels the CPU cannot run were not compiled (conveyor/model/native.py's _SOURCE_NEEDS): their ops raise, saying
// why, and the *_available() / *_vectorized() functions answer false (fallbacks.cpp), so Python keeps torch's path.
// Only the parts of torch the ops use (tensors, the three factory ops, ATen's thread pool, pybind11 and its tensor
// caster): <torch/extension.h> pulls in the whole C++ frontend, several times the compile time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_product.h"
#include "gguf_bf16.h"
#include "gguf_dequant.h"
#include "gguf_vnni.h"
#include "kernels.h"
#include "kv_int8.h"
#include "parallel.h"
#include "stack_parts.h"

namespace {

using conveyor::DType;

// torch's intra-op thread count applied to this thread's OpenMP settings, as every ATen op does before its first
// parallel region (torch.set_num_threads sets it on the calling thread; the engine may call from another).
void init_threads() { at::internal::lazy_init_num_threads(); }

// The element type of a tensor that AT_DISPATCH_FLOATING_TYPES_AND2(kBFloat16, kHalf, ...) takes; its message else.
DType floating(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kDouble: return DType::kDouble;
    case at::kFloat: return DType::kFloat;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kHalf;
    default: TORCH_CHECK(false, '"', op, "\" not implemented for '", toString(t.scalar_type()), "'");
  }
  return DType::kFloat;  // not reached
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

conveyor::BFloat16* bf16(const at::Tensor& t) { return ptr<conveyor::BFloat16>(t); }

// An int8 cache's layout from its shape, checked: `op` names the kernel, max_head_dim is the largest it takes.
conveyor_kv_int8::PageLayout page_layout(const at::Tensor& cache, int64_t head_dim, int64_t max_head_dim,
                                         const char* op) {
  TORCH_CHECK(cache.dim() == 3 && head_dim > 0 && head_dim <= max_head_dim &&
                  cache.size(2) % (head_dim + conveyor_kv_int8::kScaleBytes) == 0 && cache.size(2) > 0,
              op, ": int8 caches must be [num_blocks, kv_heads, block_size * (head_dim + 4)] with head_dim at most ",
              max_head_dim, "; got ", cache.sizes(), " for head_dim ", head_dim);
  return conveyor_kv_int8::PageLayout{cache.size(1), cache.size(2) / (head_dim + conveyor_kv_int8::kScaleBytes),
                                      head_dim};
}

// ---- decode_attention.cpp -------------------------------------------------------------------------------------

// q [num_seqs, heads, head_dim] (last dim contiguous); k_cache, v_cache [num_blocks, block_size, kv_heads,
// head_dim] contiguous in q's dtype, or int8 caches [num_blocks, kv_heads, block_size * (head_dim + 4)]
// (conveyor/model/kv_int8.py); block_tables [num_seqs, max_blocks] int64; context_lens [num_seqs] int64, each in
// 1..max_blocks * block_size (checked, with the block ids each context uses: a bad one raises instead of reading
// outside the cache). Returns [num_seqs, heads, head_dim] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [num_seqs, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "the K and V caches must be contiguous, of one shape and dtype");
  const int64_t head_dim = q.size(2);
  int64_t block_size = 0, kv_heads = 0;
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  if (int8_cache) {
    const auto layout = page_layout(k_cache, head_dim, INT64_MAX, "decode_attention");
    kv_heads = layout.kv_heads;
    block_size = layout.block_size;
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == head_dim,
                "caches must be [num_blocks, block_size, kv_heads, head_dim] with q's head_dim");
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the caches must share a dtype (or the caches be int8)");
    kv_heads = k_cache.size(2);
    block_size = k_cache.size(1);
  }
  TORCH_CHECK(kv_heads > 0 && block_size > 0 && q.size(1) % kv_heads == 0, "heads (", q.size(1),
              ") must be a multiple of kv_heads (", kv_heads, ", the cache's)");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  context_lens.dim() == 1 && context_lens.size(0) == q.size(0) &&
                  context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "block_tables [num_seqs, max_blocks] and context_lens [num_seqs] must be contiguous int64");
  check_contexts(ptr<int64_t>(context_lens), ptr<int64_t>(block_tables), q.size(0), block_tables.size(1), block_size,
                 k_cache.size(0));
  const DType dtype = floating(q, "decode_attention");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  init_threads();
  conveyor_ops::decode_attention(dtype, q.data_ptr(), q.stride(0), q.stride(1),
                                 int8_cache ? nullptr : k_cache.data_ptr(), int8_cache ? nullptr : v_cache.data_ptr(),
                                 int8_cache ? ptr<int8_t>(k_cache) : nullptr,
                                 int8_cache ? ptr<int8_t>(v_cache) : nullptr, ptr<int64_t>(block_tables),
                                 block_tables.size(1), ptr<int64_t>(context_lens), q.size(0), block_size, q.size(1),
                                 kv_heads, head_dim, scale, out.data_ptr());
  return out;
}

// ---- prefill_attention.cpp ------------------------------------------------------------------------------------

bool prefill_attention_available() { return conveyor_ops::prefill_attention_available(); }

// q [tokens, heads, head_dim] bfloat16 (head_dim contiguous, heads adjacent); k_cache, v_cache [num_blocks,
// block_size, kv_heads, head_dim] bfloat16 contiguous, or int8 [num_blocks, kv_heads, block_size * (head_dim + 4)]
// (conveyor/model/kv_int8.py), holding every chunk's K/V already; block_tables [chunks, max_blocks] int64; spans
// [chunks, 3] int64 (first query row in q, queries, context length); out [tokens, heads, head_dim] contiguous: the
// chunks' rows are written, other rows are left as they are. window: the layer's sliding window (keys p - window
// + 1 .. p), 0 for none.
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& spans, double scale, int64_t window,
                       at::Tensor& out) {
  TORCH_CHECK(prefill_attention_available(), "prefill_attention needs AMX-BF16 (see prefill_attention_available)");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q must be a bfloat16 CPU tensor [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "the K and V caches must be contiguous, of one shape and dtype");
  const int64_t heads = q.size(1), head_dim = q.size(2);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  int64_t kv_heads = 0, block_size = 0;
  if (int8_cache) {
    const auto pages = page_layout(k_cache, head_dim, 256, "prefill_attention");
    kv_heads = pages.kv_heads;
    block_size = pages.block_size;
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kBFloat16 && k_cache.size(3) == head_dim,
                "caches must be bfloat16 [num_blocks, block_size, kv_heads, head_dim] with q's head_dim (or int8)");
    kv_heads = k_cache.size(2);
    block_size = k_cache.size(1);
  }
  TORCH_CHECK(head_dim % 32 == 0 && kv_heads > 0 && heads % kv_heads == 0,
              "head_dim must be a multiple of 32 and heads a multiple of kv_heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "out must be contiguous bfloat16 with q's shape");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && spans.scalar_type() == at::kLong && spans.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == spans.size(0) &&
                  block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "spans [chunks, 3] and block_tables [chunks, max_blocks] must be contiguous int64");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 for none), got ", window);
  init_threads();
  conveyor_ops::prefill_attention(bf16(q), q.size(0), q.stride(0), heads, head_dim,
                                  int8_cache ? nullptr : bf16(k_cache), int8_cache ? nullptr : bf16(v_cache),
                                  int8_cache ? ptr<int8_t>(k_cache) : nullptr,
                                  int8_cache ? ptr<int8_t>(v_cache) : nullptr, kv_heads, block_size,
                                  ptr<int64_t>(block_tables), block_tables.size(1), ptr<int64_t>(spans),
                                  spans.size(0), scale, window, bf16(out));
}

// ---- norm_act.cpp ---------------------------------------------------------------------------------------------

// hidden [rows, dim] contiguous, updated in place to hidden + delta when delta is given;
// weight [dim]. Returns RMSNorm(hidden) * weight, [rows, dim] in hidden's dtype.
at::Tensor add_rms_norm(at::Tensor& hidden, const c10::optional<at::Tensor>& delta,
                           const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 2 && hidden.is_contiguous(),
              "hidden must be a contiguous [rows, dim] CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == hidden.scalar_type(),
              "weight must be a contiguous [dim] tensor in hidden's dtype");
  if (delta.has_value()) {
    TORCH_CHECK(delta->sizes() == hidden.sizes() && delta->is_contiguous() &&
                    delta->scalar_type() == hidden.scalar_type(),
                "delta must be contiguous, with hidden's shape and dtype");
  }
  auto out = at::empty_like(hidden);
  const DType dtype = floating(hidden, "add_rms_norm");
  init_threads();
  conveyor_ops::add_rms_norm(dtype, hidden.data_ptr(), delta.has_value() ? delta->data_ptr() : nullptr,
                             weight.data_ptr(), out.data_ptr(), hidden.size(0), hidden.size(1), eps);
  return out;
}

// gate_up [rows, 2 * inner] contiguous -> silu(gate) * up, [rows, inner].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [rows, 2 * inner] CPU tensor");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = at::empty({rows, inner}, gate_up.options());
  const DType dtype = floating(gate_up, "silu_and_mul");
  init_threads();
  conveyor_ops::silu_and_mul(dtype, gate_up.data_ptr(), out.data_ptr(), rows, inner);
  return out;
}

// ---- rotary_cache.cpp -----------------------------------------------------------------------------------------

// qkv [tokens, (heads + 2 * kv_heads) * head_dim] contiguous; cos, sin [tokens, head_dim] in
// qkv's dtype; caches [num_blocks, block_size, kv_heads, head_dim] contiguous in qkv's dtype, or int8 caches
// [num_blocks, kv_heads, block_size * (head_dim + 4)] (kv_int8.h); slot_mapping [tokens] int64.
// Writes each token's rotated K and its V to its slot; returns the rotated Q and K heads,
// [tokens, heads + kv_heads, head_dim].
at::Tensor rotary_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                               int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous 2-D CPU tensor");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "qkv's width must be (heads + 2 * kv_heads) * head_dim");
  const int64_t head_dim = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "the K and V caches must be contiguous, of one shape and dtype");
  int64_t slots_total = 0;
  conveyor_kv_int8::PageLayout layout{};
  if (int8_cache) {
    layout = page_layout(k_cache, head_dim, 512, "rotary_and_cache");
    TORCH_CHECK(layout.kv_heads == kv_heads, "rotary_and_cache: the int8 caches hold ", layout.kv_heads,
                " KV heads, qkv ", kv_heads);
    slots_total = k_cache.size(0) * layout.block_size;
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim &&
                    qkv.scalar_type() == k_cache.scalar_type(),
                "caches must be [num_blocks, block_size, kv_heads, head_dim] in qkv's dtype (or int8 pages)");
    slots_total = k_cache.size(0) * k_cache.size(1);
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * head_dim &&
                  sin.numel() == tokens * head_dim,
              "cos and sin must be contiguous [tokens, head_dim]");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == sin.scalar_type(),
              "qkv, cos and sin must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "slot_mapping must be a contiguous int64 [tokens]");
  const int64_t* slots = ptr<int64_t>(slot_mapping);
  check_slots(slots, tokens, slots_total);
  auto qk = at::empty({tokens, heads + kv_heads, head_dim}, qkv.options());
  const DType dtype = floating(qkv, "rotary_and_cache");
  init_threads();
  conveyor_ops::rotary_and_cache(dtype, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                 int8_cache ? nullptr : k_cache.data_ptr(), int8_cache ? nullptr : v_cache.data_ptr(),
                                 int8_cache ? ptr<int8_t>(k_cache) : nullptr,
                                 int8_cache ? ptr<int8_t>(v_cache) : nullptr, layout, slots, qk.data_ptr(), tokens,
                                 heads, kv_heads, head_dim);
  return qk;
}

// ---- quant_linear.cpp -----------------------------------------------------------------------------------------

bool quant_linear_vectorized() { return conveyor_ops::quant_linear_vectorized(); }

void check_quant_vectorized() {
  TORCH_CHECK(quant_linear_vectorized(), "int4_linear / int8_linear need a CPU with AVX-512 BF16 (this build has none); "
              "conveyor.model.quant uses torch's int4/int8 kernels here");
}

void check_quant_input(const at::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous [rows, in] bfloat16 CPU tensor");
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " columns, the weights take ", in_features);
}

void check_quant_bias(const c10::optional<at::Tensor>& bias, int64_t out_features) {
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                  bias->scalar_type() == at::kBFloat16,
              "bias must be a contiguous [out] bfloat16 CPU tensor");
}

// x [rows, in] bfloat16; blocks [out / 16, in / 32, 320] uint8 (quant_linear.cpp) -> [rows, out] bfloat16.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& blocks, const c10::optional<at::Tensor>& bias) {
  check_quant_vectorized();
  TORCH_CHECK(blocks.device().is_cpu() && blocks.dim() == 3 && blocks.size(2) == conveyor_ops::kInt4BlockBytes &&
                  blocks.is_contiguous() && blocks.scalar_type() == at::kByte,
              "blocks must be contiguous [out / 16, in / 32, 320] uint8 (conveyor.model.quant.pack_int4_blocks)");
  TORCH_CHECK(blocks.size(1) > 0, "blocks have no input columns (in must be a positive multiple of 32)");
  const int64_t num_blocks = blocks.size(0), groups = blocks.size(1);
  const int64_t in_features = groups * conveyor_ops::kQuantGroup, out_features = num_blocks * conveyor_ops::kQuantRows;
  const int64_t rows = x.size(0);
  check_quant_input(x, in_features);
  check_quant_bias(bias, out_features);
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  init_threads();
  conveyor_ops::int4_linear(bf16(x), rows, ptr<uint8_t>(blocks), num_blocks, groups,
                            bias.has_value() ? bf16(*bias) : nullptr, bf16(y));
  return y;
}

// x [rows, in] bfloat16; codes [out / 16, in, 16] int8 (pack_int8_rows); scale [out] float32 -> [rows, out] bfloat16.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  check_quant_vectorized();
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 3 && codes.size(2) == conveyor_ops::kQuantRows &&
                  codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "codes must be contiguous [out / 16, in, 16] int8 (conveyor.model.quant.pack_int8_rows)");
  TORCH_CHECK(codes.size(1) > 0, "codes have no input columns");
  const int64_t num_blocks = codes.size(0), in_features = codes.size(1);
  const int64_t out_features = num_blocks * conveyor_ops::kQuantRows, rows = x.size(0);
  check_quant_input(x, in_features);
  TORCH_CHECK(scale.device().is_cpu() && scale.dim() == 1 && scale.size(0) == out_features &&
                  scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "scale must be a contiguous [out] float32 CPU tensor");
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  const at::Tensor xf = x.to(at::kFloat);  // [rows, in]: bfloat16 widens exactly
  init_threads();
  conveyor_ops::int8_linear(ptr<float>(xf), rows, in_features, ptr<int8_t>(codes), num_blocks, ptr<float>(scale),
                            bf16(y));
  return y;
}

// ---- f32_linear.cpp -------------------------------------------------------------------------------------------

bool f32_linear_vectorized() { return conveyor_ops::f32_linear_vectorized(); }

// x [rows, in] float32; panels [ceil(out / 32), in, 32] float32 (f32_linear.cpp); bias [out] -> [rows, out].
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(f32_linear_vectorized(), "f32_linear needs a CPU with AVX-512 (this build has none); "
              "conveyor.model.layers uses torch's float32 GEMM here");
  constexpr int64_t kPanelCols = conveyor_ops::kF32PanelCols;
  TORCH_CHECK(panels.device().is_cpu() && panels.dim() == 3 && panels.size(2) == kPanelCols &&
                  panels.is_contiguous() && panels.scalar_type() == at::kFloat,
              "panels must be contiguous [ceil(out / 32), in, 32] float32 (conveyor.model.layers.pack_f32_panels)");
  const int64_t num_panels = panels.size(0), K = panels.size(1);
  TORCH_CHECK(K > 0, "panels have no input columns");
  TORCH_CHECK(out_features >= 0 && out_features > (num_panels - 1) * kPanelCols &&
                  out_features <= num_panels * kPanelCols,
              "out_features=", out_features, " does not match ", num_panels, " panels of 32 columns");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be a contiguous [rows, in] float32 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weights take ", K);
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == out_features &&
                    bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "bias must be a contiguous [out] float32 CPU tensor");
  const int64_t rows = x.size(0);
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  init_threads();
  conveyor_ops::f32_linear(ptr<float>(x), rows, K, ptr<float>(panels), num_panels, out_features,
                           bias.has_value() ? ptr<float>(*bias) : nullptr, ptr<float>(y));
  return y;
}

// ---- token_bitmask.cpp ----------------------------------------------------------------------------------------

void check_bitmask_inputs(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask,
                          const char* op) {
  TORCH_CHECK(logits.device().is_cpu() && rows.device().is_cpu() && bitmask.device().is_cpu(), op,
              " is a CPU kernel; got logits on ", logits.device());
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, op, ": logits must be [batch, vocab] with contiguous rows, got ",
              logits.sizes(), " strides ", logits.strides());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, op,
              ": logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), op,
              ": rows must be a contiguous [k] int64 tensor, got ", rows.sizes(), " ", rows.scalar_type());
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(), op,
              ": bitmask must be a contiguous [k, words] int32 tensor, got ", bitmask.sizes(), " ", bitmask.scalar_type());
  const int64_t batch = logits.size(0), vocab = logits.size(1), k = rows.size(0), words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == k, op, ": bitmask has ", bitmask.size(0), " rows for ", k, " row indices");
  TORCH_CHECK(words * 32 >= vocab, op, ": bitmask has ", words, " words per row, too few for ", vocab,
              " tokens (need ", (vocab + 31) / 32, ")");
  conveyor_ops::check_bitmask_rows(ptr<int64_t>(rows), k, batch, op);
}

DType logits_type(const at::Tensor& logits) {
  return logits.scalar_type() == at::kFloat ? DType::kFloat : DType::kBFloat16;
}

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  check_bitmask_inputs(logits, rows, bitmask, "apply_token_bitmask_");
  init_threads();
  conveyor_ops::apply_token_bitmask(logits_type(logits), logits.data_ptr(), logits.stride(0), logits.size(1),
                                    ptr<int64_t>(rows), rows.size(0), ptr<uint32_t>(bitmask), bitmask.size(1));
}

at::Tensor argmax_allowed(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  check_bitmask_inputs(logits, rows, bitmask, "argmax_allowed");
  at::Tensor out = at::empty({rows.size(0)}, at::kLong);  // [k]
  init_threads();
  conveyor_ops::argmax_allowed(logits_type(logits), logits.data_ptr(), logits.stride(0), logits.size(1),
                               ptr<int64_t>(rows), rows.size(0), ptr<uint32_t>(bitmask), bitmask.size(1),
                               ptr<int64_t>(out));
  return out;
}

// ---- argmax_rows.cpp ------------------------------------------------------------------------------------------

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "argmax_rows is a CPU kernel; got logits on ", logits.device());
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "argmax_rows: logits must be [rows, vocab > 0] with contiguous rows, got ", logits.sizes(), " strides ",
              logits.strides());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "argmax_rows: logits must be float32 or bfloat16, got ", logits.scalar_type());
  const int64_t rows = logits.size(0);
  at::Tensor out = at::empty({rows}, at::kLong);  // [rows]
  init_threads();
  conveyor_ops::argmax_rows(logits_type(logits), logits.data_ptr(), rows, logits.size(1), logits.stride(0),
                            ptr<int64_t>(out));
  return out;
}

// ---- amx_product.cpp's packed products (bfloat16 weights packed at load by layers.pack_bf16_tiles) -------------

bool bf16_amx_available() { return conveyor_amx::available(); }

void check_amx_operands(const at::Tensor& x, const at::Tensor& tiles) {
  TORCH_CHECK(tiles.device().is_cpu() && tiles.scalar_type() == at::kBFloat16 && tiles.dim() == 4 &&
              tiles.is_contiguous() && tiles.size(2) == 16 && tiles.size(3) == 32 && tiles.size(0) % 2 == 0,
              "tiles must be a contiguous CPU bfloat16 tensor [out / 16 (even), in / 32, 16, 32] from "
              "pack_bf16_tiles, got ", tiles.sizes(), " ", tiles.scalar_type());
  const int64_t in_features = tiles.size(1) * 32;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
              x.size(1) == in_features, "x must be a CPU bfloat16 tensor [rows, ", in_features, "], got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(conveyor_amx::available(), "bf16_linear_amx needs AMX-BF16 (Intel Sapphire Rapids or later) and a "
              "kernel that grants tile data; this CPU or build has none: keep the weights in oneDNN's layout");
}

at::Tensor bf16_silu_gate_amx(const at::Tensor& x, const at::Tensor& tiles, int64_t inner) {
  check_amx_operands(x, tiles);
  TORCH_CHECK(inner > 0 && inner % 16 == 0 && tiles.size(0) * 16 == 2 * inner, "tiles of ", tiles.size(0) * 16,
              " rows are not the interleaved gate and up rows of an inner width ", inner, " (a multiple of 16)");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const at::Tensor xc = x.contiguous();  // [rows, in]
  auto act = at::empty({rows, inner}, x.options());  // [rows, inner]
  if (rows == 0) return act;
  init_threads();
  conveyor_amx::product_packed_silu_gate_bf16(bf16(xc), rows, in_features, inner, bf16(tiles), bf16(act));
  return act;
}

at::Tensor bf16_linear_amx(const at::Tensor& x, const at::Tensor& tiles, int64_t out_features) {
  constexpr int64_t rows_per_block = conveyor_amx::kPackedRowMultiple;
  check_amx_operands(x, tiles);
  const int64_t padded_rows = tiles.size(0) * 16;
  TORCH_CHECK(out_features > padded_rows - rows_per_block && out_features <= padded_rows, "tiles of ", padded_rows,
              " rows (padded to a multiple of ", rows_per_block, ") do not hold ", out_features, " output rows");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const at::Tensor xc = x.contiguous();  // [rows, in]
  auto y = at::empty({rows, out_features}, x.options());  // [rows, out]
  if (rows == 0 || out_features == 0) return y;
  init_threads();
  conveyor_amx::product_packed_bf16(bf16(xc), rows, in_features, out_features, bf16(tiles), bf16(y));
  return y;
}

at::Tensor bf16_linear_argmax_amx(const at::Tensor& x, const at::Tensor& tiles, int64_t out_features) {
  constexpr int64_t rows_per_block = conveyor_amx::kPackedRowMultiple;
  check_amx_operands(x, tiles);
  const int64_t padded_rows = tiles.size(0) * 16;
  TORCH_CHECK(out_features > 0 && out_features > padded_rows - rows_per_block && out_features <= padded_rows,
              "tiles of ", padded_rows, " rows (padded to a multiple of ", rows_per_block, ") do not hold ",
              out_features, " output rows");
  TORCH_CHECK(out_features <= INT32_MAX, "bf16_linear_argmax_amx takes at most 2^31 - 1 outputs, got ", out_features);
  const int64_t rows = x.size(0), in_features = x.size(1);
  const at::Tensor xc = x.contiguous();  // [rows, in]
  auto tokens = at::empty({rows}, x.options().dtype(at::kLong));  // [rows]
  if (rows == 0) return tokens;
  init_threads();
  conveyor_amx::product_packed_argmax_bf16(bf16(xc), rows, in_features, out_features, bf16(tiles),
                                           ptr<int64_t>(tokens));
  return tokens;
}

// ---- gguf_linear.cpp ------------------------------------------------------------------------------------------

using conveyor_gguf::Format;
using conveyor_ops::GgufPart;

constexpr int64_t kGgufTileBytes = 512 * 1024;  // gguf_linear_tiles: dequantized weights per GEMM tile
constexpr int64_t kGgufMinTileRows = 32;

// Checks the blocks against K and the type; -> the format.
Format checked_format(const at::Tensor& blocks, int64_t kind, int64_t in_features) {
  const Format f = conveyor_gguf::format_of(kind);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
              blocks.is_contiguous(), "blocks must be a contiguous CPU uint8 tensor [rows, row bytes], got ",
              blocks.sizes(), " ", blocks.scalar_type());
  TORCH_CHECK(in_features > 0 && in_features % f.block == 0 && blocks.size(1) == in_features / f.block * f.bytes,
              "blocks of ", blocks.size(1), " bytes per row do not hold ", in_features, " weights of a type with ",
              f.block, " weights in ", f.bytes, " bytes");
  return f;
}

void check_x(const at::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in_features &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a CPU float32 or bfloat16 tensor [rows, ", in_features, "], got ", x.sizes(), " ",
              x.scalar_type());
}

// The parts of a row stack of GGUF matrices (checked against in_features) and, in out_features, its rows.
std::vector<GgufPart> stack_parts(const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& kinds,
                                  int64_t in_features, const char* op, int64_t* out_features) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == kinds.size(), op, " needs one type id per block matrix and at "
              "least one matrix, got ", blocks.size(), " matrices and ", kinds.size(), " ids");
  std::vector<GgufPart> parts;
  *out_features = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Format f = checked_format(blocks[i], kinds[i], in_features);
    parts.push_back({ptr<uint8_t>(blocks[i]), kinds[i], blocks[i].size(1), *out_features, f});
    *out_features += blocks[i].size(0);
  }
  return parts;
}

bool gguf_linear_vectorized() {
#if defined(CONVEYOR_WITH_GGUF_VNNI) && defined(CONVEYOR_WITH_GGUF_BF16) && defined(__AVX512F__) && \
    defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return true;  // AVX-512 VNNI int8 dots, AVX-512 BF16 tiles
#elif defined(CONVEYOR_WITH_GGUF_INT8_AVX2) && defined(__AVX2__) && defined(__FMA__)
  return true;  // AVX2 int8 dots, float32 tiles into torch's GEMM
#else
  return false;
#endif
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t kind, int64_t in_features) {
  const Format f = checked_format(blocks, kind, in_features);
  const int64_t rows = blocks.size(0), row_bytes = blocks.size(1);
  auto y = at::empty({rows, in_features}, at::kFloat);
  init_threads();
  conveyor_ops::gguf_dequantize(f, ptr<uint8_t>(blocks), rows, row_bytes, in_features, ptr<float>(y));
  return y;
}

at::Tensor gguf_linear_rows_parts(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                                     const std::vector<int64_t>& kinds, int64_t in_features, bool int8_float32) {
  int64_t out_features = 0, total_bytes = 0;
  const std::vector<GgufPart> parts = stack_parts(blocks, kinds, in_features, "gguf_linear_rows_parts", &out_features);
  check_x(x, in_features);
  for (const at::Tensor& b : blocks) total_bytes += b.numel();
  const int64_t rows = x.size(0);
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = x.contiguous();  // [rows, in]
  auto y = at::empty({rows, out_features}, x.options());  // [rows, out]
  init_threads();
  conveyor_ops::gguf_linear_rows_parts(parts, out_features, total_bytes, is_bf16, is_bf16 || int8_float32,
                                       xc.data_ptr(), rows, in_features, y.data_ptr());
  return y;
}

at::Tensor gguf_linear_rows(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                               int64_t in_features, bool int8_float32) {
  return gguf_linear_rows_parts(x, {blocks}, {kind}, in_features, int8_float32);
}

// Many rows: each thread dequantizes a tile of weight rows x all K (about kGgufTileBytes, so that it stays in L2) to
// the activations' dtype in its own scratch and runs torch's GEMM on it.
at::Tensor gguf_linear_tiles(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                                int64_t in_features) {
  const Format f = checked_format(blocks, kind, in_features);
  check_x(x, in_features);
  const int64_t rows = x.size(0), out_features = blocks.size(0), row_bytes = blocks.size(1);
  // bfloat16 x on a CPU without native bfloat16 products multiplies in float32: the same products (bfloat16
  // values multiply exactly in float32) and float32 sums, rounded once to bfloat16 on the way out
#if defined(__AVX512BF16__)
  const at::Tensor xc = x.contiguous();  // [rows, in]
#else
  const at::Tensor xc = x.contiguous().to(at::kFloat);  // [rows, in]
#endif
  auto y = at::empty({rows, out_features}, xc.options());
  const uint8_t* bp = ptr<uint8_t>(blocks);
  const int64_t threads = at::get_num_threads();
  const int64_t fits = std::max(kGgufMinTileRows,
                                kGgufTileBytes / (in_features * static_cast<int64_t>(xc.element_size())));
  const int64_t tile_rows = std::max<int64_t>(1, std::min(fits, (out_features + threads - 1) / threads));
  const int64_t tiles = (out_features + tile_rows - 1) / tile_rows;
  const int64_t element = xc.element_size();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(in_features);
    at::Tensor tile = at::empty({tile_rows, in_features}, xc.options());  // [tile rows, in]
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_rows, n = std::min(tile_rows, out_features - n0);
      for (int64_t r = 0; r < n; ++r) {
        if (xc.scalar_type() == at::kBFloat16 && conveyor_gguf::bf16_kind(kind)) {
          conveyor_gguf::dequantize_pieces(kind, bp + (n0 + r) * row_bytes, in_features,
                                           bf16(tile) + r * in_features, 32);  // one row
          continue;
        }
        conveyor_gguf::dequant_row(f, bp + (n0 + r) * row_bytes, in_features, w.data());
        if (xc.scalar_type() == at::kFloat && x.scalar_type() == at::kBFloat16) {  // the weights rounded as
          float* dst = ptr<float>(tile) + r * in_features;                            // a bfloat16 tile's are
          for (int64_t k = 0; k < in_features; ++k) dst[k] = static_cast<float>(conveyor::BFloat16(w[k]));
        } else if (xc.scalar_type() == at::kFloat) {
          std::copy(w.begin(), w.end(), ptr<float>(tile) + r * in_features);
        } else {
          conveyor::BFloat16* dst = bf16(tile) + r * in_features;
          for (int64_t k = 0; k < in_features; ++k) dst[k] = conveyor::BFloat16(w[k]);
        }
      }
      const at::Tensor part = at::mm(xc, tile.narrow(0, 0, n).t()).contiguous();  // [rows, n]
      // copied by hand: torch ops writing y here would run outside the caller's inference mode
      const char* src = static_cast<const char*>(part.data_ptr());
      char* dst = static_cast<char*>(y.data_ptr());
      for (int64_t m = 0; m < rows; ++m)
        std::memcpy(dst + (m * out_features + n0) * element, src + m * n * element, n * element);
    }
  });
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

bool gguf_amx_available() { return conveyor_amx::available(); }

void check_amx(const char* op) {
  TORCH_CHECK(conveyor_amx::available(), op, " needs AMX-BF16 (Intel Sapphire Rapids or later) and a kernel that "
              "grants tile data; this CPU or build has none: use gguf_linear_tiles");
}

// The AMX product of a row stack with x [rows, in] (bfloat16): y = x W^T [rows, out], or where `silu_gate` (W = [Wg; Wu],
// halves of a multiple of 16 rows) silu(x Wg^T) * (x Wu^T) [rows, out / 2]. `op` names the operation in errors about
// the stack, `input_op` in those about x.
at::Tensor stack_product_amx(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                                const std::vector<int64_t>& kinds, int64_t in_features, bool silu_gate, const char* op,
                                const char* input_op) {
  int64_t out_features = 0;
  const std::vector<GgufPart> parts = stack_parts(blocks, kinds, in_features, op, &out_features);
  check_x(x, in_features);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, input_op, " multiplies bfloat16 activations, got ",
              x.scalar_type(), "; use gguf_linear_tiles for float32 ones");
  check_amx(input_op);
  TORCH_CHECK(!silu_gate || out_features % 32 == 0, op, " takes a [gate; up] stack whose halves split into 16-row "
              "tiles; got ", out_features, " rows");
  const at::Tensor xc = x.contiguous();  // [rows, in]
  const int64_t rows = xc.size(0), inner = out_features / 2;
  auto y = at::empty({rows, silu_gate ? inner : out_features}, x.options());  // [rows, out or inner]
  if (rows == 0 || out_features == 0) return y;
  init_threads();
  conveyor_ops::gguf_stack_product_amx(parts, out_features, silu_gate, bf16(xc), rows, in_features, bf16(y));
  return y;
}

at::Tensor gguf_linear_amx_parts(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                                    const std::vector<int64_t>& kinds, int64_t in_features) {
  return stack_product_amx(x, blocks, kinds, in_features, false, "gguf_linear_amx_parts", "gguf_linear_amx");
}

at::Tensor gguf_silu_gate_amx_parts(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                                       const std::vector<int64_t>& kinds, int64_t in_features) {
  return stack_product_amx(x, blocks, kinds, in_features, true, "gguf_silu_gate_amx_parts",
                           "gguf_silu_gate_amx_parts");
}

at::Tensor gguf_linear_amx(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                              int64_t in_features) {
  return gguf_linear_amx_parts(x, {blocks}, {kind}, in_features);
}

void gguf_pack_tiles(const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& kinds,
                     int64_t in_features, bool gate_up, at::Tensor& tiles) {
  int64_t out_features = 0;
  const std::vector<GgufPart> parts = stack_parts(blocks, kinds, in_features, "gguf_pack_tiles", &out_features);
  check_amx("gguf_pack_tiles");
  constexpr int64_t kRows = 16;
  const int64_t k_tiles = in_features / 32, row_tiles = (out_features + 2 * kRows - 1) / (2 * kRows) * 2;
  TORCH_CHECK(tiles.device().is_cpu() && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() &&
              tiles.dim() == 4 && tiles.size(0) == row_tiles && tiles.size(1) == k_tiles && tiles.size(2) == kRows &&
              tiles.size(3) == 32, "tiles must be a contiguous CPU bfloat16 tensor [", row_tiles, ", ", k_tiles,
              ", 16, 32] for ", out_features, " rows of ", in_features, " weights, got ", tiles.sizes(), " ",
              tiles.scalar_type());
  TORCH_CHECK(in_features % 32 == 0, "gguf_pack_tiles needs an input width that is a multiple of 32, got ",
              in_features);
  const int64_t inner = out_features / 2;
  TORCH_CHECK(!gate_up || (inner % kRows == 0 && out_features % 2 == 0), "gate/up rows interleave 16 and 16: ",
              out_features, " rows are not two halves of a multiple of 16");
  init_threads();
  conveyor_ops::gguf_pack_tiles(parts, out_features, in_features, gate_up, bf16(tiles));
}


// ---- decode_layers.cpp ----------------------------------------------------------------------------------------

// hidden [tokens, hidden] (the embeddings; updated in place, as the Python loop's add_rms_norm does) ->
// the last layer's output [tokens, hidden], before the final norm. Per layer i: input_norms[i], qkv_tiles[i],
// o_tiles[i], post_norms[i], gate_up_tiles[i] (rows interleaved), down_tiles[i], k_caches[i], v_caches[i].
// cos_table, sin_table: the model's rotary tables [max_positions, head_dim] float32; token t is at positions[t]
// and attends over block_tables[t] (context_lens[t] tokens) after its K/V are written to slot_mapping[t].
// The step's rows of a rotary table, in the model's dtype: table[positions].to(dtype), as RotaryEmbedding.tables
// makes them for the Python loop (the same rounding: c10's, to nearest even), gathered here rather than by four
// torch ops on the engine's thread, whose code and the table are cold after a step streamed weights and K/V.
at::Tensor rotary_rows(const at::Tensor& table, const at::Tensor& positions, c10::ScalarType dtype) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.scalar_type() == at::kFloat,
              "decode_layers needs the rotary tables as contiguous [max_positions, head_dim] float32 tensors");
  TORCH_CHECK(positions.dim() == 1 && positions.is_contiguous() && positions.scalar_type() == at::kLong,
              "decode_layers needs positions as a contiguous [tokens] int64 tensor");
  const int64_t tokens = positions.size(0), max_positions = table.size(0), width = table.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* values = table.data_ptr<float>();
  at::Tensor rows = at::empty({tokens, width}, table.options().dtype(dtype));  // [tokens, head_dim]
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rotary_rows", [&] {
    scalar_t* out = rows.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "decode_layers: token ", t, " is at position ", pos[t],
                  ", outside the rotary table's 0..", max_positions - 1);
      const float* row = values + pos[t] * width;
      for (int64_t d = 0; d < width; ++d) out[t * width + d] = static_cast<scalar_t>(row[d]);
    }
  });
  return rows;
}

// A layer stack's weights, one of each per layer.
struct Weights {
  const std::vector<at::Tensor>& input_norms;
  const std::vector<at::Tensor>& qkv_tiles;
  const std::vector<at::Tensor>& o_tiles;
  const std::vector<at::Tensor>& post_norms;
  const std::vector<at::Tensor>& gate_up_tiles;
  const std::vector<at::Tensor>& down_tiles;
};

// The step's tokens and the model's shape.
struct Step {
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& context_lens;
  int64_t heads, kv_heads, head_dim, inner;
  double eps, scale;

  int64_t qkv_width() const { return (heads + 2 * kv_heads) * head_dim; }
};

// The ops one by one, each in its own parallel region (an int8 cache). cos, sin: the step's rotary rows.
at::Tensor decode_layers_ops(at::Tensor& hidden, const Weights& w, std::vector<at::Tensor>& k_caches,
                                std::vector<at::Tensor>& v_caches, const at::Tensor& cos,
                                const at::Tensor& sin, const Step& step) {
  const int64_t width = hidden.size(1);
  c10::optional<at::Tensor> delta;  // the previous layer's MLP output, not yet added to hidden
  for (size_t i = 0; i < w.input_norms.size(); ++i) {
    const at::Tensor x = add_rms_norm(hidden, delta, w.input_norms[i], step.eps);  // [tokens, hidden]
    const at::Tensor qkv = bf16_linear_amx(x, w.qkv_tiles[i], step.qkv_width());   // [tokens, qkv_width]
    const at::Tensor qk = rotary_and_cache(qkv, cos, sin, k_caches[i], v_caches[i], step.slot_mapping,
                                              step.heads, step.kv_heads);  // [tokens, heads + kv_heads, head_dim]
    const at::Tensor q = qk.narrow(1, 0, step.heads);  // [tokens, heads, head_dim]
    const at::Tensor attn =
        decode_attention(q, k_caches[i], v_caches[i], step.block_tables, step.context_lens, step.scale)
            .reshape({hidden.size(0), step.heads * step.head_dim});  // [tokens, heads * head_dim]
    const at::Tensor attn_out = bf16_linear_amx(attn, w.o_tiles[i], width);        // [tokens, hidden]
    const at::Tensor y = add_rms_norm(hidden, attn_out, w.post_norms[i], step.eps);  // [tokens, hidden]
    const at::Tensor act = bf16_silu_gate_amx(y, w.gate_up_tiles[i], step.inner);    // [tokens, inner]
    delta = bf16_linear_amx(act, w.down_tiles[i], width);                               // [tokens, hidden]
  }
  return delta.has_value() ? hidden + *delta : hidden;
}

// Every op's operands checked once, before the one region (where nothing may raise): what each op checks itself.
void check_team_step(const at::Tensor& hidden, const Weights& w, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const Step& step) {
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "decode_layers runs bfloat16 hidden states, got ",
              hidden.scalar_type());
  TORCH_CHECK(conveyor_amx::available(), "decode_layers needs AMX-BF16 (its weights are packed in AMX tiles)");
  const int64_t width = hidden.size(1), tokens = hidden.size(0);
  TORCH_CHECK(step.heads > 0 && step.kv_heads > 0 && step.heads % step.kv_heads == 0 && step.head_dim % 2 == 0,
              "decode_layers: heads (", step.heads, ") must be a multiple of kv_heads (", step.kv_heads,
              ") and head_dim (", step.head_dim, ") even");
  const auto check_tiles = [](const at::Tensor& tiles, int64_t in, int64_t out, const char* name, size_t layer) {
    TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.dim() == 4 && tiles.is_contiguous() &&
                    tiles.size(1) * 32 == in && tiles.size(2) == 16 && tiles.size(3) == 32 && tiles.size(0) % 2 == 0 &&
                    tiles.size(0) * 16 >= out && tiles.size(0) * 16 - out < 32,
                "decode_layers: layer ", layer, "'s ", name, " tiles ", tiles.sizes(), " are not bfloat16 tiles of a [",
                out, ", ", in, "] weight (pack_bf16_tiles)");
  };
  const auto check_norm = [&](const at::Tensor& norm, const char* name, size_t layer) {
    TORCH_CHECK(norm.scalar_type() == at::kBFloat16 && norm.dim() == 1 && norm.size(0) == width &&
                    norm.is_contiguous(),
                "decode_layers: layer ", layer, "'s ", name, " weight must be a contiguous bfloat16 [", width,
                "], got ", norm.sizes(), " ", norm.scalar_type());
  };
  const at::Tensor& first = k_caches[0];
  TORCH_CHECK(first.dim() == 4 && first.size(2) == step.kv_heads && first.size(3) == step.head_dim,
              "decode_layers: caches must be [num_blocks, block_size, kv_heads, head_dim], got ", first.sizes());
  for (size_t i = 0; i < w.input_norms.size(); ++i) {
    check_norm(w.input_norms[i], "input norm", i);
    check_norm(w.post_norms[i], "post-attention norm", i);
    check_tiles(w.qkv_tiles[i], width, step.qkv_width(), "qkv", i);
    check_tiles(w.o_tiles[i], step.heads * step.head_dim, width, "o_proj", i);
    check_tiles(w.gate_up_tiles[i], width, 2 * step.inner, "gate/up", i);
    check_tiles(w.down_tiles[i], step.inner, width, "down", i);
    for (const at::Tensor* cache : {&k_caches[i], &v_caches[i]}) {
      TORCH_CHECK(cache->scalar_type() == at::kBFloat16 && cache->is_contiguous() && cache->sizes() == first.sizes(),
                  "decode_layers: layer ", i, "'s caches must be contiguous bfloat16 ", first.sizes(), ", got ",
                  cache->sizes(), " ", cache->scalar_type());
    }
  }
  const at::Tensor& tables = step.block_tables;
  const at::Tensor& lens = step.context_lens;
  const at::Tensor& slots = step.slot_mapping;
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == tokens && tables.scalar_type() == at::kLong &&
                  tables.is_contiguous() && lens.dim() == 1 && lens.size(0) == tokens &&
                  lens.scalar_type() == at::kLong && lens.is_contiguous() && slots.dim() == 1 &&
                  slots.size(0) == tokens && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "decode_layers: block_tables [tokens, max_blocks], context_lens and slot_mapping [tokens] must be "
              "contiguous int64");
  const int64_t num_blocks = first.size(0), block_size = first.size(1);
  check_contexts(lens.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), tokens, tables.size(1), block_size, num_blocks);
  check_slots(slots.data_ptr<int64_t>(), tokens, num_blocks * block_size);
}

// The layers in one parallel region (plain bfloat16 caches; checked by check_team_step).
at::Tensor decode_layers_team(at::Tensor& hidden, const Weights& w, std::vector<at::Tensor>& k_caches,
                                 std::vector<at::Tensor>& v_caches, const at::Tensor& cos,
                                 const at::Tensor& sin, const Step& step) {
  using Bf16 = conveyor::BFloat16;
  const int64_t layers = static_cast<int64_t>(w.input_norms.size());
  const int64_t tokens = hidden.size(0), width = hidden.size(1), heads = step.heads, kv_heads = step.kv_heads;
  const int64_t head_dim = step.head_dim, qkv_width = step.qkv_width(), inner = step.inner;
  const auto options = hidden.options();
  at::Tensor x = at::empty({tokens, width}, options);                          // normed input; then y
  at::Tensor qkv = at::empty({tokens, qkv_width}, options);                    // [tokens, qkv_width]
  at::Tensor qk = at::empty({tokens, heads + kv_heads, head_dim}, options);    // rotated Q and K heads
  at::Tensor attn = at::empty({tokens, heads * head_dim}, options);            // [tokens, heads * head_dim]
  at::Tensor attn_out = at::empty({tokens, width}, options);                   // [tokens, hidden]
  at::Tensor act = at::empty({tokens, inner}, options);                        // [tokens, inner]
  at::Tensor delta = at::empty({tokens, width}, options);                      // the MLP's output
  Bf16* h = bf16(hidden);
  Bf16* x_ptr = bf16(x);
  Bf16* qkv_ptr = bf16(qkv);
  Bf16* qk_ptr = bf16(qk);
  Bf16* attn_ptr = bf16(attn);
  Bf16* attn_out_ptr = bf16(attn_out);
  Bf16* act_ptr = bf16(act);
  Bf16* delta_ptr = bf16(delta);
  const Bf16* cos_ptr = bf16(cos);
  const Bf16* sin_ptr = bf16(sin);
  const int64_t* slots = step.slot_mapping.data_ptr<int64_t>();
  const int64_t* tables = step.block_tables.data_ptr<int64_t>();
  const int64_t* lens = step.context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = step.block_tables.size(1), block_size = k_caches[0].size(1);
  std::vector<const Bf16*> input_norm(layers), post_norm(layers), qkv_w(layers), o_w(layers), gate_up_w(layers),
      down_w(layers);
  std::vector<Bf16*> k_cache(layers), v_cache(layers);
  for (int64_t i = 0; i < layers; ++i) {
    input_norm[i] = bf16(w.input_norms[i]);
    post_norm[i] = bf16(w.post_norms[i]);
    qkv_w[i] = bf16(w.qkv_tiles[i]);
    o_w[i] = bf16(w.o_tiles[i]);
    gate_up_w[i] = bf16(w.gate_up_tiles[i]);
    down_w[i] = bf16(w.down_tiles[i]);
    k_cache[i] = bf16(k_caches[i]);
    v_cache[i] = bf16(v_caches[i]);
  }
  const conveyor_ops::DecodeStack stack{layers, tokens, width, heads, kv_heads, head_dim, inner, step.eps, step.scale,
                                        h, x_ptr, qkv_ptr, qk_ptr, attn_ptr, attn_out_ptr, act_ptr, delta_ptr,
                                        cos_ptr, sin_ptr, slots, tables, lens, max_blocks, block_size,
                                        input_norm.data(), post_norm.data(), qkv_w.data(), o_w.data(),
                                        gate_up_w.data(), down_w.data(), k_cache.data(), v_cache.data()};
  init_threads();
  conveyor_ops::decode_layers_team(stack);
  return layers > 0 ? hidden + delta : hidden;
}

at::Tensor decode_layers(at::Tensor hidden, const std::vector<at::Tensor>& input_norms,
                            const std::vector<at::Tensor>& qkv_tiles, const std::vector<at::Tensor>& o_tiles,
                            const std::vector<at::Tensor>& post_norms,
                            const std::vector<at::Tensor>& gate_up_tiles,
                            const std::vector<at::Tensor>& down_tiles, std::vector<at::Tensor> k_caches,
                            std::vector<at::Tensor> v_caches, const at::Tensor& cos_table,
                            const at::Tensor& sin_table, const at::Tensor& positions,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t inner, double eps, double scale) {
  const size_t layers = input_norms.size();
  TORCH_CHECK(qkv_tiles.size() == layers && o_tiles.size() == layers && post_norms.size() == layers &&
                  gate_up_tiles.size() == layers && down_tiles.size() == layers && k_caches.size() == layers &&
                  v_caches.size() == layers,
              "decode_layers needs one of each weight and cache per layer; got ", layers, " input norms, ",
              qkv_tiles.size(), " qkv, ", o_tiles.size(), " o_proj, ", post_norms.size(), " post norms, ",
              gate_up_tiles.size(), " gate/up, ", down_tiles.size(), " down, ", k_caches.size(), " K and ",
              v_caches.size(), " V caches");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [tokens, hidden] tensor");
  const Weights weights{input_norms, qkv_tiles, o_tiles, post_norms, gate_up_tiles, down_tiles};
  const Step step{slot_mapping, block_tables, context_lens, heads, kv_heads, head_dim, inner, eps, scale};
  const at::Tensor cos = rotary_rows(cos_table, positions, hidden.scalar_type());  // [tokens, head_dim]
  const at::Tensor sin = rotary_rows(sin_table, positions, hidden.scalar_type());  // [tokens, head_dim]
  if (layers == 0 || hidden.size(0) == 0) return hidden;
  if (k_caches[0].scalar_type() == at::kChar) return decode_layers_ops(hidden, weights, k_caches, v_caches, cos, sin, step);
  check_team_step(hidden, weights, k_caches, v_caches, step);
  return decode_layers_team(hidden, weights, k_caches, v_caches, cos, sin, step);
}

}  // namespace
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
  m.def("gguf_linear_vectorized", &gguf_linear_vectorized,
        "Whether gguf_linear_* were built with vectorized int8 dot products (AVX-512 VNNI + BF16, or AVX2 + FMA)");
  m.def("gguf_dequantize", &gguf_dequantize, no_gil, "GGUF-quantized rows -> float32 (CPU)");
  m.def("gguf_linear_rows", &gguf_linear_rows, no_gil, "x @ W^T, W in GGUF blocks, few rows of x (CPU)", py::arg("x"),
        py::arg("blocks"), py::arg("kind"), py::arg("in_features"), py::arg("int8_float32") = false);
  m.def("gguf_linear_rows_parts", &gguf_linear_rows_parts, no_gil,
        "x @ [W_1; W_2; ...]^T, each W in GGUF blocks of its own type, few rows of x, x quantized once (CPU)",
        py::arg("x"), py::arg("blocks"), py::arg("kinds"), py::arg("in_features"), py::arg("int8_float32") = false);
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
