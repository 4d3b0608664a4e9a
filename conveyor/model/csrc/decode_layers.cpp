// The decoder layers of a pure-decode step in one call (conveyor.model.decode_stack): the same kernels, in the
// same order, on the same tensors as LlamaModel.forward's Python loop, so the same bits; only the ~180 us per
// layer of Python and torch view ops between them is gone (the default model's 64-row decode step: ~5 ms of
// ~48). For the plain Llama layer only: RMSNorm, fused QKV without bias, rotary, paged decode attention (no
// window, no soft cap), o_proj, RMSNorm, SiLU gate/up fused in one AMX product, down; all weights bfloat16 packed
// in AMX tiles. The caller checks that the model and the step are of that kind.
#include <torch/extension.h>

#include <vector>

#include "kernels.h"

// hidden [tokens, hidden] (the embeddings; updated in place, as the Python loop's add_rms_norm does) ->
// the last layer's output [tokens, hidden], before the final norm. Per layer i: input_norms[i], qkv_tiles[i],
// o_tiles[i], post_norms[i], gate_up_tiles[i] (rows interleaved), down_tiles[i], k_caches[i], v_caches[i].
// cos_table, sin_table: the model's rotary tables [max_positions, head_dim] float32; token t is at positions[t]
// and attends over block_tables[t] (context_lens[t] tokens) after its K/V are written to slot_mapping[t].
namespace {

// The step's rows of a rotary table, in the model's dtype: table[positions].to(dtype), as RotaryEmbedding.tables
// makes them for the Python loop (the same rounding: c10's, to nearest even), gathered here because those four
// torch ops cost ~0.3 ms of a 64-row decode step on the engine's thread, their code and the table cold after the
// step before streamed its weights and K/V through the caches (benchmarks/RESULTS.md, s27).
torch::Tensor rotary_rows(const torch::Tensor& table, const torch::Tensor& positions, c10::ScalarType dtype) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.scalar_type() == at::kFloat,
              "decode_layers needs the rotary tables as contiguous [max_positions, head_dim] float32 tensors");
  TORCH_CHECK(positions.dim() == 1 && positions.is_contiguous() && positions.scalar_type() == at::kLong,
              "decode_layers needs positions as a contiguous [tokens] int64 tensor");
  const int64_t tokens = positions.size(0), max_positions = table.size(0), width = table.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* values = table.data_ptr<float>();
  torch::Tensor rows = torch::empty({tokens, width}, table.options().dtype(dtype));  // [tokens, head_dim]
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

}  // namespace

torch::Tensor decode_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& input_norms,
                            const std::vector<torch::Tensor>& qkv_tiles, const std::vector<torch::Tensor>& o_tiles,
                            const std::vector<torch::Tensor>& post_norms,
                            const std::vector<torch::Tensor>& gate_up_tiles,
                            const std::vector<torch::Tensor>& down_tiles, std::vector<torch::Tensor> k_caches,
                            std::vector<torch::Tensor> v_caches, const torch::Tensor& cos_table,
                            const torch::Tensor& sin_table, const torch::Tensor& positions,
                            const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                            const torch::Tensor& context_lens, int64_t heads, int64_t kv_heads, int64_t head_dim,
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
  const int64_t tokens = hidden.size(0), width = hidden.size(1);
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim;
  const torch::Tensor cos = rotary_rows(cos_table, positions, hidden.scalar_type());  // [tokens, head_dim]
  const torch::Tensor sin = rotary_rows(sin_table, positions, hidden.scalar_type());  // [tokens, head_dim]
  c10::optional<torch::Tensor> delta;  // the previous layer's MLP output, not yet added to hidden
  for (size_t i = 0; i < layers; ++i) {
    const torch::Tensor x = add_rms_norm(hidden, delta, input_norms[i], eps);  // [tokens, hidden]
    const torch::Tensor qkv = bf16_linear_amx(x, qkv_tiles[i], qkv_width);     // [tokens, qkv_width]
    const torch::Tensor qk = rotary_and_cache(qkv, cos, sin, k_caches[i], v_caches[i], slot_mapping, heads,
                                              kv_heads);  // [tokens, heads + kv_heads, head_dim]
    const torch::Tensor q = qk.narrow(1, 0, heads);      // [tokens, heads, head_dim]
    const torch::Tensor attn = decode_attention(q, k_caches[i], v_caches[i], block_tables, context_lens, scale)
                                   .reshape({tokens, heads * head_dim});  // [tokens, heads * head_dim]
    const torch::Tensor attn_out = bf16_linear_amx(attn, o_tiles[i], width);  // [tokens, hidden]
    const torch::Tensor y = add_rms_norm(hidden, attn_out, post_norms[i], eps);  // [tokens, hidden]
    const torch::Tensor act = bf16_silu_gate_amx(y, gate_up_tiles[i], inner);   // [tokens, inner]
    delta = bf16_linear_amx(act, down_tiles[i], width);                          // [tokens, hidden]
  }
  return delta.has_value() ? hidden + *delta : hidden;
}
