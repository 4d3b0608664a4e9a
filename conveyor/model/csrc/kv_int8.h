// The int8 KV cache's layout (kv_cache_dtype='int8'), as conveyor/model/kv_int8.py defines it, for the kernels that
// write it (rotary_cache.cpp) and read it (decode_attention_int8.cpp, prefill_attention.cpp). A cache is int8
// [num_blocks, kv_heads, block_size * (head_dim + 4)]: per (block, KV head) one page of block_size x head_dim codes
// followed by the block's block_size float32 scales. K pages hold their codes dimension by dimension
// ([head_dim][block_size]: 16 tokens' values of one dimension side by side), V pages row by row
// ([block_size][head_dim]). A row reads back as codes * scale.
#pragma once

#include <cstdint>

namespace conveyor_kv_int8 {

constexpr int64_t kScaleBytes = 4;  // one float32 scale per token and KV head

struct PageLayout {
  int64_t kv_heads, block_size, head_dim;

  int64_t page_bytes() const { return block_size * (head_dim + kScaleBytes); }
  // The page of (block, kv_head) in a cache's codes.
  const int8_t* page(const int8_t* cache, int64_t block, int64_t kv_head) const {
    return cache + (block * kv_heads + kv_head) * page_bytes();
  }
  int8_t* page(int8_t* cache, int64_t block, int64_t kv_head) const {
    return cache + (block * kv_heads + kv_head) * page_bytes();
  }
  // A page's block_size scales, after its codes.
  const float* scales(const int8_t* page) const {
    return reinterpret_cast<const float*>(page + block_size * head_dim);
  }
  float* scales(int8_t* page) const { return reinterpret_cast<float*>(page + block_size * head_dim); }
  // Where the code of dimension d of the token at `offset` in its block sits in a K page, and in a V page.
  int64_t key_code(int64_t offset, int64_t d) const { return d * block_size + offset; }
  int64_t value_code(int64_t offset, int64_t d) const { return offset * head_dim + d; }
};

}  // namespace conveyor_kv_int8
