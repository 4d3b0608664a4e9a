"""What every loader checks of a model before its weights are used, whatever the format: the spec's values in range
and consistent with each other, every tensor's shape what the spec implies, every weight finite.

The format loaders check each metadata key or config.json field where they read it (naming it); these checks are
the second net, on the spec they built, and the only place tensor shapes and values are checked.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from conveyor.errors import ModelLoadError
from conveyor.model.limits import MAX_CONTEXT_LENGTH, MAX_SCALE
from conveyor.model.model_spec import ModelSpec, RopeSpec

SCALE_BYTES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
"""Where each kept-compact GGML block holds its float16 scales (d, and dmin / m), as ggml's block structs: the
quantized values are integers, so these are the only values of such a weight that can be NaN or infinite."""


def check_spec(spec: ModelSpec, source: str) -> None:
    """Sizes positive and consistent, floats finite and positive, token ids inside the vocabulary."""

    def bad(field: str, value: Any, expected: str) -> ModelLoadError:
        return ModelLoadError(f"{source}: the model's {field} is {value!r}; expected {expected}")

    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        if getattr(spec, field) < 1:
            raise bad(field, getattr(spec, field), "at least 1")
    if spec.num_kv_heads > spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise bad("num_kv_heads", spec.num_kv_heads, f"a divisor of the {spec.num_heads} query heads")
    if spec.head_dim < 2 or spec.head_dim % 2:
        raise bad("head_dim", spec.head_dim, "an even number (rotary embeddings rotate pairs)")
    if not 1 <= spec.max_position_embeddings <= MAX_CONTEXT_LENGTH:
        raise bad("context length", spec.max_position_embeddings, f"1 to {MAX_CONTEXT_LENGTH} tokens")
    _positive(spec.rms_norm_eps, "RMSNorm epsilon", source, 1.0)
    for name, rope in (("rope", spec.rope), ("local rope", spec.local_rope)):
        if rope is not None:
            _check_rope(rope, name, spec, source)
    for field in ("attention_scale", "attn_logit_softcap", "final_logit_softcap"):
        if getattr(spec, field) is not None:
            _positive(getattr(spec, field), field, source)
    _positive(spec.embedding_multiplier, "embedding multiplier", source)
    for field, token in [("bos_token_id", spec.bos_token_id)] + [("eos_token_ids", t) for t in spec.eos_token_ids]:
        if token is not None and not 0 <= token < spec.vocab_size:
            raise bad(field, token, f"a token id of the vocabulary (0 to {spec.vocab_size - 1})")
    if spec.layer_windows and len(spec.layer_windows) != spec.num_layers:
        raise bad("layer windows", len(spec.layer_windows), f"one per layer ({spec.num_layers})")
    if any(w is not None and not 1 <= w <= MAX_CONTEXT_LENGTH for w in spec.layer_windows):
        raise bad("sliding windows", spec.layer_windows, f"1 to {MAX_CONTEXT_LENGTH} tokens (or none)")


def _check_rope(rope: RopeSpec, name: str, spec: ModelSpec, source: str) -> None:
    _positive(rope.theta, f"{name} base (theta)", source)
    _positive(rope.factor, f"{name} scaling factor", source)
    _positive(rope.attention_factor, f"{name} attention factor", source)
    for field in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        _positive(getattr(rope, field), f"{name} {field}", source)
    if rope.scaling_type == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise ModelLoadError(
            f"{source}: the model's {name} high_freq_factor ({rope.high_freq_factor}) is not above its "
            f"low_freq_factor ({rope.low_freq_factor}); llama3 scaling divides by their difference"
        )
    if not 1 <= rope.original_max_position_embeddings <= MAX_CONTEXT_LENGTH:
        raise ModelLoadError(
            f"{source}: the model's {name} original context is {rope.original_max_position_embeddings} tokens; "
            f"expected 1 to {MAX_CONTEXT_LENGTH}"
        )
    if rope.rotary_dim is not None and (rope.rotary_dim % 2 or not 2 <= rope.rotary_dim <= spec.head_dim):
        raise ModelLoadError(
            f"{source}: the model's {name} rotates {rope.rotary_dim} dimensions of each head; expected an even "
            f"number from 2 to the head size {spec.head_dim}"
        )
    for field in ("freq_factors", "short_factors", "long_factors"):
        for i, factor in enumerate(getattr(rope, field) or ()):
            _positive(factor, f"{name} {field}[{i}]", source)


def _positive(value: float, what: str, source: str, high: float = MAX_SCALE) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= high):
        raise ModelLoadError(
            f"{source}: the model's {what} is {value!r}; expected a finite number above 0 (up to {high:g})"
        )


_LAYER_SHAPES = {  # per layer: name -> the shape as a function of (hidden, q_size, kv_size, intermediate, head_dim)
    "input_layernorm.weight": lambda h, q, kv, i, d: (h,),
    "post_attention_layernorm.weight": lambda h, q, kv, i, d: (h,),
    "pre_feedforward_layernorm.weight": lambda h, q, kv, i, d: (h,),
    "post_feedforward_layernorm.weight": lambda h, q, kv, i, d: (h,),
    "self_attn.q_proj.weight": lambda h, q, kv, i, d: (q, h),
    "self_attn.k_proj.weight": lambda h, q, kv, i, d: (kv, h),
    "self_attn.v_proj.weight": lambda h, q, kv, i, d: (kv, h),
    "self_attn.qkv_proj.weight": lambda h, q, kv, i, d: (q + 2 * kv, h),
    "self_attn.o_proj.weight": lambda h, q, kv, i, d: (h, q),
    "self_attn.q_proj.bias": lambda h, q, kv, i, d: (q,),
    "self_attn.k_proj.bias": lambda h, q, kv, i, d: (kv,),
    "self_attn.v_proj.bias": lambda h, q, kv, i, d: (kv,),
    "self_attn.o_proj.bias": lambda h, q, kv, i, d: (h,),
    "self_attn.q_norm.weight": lambda h, q, kv, i, d: (d,),
    "self_attn.k_norm.weight": lambda h, q, kv, i, d: (d,),
    "mlp.gate_proj.weight": lambda h, q, kv, i, d: (i, h),
    "mlp.up_proj.weight": lambda h, q, kv, i, d: (i, h),
    "mlp.down_proj.weight": lambda h, q, kv, i, d: (h, i),
    "mlp.gate_up_proj.weight": lambda h, q, kv, i, d: (2 * i, h),
}


def expected_shape(spec: ModelSpec, name: str) -> tuple[int, ...] | None:
    """The shape (torch order: [rows, cols]) a tensor of this Hugging Face name must have; None for a name that
    is no weight of this model (refused by name when the weights are fused)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (spec.vocab_size, spec.hidden_size)
    if name == "model.norm.weight":
        return (spec.hidden_size,)
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or parts[3] not in _LAYER_SHAPES:
        return None
    layer = parts[2]
    if not layer.isdigit() or str(int(layer)) != layer or int(layer) >= spec.num_layers:
        return None
    return _LAYER_SHAPES[parts[3]](spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size, spec.head_dim)


