// The decoder layers of a pure-decode step in one call (conveyor.model.decode_stack): the same kernels, in the
// same order, on the same tensors as LlamaModel.forward's Python loop, so the same bits; only the ~180 us per
// layer of Python and torch view ops between them is gone (the default model's 64-row decode step: ~5 ms of
// ~48). For the plain Llama layer only: RMSNorm, fused QKV without bias, rotary, paged decode attention (no
// window, no soft cap), o_proj, RMSNorm, SiLU gate/up fused in one AMX product, down; all weights bfloat16 packed
// in AMX tiles. The caller checks that the model and the step are of that kind.
//
// With plain bfloat16 caches the whole stack runs in one parallel region: the threads go through the layers
// together and meet at a barrier after each op (team.h), each taking its share of the op (stack_parts.h; the
// products' units in turn, as they do in their own region: UnitTeam). Every output is still computed by one thread
// in one order, so the bits do not change. One region per op cost a fork, a join and the calling thread's work
// between ops (their checks and output tensors) while the other thread waited: in a W1 decode step the second
// thread waited ~15% of its time (benchmarks/RESULTS.md, s29). An int8 cache runs the ops one by one, each in its
// region.
#include <torch/extension.h>

#include <omp.h>

#include <atomic>
#include <exception>
#include <memory>
#include <vector>

#include "amx_product.h"
#include "kernels.h"
#include "stack_parts.h"
#include "team.h"

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

// A layer stack's weights, one of each per layer.
struct Weights {
  const std::vector<torch::Tensor>& input_norms;
  const std::vector<torch::Tensor>& qkv_tiles;
  const std::vector<torch::Tensor>& o_tiles;
  const std::vector<torch::Tensor>& post_norms;
  const std::vector<torch::Tensor>& gate_up_tiles;
  const std::vector<torch::Tensor>& down_tiles;
};

// The step's tokens and the model's shape.
struct Step {
  const torch::Tensor& slot_mapping;
  const torch::Tensor& block_tables;
  const torch::Tensor& context_lens;
  int64_t heads, kv_heads, head_dim, inner;
  double eps, scale;

  int64_t qkv_width() const { return (heads + 2 * kv_heads) * head_dim; }
};

// The ops one by one, each in its own parallel region (an int8 cache). cos, sin: the step's rotary rows.
torch::Tensor decode_layers_ops(torch::Tensor& hidden, const Weights& w, std::vector<torch::Tensor>& k_caches,
                                std::vector<torch::Tensor>& v_caches, const torch::Tensor& cos,
                                const torch::Tensor& sin, const Step& step) {
  const int64_t width = hidden.size(1);
  c10::optional<torch::Tensor> delta;  // the previous layer's MLP output, not yet added to hidden
  for (size_t i = 0; i < w.input_norms.size(); ++i) {
    const torch::Tensor x = add_rms_norm(hidden, delta, w.input_norms[i], step.eps);  // [tokens, hidden]
    const torch::Tensor qkv = bf16_linear_amx(x, w.qkv_tiles[i], step.qkv_width());   // [tokens, qkv_width]
    const torch::Tensor qk = rotary_and_cache(qkv, cos, sin, k_caches[i], v_caches[i], step.slot_mapping,
                                              step.heads, step.kv_heads);  // [tokens, heads + kv_heads, head_dim]
    const torch::Tensor q = qk.narrow(1, 0, step.heads);  // [tokens, heads, head_dim]
    const torch::Tensor attn =
        decode_attention(q, k_caches[i], v_caches[i], step.block_tables, step.context_lens, step.scale)
            .reshape({hidden.size(0), step.heads * step.head_dim});  // [tokens, heads * head_dim]
    const torch::Tensor attn_out = bf16_linear_amx(attn, w.o_tiles[i], width);        // [tokens, hidden]
    const torch::Tensor y = add_rms_norm(hidden, attn_out, w.post_norms[i], step.eps);  // [tokens, hidden]
    const torch::Tensor act = bf16_silu_gate_amx(y, w.gate_up_tiles[i], step.inner);    // [tokens, inner]
    delta = bf16_linear_amx(act, w.down_tiles[i], width);                               // [tokens, hidden]
  }
  return delta.has_value() ? hidden + *delta : hidden;
}

