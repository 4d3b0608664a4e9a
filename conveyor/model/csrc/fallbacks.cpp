// What the kernels that were not compiled for this CPU (conveyor/model/native.py's _SOURCE_NEEDS) would have defined:
// functions other units link against, each saying "not here" (an *_available() / *_vectorized() / *_kind() that
// answers false) or doing nothing where bindings.cpp never calls it without such an answer being true.
// CONVEYOR_WITH_<SOURCE> is defined for every source that was compiled.
#include <cstdint>

#include "amx_product.h"
#include "gguf_amx.h"
#include "gguf_bf16.h"
#include "gguf_vnni.h"
#include "kernels.h"

#if !defined(CONVEYOR_WITH_F32_LINEAR)
namespace conveyor_ops {
bool f32_linear_vectorized() { return false; }
void f32_linear(const float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*, float*) {}
}  // namespace conveyor_ops
#endif

#if !defined(CONVEYOR_WITH_QUANT_LINEAR)
namespace conveyor_ops {
bool quant_linear_vectorized() { return false; }
void int4_linear(const conveyor::BFloat16*, int64_t, const uint8_t*, int64_t, int64_t, const conveyor::BFloat16*,
                 conveyor::BFloat16*) {}
void int8_linear(const float*, int64_t, int64_t, const int8_t*, int64_t, const float*, conveyor::BFloat16*) {}
}  // namespace conveyor_ops
#endif

#if !defined(CONVEYOR_WITH_GGUF_VNNI) && !defined(CONVEYOR_WITH_GGUF_INT8_AVX2)
namespace conveyor_gguf {
bool vnni_kind(int64_t) { return false; }
QuantizedActivations quantize_activations(const float*, int64_t, const ActivationBuffer&) { return {}; }
void vnni_dot_rows(int64_t, const uint8_t*, int64_t, const QuantizedActivations*, int64_t, float*) {}
}  // namespace conveyor_gguf
#endif

#if !defined(CONVEYOR_WITH_GGUF_BF16)
namespace conveyor_gguf {
bool bf16_kind(int64_t) { return false; }
void dequantize_pieces(int64_t, const uint8_t*, int64_t, conveyor::BFloat16*, int64_t) {}
}  // namespace conveyor_gguf
#endif

#if !defined(CONVEYOR_WITH_GGUF_AMX)
namespace conveyor_amx {
void dequantize_tile_row(int64_t, const uint8_t*, int64_t, conveyor::BFloat16*) {}
void pieces_to_pairs(const conveyor::BFloat16*, conveyor::BFloat16*) {}
}  // namespace conveyor_amx
#endif

#if !defined(CONVEYOR_WITH_AMX_PRODUCT)
namespace conveyor_amx {
bool available() { return false; }
void configure_tiles() {}
void product_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const WeightRow&, const WeightRowPrefetch&,
                  conveyor::BFloat16*) {}
void product_silu_gate_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const WeightRow&,
                            const WeightRowPrefetch&, conveyor::BFloat16*) {}
void product_packed_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const conveyor::BFloat16*,
                         conveyor::BFloat16*) {}
void product_packed_silu_gate_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const conveyor::BFloat16*,
                                   conveyor::BFloat16*) {}
void product_packed_argmax_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const conveyor::BFloat16*,
                                int64_t*) {}
void product_packed_bf16_team(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const conveyor::BFloat16*,
                              conveyor::BFloat16*, const UnitTeam&) {}
void product_packed_silu_gate_bf16_team(const conveyor::BFloat16*, int64_t, int64_t, int64_t,
                                        const conveyor::BFloat16*, conveyor::BFloat16*, const UnitTeam&) {}
}  // namespace conveyor_amx
#endif

#if !defined(CONVEYOR_WITH_PREFILL_ATTENTION)
namespace conveyor_ops {
bool prefill_attention_available() { return false; }
void prefill_attention(const conveyor::BFloat16*, int64_t, int64_t, int64_t, int64_t, const conveyor::BFloat16*,
                       const conveyor::BFloat16*, const int8_t*, const int8_t*, int64_t, int64_t, const int64_t*,
                       int64_t, const int64_t*, int64_t, double, int64_t, conveyor::BFloat16*) {}
}  // namespace conveyor_ops
#endif

#if !defined(CONVEYOR_WITH_DECODE_LAYERS)
namespace conveyor_ops {
void decode_layers_team(const DecodeStack&) {}
}  // namespace conveyor_ops
#endif
