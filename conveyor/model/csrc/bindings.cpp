// The Python module of Conveyor's native CPU kernels (one op per source file beside this one).
#include <torch/extension.h>

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale);
torch::Tensor add_rms_norm(torch::Tensor& hidden, const c10::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Paged decode attention over block tables (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta (in place), then RMSNorm(hidden) * weight (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up = [gate | up] (CPU)");
}