def check_shape(spec: ModelSpec, name: str, shape: tuple[int, ...], source: str, shown: str | None = None) -> None:
    """Refuse a tensor whose shape is not the one the spec implies. shown: the tensor's name in the file, when it
    is a GGUF name (the shapes are then given in GGUF order, the row length first)."""
    expected = expected_shape(spec, name)
    if expected is None or tuple(shape) == expected:
        return
    order = (lambda s: list(reversed(s))) if shown else list
    raise ModelLoadError(
        f"{source}: tensor {shown or name!r} has shape {order(shape)}{' (GGUF order)' if shown else ''}; the "
        f"model's metadata implies {order(expected)} (hidden {spec.hidden_size}, vocab {spec.vocab_size}, "
        f"{spec.num_heads} query and {spec.num_kv_heads} key/value heads of {spec.head_dim}, MLP "
        f"{spec.intermediate_size}); the file's metadata and tensors disagree"
    )


def check_finite(tensor: torch.Tensor, name: str, source: str, what: str = "value") -> None:
    """Refuse a float tensor holding a NaN or an infinity: one sum over it (a pass at memory speed; a NaN or an
    infinity anywhere makes it non-finite), then row sums (a float16 sum can overflow), and the exact search only
    when those are not finite either."""
    if not tensor.is_floating_point() or tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())):
        return
    if tensor.dim() > 1 and bool(torch.isfinite(tensor.sum(-1)).all()):
        return
    bad = (~torch.isfinite(tensor)).nonzero()
    if len(bad) == 0:  # finite values whose sums overflowed
        return
    index = tuple(int(i) for i in bad[0])
    raise ModelLoadError(
        f"{source}: tensor {name!r} holds {len(bad)} NaN or infinite {what}(s) (the first, {tensor[index].item()}, "
        f"at {list(index)}); weights must be finite: the file is corrupt"
    )


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def check_finite_blocks(kind: str, blocks: torch.Tensor, name: str, source: str) -> None:
    """Refuse GGML blocks [rows, row bytes] (a kept-compact type) whose float16 scales hold a NaN or an infinity.
    Every block and scale offset is even, so the scales are a strided float16 view of the bytes (no copy)."""
    halves = blocks.numpy().view(np.float16).reshape(-1, BLOCK_BYTES[kind] // 2)  # [blocks, block bytes / 2]
    for offset in SCALE_BYTES[kind]:
        scales = halves[:, offset // 2]  # [blocks]
        if not np.isfinite(scales).all():
            bad = np.flatnonzero(~np.isfinite(scales))
            raise ModelLoadError(
                f"{source}: tensor {name!r} holds {len(bad)} NaN or infinite block scale(s) (the first, "
                f"{scales[bad[0]]}, in block {int(bad[0])}); weights must be finite: the file is corrupt"
            )


PROBE_TEXT = "Hello, world! 123 \u00e9\u6771 <|im_end|>"


def check_tokenizer_works(tokenizer: Any, source: str) -> Any:
    """The tokenizer encodes and decodes a short text (some that build still fail on their first use, say a
    sentencepiece vocabulary without its unknown token); returns it."""
    try:
        tokenizer.decode(tokenizer(PROBE_TEXT)["input_ids"])
    except Exception as exc:
        raise ModelLoadError(
            f"{source}: the tokenizer built from the file cannot encode text ({type(exc).__name__}: {str(exc)[:300]})"
        ) from None
    return tokenizer