// Every op's operands checked once, before the one region (where nothing may raise): what each op checks itself.
void check_team_step(const torch::Tensor& hidden, const Weights& w, const std::vector<torch::Tensor>& k_caches,
                     const std::vector<torch::Tensor>& v_caches, const Step& step) {
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "decode_layers runs bfloat16 hidden states, got ",
              hidden.scalar_type());
  TORCH_CHECK(conveyor_amx::available(), "decode_layers needs AMX-BF16 (its weights are packed in AMX tiles)");
  const int64_t width = hidden.size(1), tokens = hidden.size(0);
  TORCH_CHECK(step.heads > 0 && step.kv_heads > 0 && step.heads % step.kv_heads == 0 && step.head_dim % 2 == 0,
              "decode_layers: heads (", step.heads, ") must be a multiple of kv_heads (", step.kv_heads,
              ") and head_dim (", step.head_dim, ") even");
  const auto check_tiles = [](const torch::Tensor& tiles, int64_t in, int64_t out, const char* name, size_t layer) {
    TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.dim() == 4 && tiles.is_contiguous() &&
                    tiles.size(1) * 32 == in && tiles.size(2) == 16 && tiles.size(3) == 32 && tiles.size(0) % 2 == 0 &&
                    tiles.size(0) * 16 >= out && tiles.size(0) * 16 - out < 32,
                "decode_layers: layer ", layer, "'s ", name, " tiles ", tiles.sizes(), " are not bfloat16 tiles of a [",
                out, ", ", in, "] weight (pack_bf16_tiles)");
  };
  const auto check_norm = [&](const torch::Tensor& norm, const char* name, size_t layer) {
    TORCH_CHECK(norm.scalar_type() == at::kBFloat16 && norm.dim() == 1 && norm.size(0) == width &&
                    norm.is_contiguous(),
                "decode_layers: layer ", layer, "'s ", name, " weight must be a contiguous bfloat16 [", width,
                "], got ", norm.sizes(), " ", norm.scalar_type());
  };
  const torch::Tensor& first = k_caches[0];
  TORCH_CHECK(first.dim() == 4 && first.size(2) == step.kv_heads && first.size(3) == step.head_dim,
              "decode_layers: caches must be [num_blocks, block_size, kv_heads, head_dim], got ", first.sizes());
  for (size_t i = 0; i < w.input_norms.size(); ++i) {
    check_norm(w.input_norms[i], "input norm", i);
    check_norm(w.post_norms[i], "post-attention norm", i);
    check_tiles(w.qkv_tiles[i], width, step.qkv_width(), "qkv", i);
    check_tiles(w.o_tiles[i], step.heads * step.head_dim, width, "o_proj", i);
    check_tiles(w.gate_up_tiles[i], width, 2 * step.inner, "gate/up", i);
    check_tiles(w.down_tiles[i], step.inner, width, "down", i);
    for (const torch::Tensor* cache : {&k_caches[i], &v_caches[i]}) {
      TORCH_CHECK(cache->scalar_type() == at::kBFloat16 && cache->is_contiguous() && cache->sizes() == first.sizes(),
                  "decode_layers: layer ", i, "'s caches must be contiguous bfloat16 ", first.sizes(), ", got ",
                  cache->sizes(), " ", cache->scalar_type());
    }
  }
  const torch::Tensor& tables = step.block_tables;
  const torch::Tensor& lens = step.context_lens;
  const torch::Tensor& slots = step.slot_mapping;
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
torch::Tensor decode_layers_team(torch::Tensor& hidden, const Weights& w, std::vector<torch::Tensor>& k_caches,
                                 std::vector<torch::Tensor>& v_caches, const torch::Tensor& cos,
                                 const torch::Tensor& sin, const Step& step) {
  using Bf16 = c10::BFloat16;
  const int64_t layers = static_cast<int64_t>(w.input_norms.size());
  const int64_t tokens = hidden.size(0), width = hidden.size(1), heads = step.heads, kv_heads = step.kv_heads;
  const int64_t head_dim = step.head_dim, qkv_width = step.qkv_width(), inner = step.inner;
  const auto options = hidden.options();
  torch::Tensor x = torch::empty({tokens, width}, options);                          // normed input; then y
  torch::Tensor qkv = torch::empty({tokens, qkv_width}, options);                    // [tokens, qkv_width]
  torch::Tensor qk = torch::empty({tokens, heads + kv_heads, head_dim}, options);    // rotated Q and K heads
  torch::Tensor attn = torch::empty({tokens, heads * head_dim}, options);            // [tokens, heads * head_dim]
  torch::Tensor attn_out = torch::empty({tokens, width}, options);                   // [tokens, hidden]
  torch::Tensor act = torch::empty({tokens, inner}, options);                        // [tokens, inner]
  torch::Tensor delta = torch::empty({tokens, width}, options);                      // the MLP's output
  Bf16* h = hidden.data_ptr<Bf16>();
  Bf16* x_ptr = x.data_ptr<Bf16>();
  Bf16* qkv_ptr = qkv.data_ptr<Bf16>();
  Bf16* qk_ptr = qk.data_ptr<Bf16>();
  Bf16* attn_ptr = attn.data_ptr<Bf16>();
  Bf16* attn_out_ptr = attn_out.data_ptr<Bf16>();
  Bf16* act_ptr = act.data_ptr<Bf16>();
  Bf16* delta_ptr = delta.data_ptr<Bf16>();
  const Bf16* cos_ptr = cos.data_ptr<Bf16>();
  const Bf16* sin_ptr = sin.data_ptr<Bf16>();
  const int64_t* slots = step.slot_mapping.data_ptr<int64_t>();
  const int64_t* tables = step.block_tables.data_ptr<int64_t>();
  const int64_t* lens = step.context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = step.block_tables.size(1), block_size = k_caches[0].size(1);
  std::vector<const Bf16*> input_norm(layers), post_norm(layers), qkv_w(layers), o_w(layers), gate_up_w(layers),
      down_w(layers);
  std::vector<Bf16*> k_cache(layers), v_cache(layers);
  for (int64_t i = 0; i < layers; ++i) {
    input_norm[i] = w.input_norms[i].data_ptr<Bf16>();
    post_norm[i] = w.post_norms[i].data_ptr<Bf16>();
    qkv_w[i] = w.qkv_tiles[i].data_ptr<Bf16>();
    o_w[i] = w.o_tiles[i].data_ptr<Bf16>();
    gate_up_w[i] = w.gate_up_tiles[i].data_ptr<Bf16>();
    down_w[i] = w.down_tiles[i].data_ptr<Bf16>();
    k_cache[i] = k_caches[i].data_ptr<Bf16>();
    v_cache[i] = v_caches[i].data_ptr<Bf16>();
  }
  constexpr int64_t kProducts = 4;  // per layer: qkv, o_proj, gate/up, down
  std::unique_ptr<std::atomic<int64_t>[]> next_units(new std::atomic<int64_t>[layers * kProducts]);
  for (int64_t i = 0; i < layers * kProducts; ++i) next_units[i].store(0, std::memory_order_relaxed);
  conveyor_team::SpinBarrier barrier;
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  const int64_t threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), thread = omp_get_thread_num();
    try {
      const conveyor_team::RowShare rows = conveyor_team::row_share(tokens, thread, team);
      const std::vector<int64_t> bounds = decode_attention_bounds(lens, tokens, kv_heads, team);
      std::vector<float> scores;
      for (int64_t i = 0; i < layers; ++i) {
        const auto products = [&](int64_t k) { return conveyor_amx::UnitTeam{team, &next_units[i * kProducts + k]}; };
        add_rms_norm_rows(h, i > 0 ? delta_ptr : nullptr, input_norm[i], x_ptr, rows.begin, rows.end, width, step.eps);
        if (!barrier.wait(team)) break;
        conveyor_amx::product_packed_bf16_team(x_ptr, tokens, width, qkv_width, qkv_w[i], qkv_ptr, products(0));
        if (!barrier.wait(team)) break;
        rotary_and_cache_rows(qkv_ptr, cos_ptr, sin_ptr, k_cache[i], v_cache[i], slots, qk_ptr, rows.begin, rows.end,
                              heads, kv_heads, head_dim);
        if (!barrier.wait(team)) break;
        decode_attention_items(qk_ptr, (heads + kv_heads) * head_dim, head_dim, k_cache[i], v_cache[i], tables,
                               max_blocks, lens, block_size, heads, kv_heads, head_dim, step.scale, attn_ptr,
                               bounds[thread], bounds[thread + 1], scores);
        if (!barrier.wait(team)) break;
        conveyor_amx::product_packed_bf16_team(attn_ptr, tokens, heads * head_dim, width, o_w[i], attn_out_ptr,
                                               products(1));
        if (!barrier.wait(team)) break;
        add_rms_norm_rows(h, attn_out_ptr, post_norm[i], x_ptr, rows.begin, rows.end, width, step.eps);
        if (!barrier.wait(team)) break;
        conveyor_amx::product_packed_silu_gate_bf16_team(x_ptr, tokens, width, inner, gate_up_w[i], act_ptr,
                                                         products(2));
        if (!barrier.wait(team)) break;
        conveyor_amx::product_packed_bf16_team(act_ptr, tokens, inner, width, down_w[i], delta_ptr, products(3));
        if (!barrier.wait(team)) break;
      }
    } catch (...) {
      if (!failed.exchange(true)) failure = std::current_exception();
      barrier.abort();
    }
  }
  if (failure) std::rethrow_exception(failure);
  return layers > 0 ? hidden + delta : hidden;
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
  const Weights weights{input_norms, qkv_tiles, o_tiles, post_norms, gate_up_tiles, down_tiles};
  const Step step{slot_mapping, block_tables, context_lens, heads, kv_heads, head_dim, inner, eps, scale};
  const torch::Tensor cos = rotary_rows(cos_table, positions, hidden.scalar_type());  // [tokens, head_dim]
  const torch::Tensor sin = rotary_rows(sin_table, positions, hidden.scalar_type());  // [tokens, head_dim]
  if (layers == 0 || hidden.size(0) == 0) return hidden;
  if (k_caches[0].scalar_type() == at::kChar) return decode_layers_ops(hidden, weights, k_caches, v_caches, cos, sin, step);
  check_team_step(hidden, weights, k_caches, v_caches, step);
  return decode_layers_team(hidden, weights, k_caches, v_caches, cos, sin, step);
}
