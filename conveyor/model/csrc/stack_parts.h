// A thread's share of the small ops of a decode step, for decode_layers.cpp, whose team of threads runs every op of
// the step in one parallel region (team.h): the same arithmetic as add_rms_norm, rotary_and_cache and
// decode_attention (kernels.h) on bfloat16 tensors with plain caches, given as pointers that the caller has checked
// before the region (the ops' own checks of block tables and slots: check_contexts, check_slots). Nothing else here
// raises, and nothing allocates a tensor.
#pragma once

#include "scalar_types.h"

#include <cstdint>
#include <vector>

// decode_attention's check of a step's contexts: each context_lens[s] in 1..max_blocks x block_size and every block
// id it uses (block_tables [num_seqs, max_blocks]) in 0..num_blocks - 1; raises, naming the first that is not.
void check_contexts(const int64_t* context_lens, const int64_t* block_tables, int64_t num_seqs, int64_t max_blocks,
                    int64_t block_size, int64_t num_blocks);

// rotary_and_cache's check of a step's slots: each in 0..slots_total - 1; raises, naming the first that is not.
void check_slots(const int64_t* slots, int64_t tokens, int64_t slots_total);

// Rows [begin, end) of add_rms_norm: hidden [*, dim] += delta (when not null), out = RMSNorm(hidden) * weight.
void add_rms_norm_rows(conveyor::BFloat16* hidden, const conveyor::BFloat16* delta, const conveyor::BFloat16* weight,
                       conveyor::BFloat16* out, int64_t begin, int64_t end, int64_t dim, double eps);

// Tokens [begin, end) of rotary_and_cache: qkv [*, (heads + 2 kv_heads) head_dim], cos, sin [*, head_dim] ->
// qk [*, heads + kv_heads, head_dim]; each token's rotated K and its V to its slot of the plain caches
// [num_blocks, block_size, kv_heads, head_dim].
void rotary_and_cache_rows(const conveyor::BFloat16* qkv, const conveyor::BFloat16* cos, const conveyor::BFloat16* sin,
                           conveyor::BFloat16* k_cache, conveyor::BFloat16* v_cache, const int64_t* slots, conveyor::BFloat16* qk,
                           int64_t begin, int64_t end, int64_t heads, int64_t kv_heads, int64_t head_dim);

// decode_attention's split of a step's (sequence, KV head) items over `threads`: thread t takes items
// bounds[t]..bounds[t + 1] - 1 (threads + 1 values). The same for every layer of a step.
std::vector<int64_t> decode_attention_bounds(const int64_t* context_lens, int64_t num_seqs, int64_t kv_heads,
                                             int64_t threads);

// Items [begin, end) of decode_attention (item = seq * kv_heads + kv_head) over plain bfloat16 caches; scores: the
// calling thread's scratch, grown as needed.
void decode_attention_items(const conveyor::BFloat16* q, int64_t q_seq_stride, int64_t q_head_stride,
                            const conveyor::BFloat16* k_cache, const conveyor::BFloat16* v_cache, const int64_t* block_tables,
                            int64_t max_blocks, const int64_t* context_lens, int64_t block_size, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, double scale, conveyor::BFloat16* out, int64_t begin,
                            int64_t end, std::vector<float>& scores);
