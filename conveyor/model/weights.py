"""Weights containers and fusing: what every loader produces (LoadedModel) and the one step that brings
Hugging Face tensor names into the model's layout (one QKV matrix, one gate/up matrix per layer).

Below the format loaders (hf_loader, gguf_loader) and the dispatching loader.py, so none of them
imports another's module for these (no import cycle)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.errors import ModelLoadError
from conveyor.model.gguf_quant import AnyWeight, QuantizedWeight, cast_weight, cat_rows, dense, plain_tensor
from conveyor.model.model_spec import ModelSpec
from conveyor.model.rope import partial_rotary_order


@dataclass
class LoadedModel:
    spec: ModelSpec
    weights: dict[str, AnyWeight]
    """Fused weights by our names (see `fuse_weights`), on CPU, in the compute dtype; a GGUF file's quantized
    matrices as their blocks (QuantizedWeight / RowStack, model/gguf_quant.py)."""
    tokenizer: Any | None
    source: str
    """The file or folder the weights came from."""
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    """temperature / top_p / top_k the model's authors recommend (generation_config.json), used by
    the server when a request leaves them out (as vLLM does)."""


_IGNORED_TENSORS = (".rotary_emb.inv_freq",)
"""Tensors some old checkpoints carry that are recomputed from the config (never read)."""


FileWeight = torch.Tensor | QuantizedWeight
"""One tensor as a loader reads it from the file: its values, or (GGUF) its blocks kept compact."""


def fuse_weights(
    spec: ModelSpec, tensors: Mapping[str, FileWeight], dtype: torch.dtype, source: str, norm_offset: float = 0.0
) -> dict[str, AnyWeight]:
    """Hugging Face names -> our fused layout in `dtype`. A tensor left unread is refused by name: skipping it
    would silently compute a different model. norm_offset: added to every RMSNorm weight, in float32 before the
    cast (Gemma's checkpoints store weight - 1; llama.cpp's converter already adds the 1)."""
    read: set[str] = set()

    def get(name: str) -> FileWeight | None:
        read.add(name)
        return tensors.get(name)

    def need(name: str) -> FileWeight:
        tensor = get(name)
        if tensor is None:
            raise ModelLoadError(
                f"{source}: tensor {name!r} is missing; the checkpoint is incomplete or not a {spec.architecture} model"
            )
        return tensor

    def need_tensor(name: str) -> torch.Tensor:  # a norm or a bias: never GGUF blocks (only matrices are kept so)
        return plain_tensor(need(name), name)

    def cast(t: AnyWeight) -> AnyWeight:  # a float tensor, or GGUF blocks kept compact (model/gguf_quant.py)
        return cast_weight(t, dtype)  # a weight matrix already in dtype stays a view of the file's memory map

    def owned(t: AnyWeight) -> AnyWeight:
        """cast(t), never sharing t's memory. The model keeps the embedding and biases as they are, and a view of a
        checkpoint's memory map would keep the whole mapped file resident; weight matrices (cast) stay views, as the
        projections repack them (or use them in place) and the map is released once they have."""
        kept = cast(t)
        if isinstance(kept, torch.Tensor) and isinstance(t, torch.Tensor) and kept.data_ptr() == t.data_ptr():
            return kept.clone()
        return kept

    def norm(name: str) -> torch.Tensor:
        return (need_tensor(name).float() + norm_offset).to(dtype).contiguous()  # a new tensor (cast_weight's cast)

    out: dict[str, AnyWeight] = {
        "embed": owned(need("model.embed_tokens.weight")),
        "final_norm": norm("model.norm.weight"),
    }
    lm_head = get("lm_head.weight")
    if lm_head is not None and not spec.tie_word_embeddings:
        out["lm_head"] = cast(lm_head)
    elif not spec.tie_word_embeddings:
        raise ModelLoadError(f"{source}: lm_head.weight is missing and tie_word_embeddings is false")
    for i in range(spec.num_layers):
        hf = f"model.layers.{i}."
        p = f"layers.{i}."
        a = hf + "self_attn."
        fused = get(a + "qkv_proj.weight")  # Phi-3 stores Q, K and V stacked, as we do
        if fused is not None:
            if fused.shape[0] != spec.q_size + 2 * spec.kv_size:
                raise ModelLoadError(
                    f"{source}: layer {i} qkv_proj has {fused.shape[0]} rows, config implies "
                    f"{spec.q_size + 2 * spec.kv_size}; config.json and weights disagree"
                )
            out[p + "qkv"] = cast(fused)  # [q_size + 2 * kv_size, hidden]
        else:
            q, k, v = need(a + "q_proj.weight"), need(a + "k_proj.weight"), need(a + "v_proj.weight")
            expected = (spec.q_size, spec.kv_size, spec.kv_size)
            if (q.shape[0], k.shape[0], v.shape[0]) != expected:
                raise ModelLoadError(
                    f"{source}: layer {i} q/k/v rows are {q.shape[0]}/{k.shape[0]}/{v.shape[0]}, "
                    f"config implies {expected}; config.json and weights disagree"
                )
            out[p + "qkv"] = cast(cat_rows([q, k, v]))  # [q_size + 2 * kv_size, hidden]
        if spec.qkv_bias:
            out[p + "qkv_bias"] = cast(
                torch.cat(
                    [need_tensor(a + "q_proj.bias"), need_tensor(a + "k_proj.bias"), need_tensor(a + "v_proj.bias")]
                )
            )
        if spec.qk_norm:
            out[p + "q_norm"] = norm(a + "q_norm.weight")
            out[p + "k_norm"] = norm(a + "k_norm.weight")
        if spec.rope.rotary_dim is not None and spec.rope.rotary_dim != spec.head_dim:
            _reorder_for_partial_rotary(out, p, spec)
        out[p + "o_proj"] = cast(need(a + "o_proj.weight"))
        o_bias = get(a + "o_proj.bias")
        if o_bias is not None:
            out[p + "o_proj_bias"] = owned(o_bias)
        out[p + "input_norm"] = norm(hf + "input_layernorm.weight")
        if spec.sandwich_norms:  # Gemma 2: post_attention_layernorm normalises the attention output
            out[p + "attn_out_norm"] = norm(hf + "post_attention_layernorm.weight")
            out[p + "post_norm"] = norm(hf + "pre_feedforward_layernorm.weight")
            out[p + "mlp_out_norm"] = norm(hf + "post_feedforward_layernorm.weight")
        else:
            out[p + "post_norm"] = norm(hf + "post_attention_layernorm.weight")
        m = hf + "mlp."
        gate_up: AnyWeight | None = get(m + "gate_up_proj.weight")  # Phi-3: gate and up stacked, as we do
        if gate_up is None:
            gate_up = cat_rows([need(m + "gate_proj.weight"), need(m + "up_proj.weight")])
        if gate_up.shape[0] != 2 * spec.intermediate_size:
            raise ModelLoadError(
                f"{source}: layer {i} gate/up rows are {gate_up.shape[0]}, config implies "
                f"{2 * spec.intermediate_size}; config.json and weights disagree"
            )
        out[p + "gate_up"] = cast(gate_up)  # [2 * intermediate, hidden]
        out[p + "down"] = cast(need(m + "down_proj.weight"))
    unread = sorted(name for name in tensors if name not in read and not name.endswith(_IGNORED_TENSORS))
    if unread:
        raise ModelLoadError(
            f"{source}: {len(unread)} tensor(s) Conveyor does not know for {spec.architecture}: "
            f"{unread[:5]}{' ...' if len(unread) > 5 else ''}; skipping them would silently change "
            f"the model, so it is refused (see the model table in docs/models.md)"
        )
    return out


def _reorder_for_partial_rotary(out: dict[str, AnyWeight], prefix: str, spec: ModelSpec) -> None:
    """Reorder each Q and K head's dimensions (rows of qkv and its bias, q/k norm weights) so that a full-head
    rotate-half computes partial rotary (conveyor/model/rope.py); V's rows stay."""
    assert spec.rope.rotary_dim is not None
    order = partial_rotary_order(spec.head_dim, spec.rope.rotary_dim)  # [head_dim]
    qkv = dense(out[prefix + "qkv"])  # GGUF blocks: rows are reordered on the dense matrix
    heads = spec.num_heads + spec.num_kv_heads
    rows = torch.cat(
        [
            (torch.arange(heads)[:, None] * spec.head_dim + order[None, :]).reshape(-1),
            torch.arange(spec.q_size + spec.kv_size, spec.q_size + 2 * spec.kv_size),
        ]
    )  # [qkv rows]
    out[prefix + "qkv"] = qkv[rows].contiguous()  # [q_size + 2 * kv_size, hidden]
    for name, index in (("qkv_bias", rows), ("q_norm", order), ("k_norm", order)):
        if prefix + name in out:
            out[prefix + name] = plain_tensor(out[prefix + name], prefix + name)[index].contiguous()
