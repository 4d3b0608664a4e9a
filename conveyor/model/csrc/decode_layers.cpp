// The decoder layers of a pure-decode step in one call (conveyor.model.decode_stack): the same kernels, in the
// same order, on the same tensors as LlamaModel.forward's Python loop, so the same bits; only the Python and torch
// view ops between them are gone. For the plain Llama layer only: RMSNorm, fused QKV without bias, rotary, paged decode attention (no
// window, no soft cap), o_proj, RMSNorm, SiLU gate/up fused in one AMX product, down; all weights bfloat16 packed
// in AMX tiles. The caller checks that the model and the step are of that kind.
//
// With plain bfloat16 caches the whole stack runs in one parallel region: the threads go through the layers
// together and meet at a barrier after each op (team.h), each taking its share of the op (stack_parts.h; the
// products' units in turn, as they do in their own region: UnitTeam). Every output is still computed by one thread
// in one order, so the bits do not change (the exactness invariant: one thread, one summation order per output).
// One region per op would cost a fork, a join and the calling thread's work between ops while the others wait.
// An int8 cache runs the ops one by one, each in its region (bindings.cpp). This file holds the region only; the
// checks, scratch tensors and the int8 path are bindings.cpp's decode_layers.
//
//   per layer:  h += delta ; x = norm(h)      rows split by row_share        | barrier
//               qkv = x Wqkv^T                 AMX units from a counter       | barrier
//               qk, caches <- rotary(qkv)      rows split                     | barrier
//               attn = attention(q, caches)    items split by context length  | barrier
//               attn_out = attn Wo^T ; h += attn_out ; x = norm(h) ; act = silu-gate(x) ; delta = act Wdown^T
//               (each op followed by a barrier)
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <vector>

#include "amx_product.h"
#include "kernels.h"
#include "parallel.h"
#include "stack_parts.h"
#include "team.h"

namespace conveyor_ops {

// The layers in one parallel region (plain bfloat16 caches; every operand checked by the caller, bindings.cpp's
// check_team_step: nothing here raises but an allocation). hidden [tokens, width] is updated in place; on return
// delta holds the last layer's MLP output, not yet added to hidden.
void decode_layers_team(const DecodeStack& s) {
  using Bf16 = conveyor::BFloat16;
  const int64_t layers = s.layers, tokens = s.tokens, width = s.width, heads = s.heads, kv_heads = s.kv_heads;
  const int64_t head_dim = s.head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim, inner = s.inner;
  const double eps = s.eps, scale = s.scale;
  Bf16* h = s.hidden;
  Bf16* x_ptr = s.x;
  Bf16* qkv_ptr = s.qkv;
  Bf16* qk_ptr = s.qk;
  Bf16* attn_ptr = s.attn;
  Bf16* attn_out_ptr = s.attn_out;
  Bf16* act_ptr = s.act;
  Bf16* delta_ptr = s.delta;
  const Bf16* cos_ptr = s.cos;
  const Bf16* sin_ptr = s.sin;
  const int64_t* slots = s.slots;
  const int64_t* tables = s.block_tables;
  const int64_t* lens = s.context_lens;
  const int64_t max_blocks = s.max_blocks, block_size = s.block_size;
  const Bf16* const* input_norm = s.input_norms;
  const Bf16* const* post_norm = s.post_norms;
  const Bf16* const* qkv_w = s.qkv_tiles;
  const Bf16* const* o_w = s.o_tiles;
  const Bf16* const* gate_up_w = s.gate_up_tiles;
  const Bf16* const* down_w = s.down_tiles;
  Bf16* const* k_cache = s.k_caches;
  Bf16* const* v_cache = s.v_caches;
  constexpr int64_t kProducts = 4;  // per layer: qkv, o_proj, gate/up, down
  std::unique_ptr<std::atomic<int64_t>[]> next_units(new std::atomic<int64_t>[layers * kProducts]);
  for (int64_t i = 0; i < layers * kProducts; ++i) next_units[i].store(0, std::memory_order_relaxed);
  conveyor_team::SpinBarrier barrier;
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  const int64_t threads = std::max<int64_t>(1, conveyor_parallel::num_threads());
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), thread = omp_get_thread_num();
    try {
      const conveyor_team::RowShare rows = conveyor_team::row_share(tokens, thread, team);
      const std::vector<int64_t> bounds = decode_attention_bounds(lens, tokens, kv_heads, team);
      std::vector<float> scores;
      for (int64_t i = 0; i < layers; ++i) {
        const auto products = [&](int64_t k) { return conveyor_amx::UnitTeam{team, &next_units[i * kProducts + k]}; };
        add_rms_norm_rows(h, i > 0 ? delta_ptr : nullptr, input_norm[i], x_ptr, rows.begin, rows.end, width, eps);
        if (!barrier.wait(team)) break;
        conveyor_amx::product_packed_bf16_team(x_ptr, tokens, width, qkv_width, qkv_w[i], qkv_ptr, products(0));
        if (!barrier.wait(team)) break;
        rotary_and_cache_rows(qkv_ptr, cos_ptr, sin_ptr, k_cache[i], v_cache[i], slots, qk_ptr, rows.begin, rows.end,
                              heads, kv_heads, head_dim);
        if (!barrier.wait(team)) break;
        decode_attention_items(qk_ptr, (heads + kv_heads) * head_dim, head_dim, k_cache[i], v_cache[i], tables,
                               max_blocks, lens, block_size, heads, kv_heads, head_dim, scale, attn_ptr,
                               bounds[thread], bounds[thread + 1], scores);
        if (!barrier.wait(team)) break;
        conveyor_amx::product_packed_bf16_team(attn_ptr, tokens, heads * head_dim, width, o_w[i], attn_out_ptr,
                                               products(1));
        if (!barrier.wait(team)) break;
        add_rms_norm_rows(h, attn_out_ptr, post_norm[i], x_ptr, rows.begin, rows.end, width, eps);
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
}

}  // namespace conveyor_ops
