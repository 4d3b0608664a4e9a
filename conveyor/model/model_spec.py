"""ModelSpec: the shape of a loaded model (discovered at start-up, never user-set)."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    scaling_type: str = "default"  # "default" | "linear" | "llama3" | "yarn" | "longrope" (conveyor/model/rope.py)
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    attention_factor: float = 1.0
    """cos and sin are multiplied by it (yarn's mscale; 1 otherwise)."""
    freq_factors: tuple[float, ...] | None = None
    """Per-frequency divisors from a GGUF file's rope_freqs tensor (llama.cpp's form of llama3 scaling)."""
    short_factors: tuple[float, ...] | None = None
    """longrope (Phi-3 128k, Phi-3.5, Phi-4-mini): per-frequency divisors for contexts up to the original one."""
    long_factors: tuple[float, ...] | None = None
    """longrope: the divisors for longer contexts (used when the engine's max_model_len exceeds the original)."""
    rotary_dim: int | None = None
    """How many leading dimensions of each head rotate (partial rotary, Phi-4-mini); None: all of them."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    activation: str = "silu"
    """The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""
    embedding_multiplier: float = 1.0
    """Token embeddings are multiplied by it (Gemma: sqrt(hidden_size), rounded to the compute dtype)."""
    attention_scale: float | None = None
    """Query-key scale; None: head_dim ** -0.5 (Gemma 2: query_pre_attn_scalar ** -0.5)."""
    attn_logit_softcap: float | None = None
    """Attention scores become softcap * tanh(scores / softcap) before the mask and softmax (Gemma 2)."""
    final_logit_softcap: float | None = None
    """Logits become softcap * tanh(logits / softcap) (Gemma 2)."""
    sandwich_norms: bool = False
    """Gemma 2: the attention and MLP outputs are normalised again before they join the residual stream."""
    local_rope: RopeSpec | None = None
    """The rotary embedding of the sliding-window layers when it differs from `rope` (Gemma 3's local base)."""
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: the sliding window W (a token attends to itself and the W - 1 tokens before it), or None for
    full attention. Empty: every layer attends fully."""

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """The window every layer shares (blocks older than it can be freed while a request runs), else None."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(w for w in self.layer_windows if w is not None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V, all layers, for one token."""
        return 2 * self.num_layers * self.kv_size * element_size
