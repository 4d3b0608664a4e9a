"""Which part of every weight a rank holds under tensor parallelism (Megatron-style, as vLLM does).

    QKV, gate/up    column-parallel: rank r keeps its heads' / its MLP columns' rows of W [out, in]
    O, down         row-parallel: rank r keeps the matching input columns; outputs are summed (all-reduce)
    embed, LM head  vocab-parallel: rank r keeps vocabulary rows [r V/N, (r+1) V/N); lookups are summed,
                    logits gathered
    norms           replicated

When the model has fewer KV heads than ranks (N a multiple of num_kv_heads), each KV head is replicated on
N / num_kv_heads ranks: rank r keeps KV head r // (N / num_kv_heads), the one its query heads read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from conveyor.errors import ConfigError
from conveyor.model.gguf_quant import AnyWeight, dense
from conveyor.model.model_spec import ModelSpec


def working_sizes(spec: ModelSpec, limit: int = 64) -> list[int]:
    """Tensor-parallel sizes this model can be split into (1 always works)."""
    return [n for n in range(1, limit + 1) if _problem(spec, n) is None]


def _problem(spec: ModelSpec, n: int) -> str | None:
    if spec.num_heads % n:
        return f"{spec.num_heads} attention heads"
    if spec.num_kv_heads % n and n % spec.num_kv_heads:
        return f"{spec.num_kv_heads} KV heads (N must divide them or be a multiple of them)"
    if spec.intermediate_size % n:
        return f"an MLP width of {spec.intermediate_size}"
    if spec.vocab_size % n:
        return f"a vocabulary of {spec.vocab_size}"
    return None


def check_tensor_parallel(spec: ModelSpec, n: int, source: str) -> None:
    """Refuse a size that does not split this model evenly, listing the sizes that do."""
    problem = _problem(spec, n)
    if problem is not None:
        raise ConfigError(
            f"tensor_parallel_size={n} cannot split {source}: it has {problem}, which {n} does not "
            f"divide evenly; sizes that work for this model: "
            f"{', '.join(str(s) for s in working_sizes(spec))}"
        )


def kv_heads_replicated(spec: ModelSpec, n: int) -> bool:
    return spec.num_kv_heads < n


def shard_spec(spec: ModelSpec, n: int) -> ModelSpec:
    """The shape one rank computes: 1/N of the heads and MLP width (the vocabulary stays whole: logits are
    gathered before sampling)."""
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // n,
        num_kv_heads=max(1, spec.num_kv_heads // n),
        intermediate_size=spec.intermediate_size // n,
    )


def vocab_range(spec: ModelSpec, rank: int, n: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows rank `rank` holds."""
    per = spec.vocab_size // n
    return rank * per, (rank + 1) * per


def shard_weights(spec: ModelSpec, weights: Mapping[str, AnyWeight], rank: int, n: int) -> dict[str, AnyWeight]:
    """Fused full weights (weights.fuse_weights names) -> the slices rank `rank` of `n` holds (contiguous copies).
    GGUF-quantized matrices are dequantized to their compute dtype first: a shard of a block-quantized matrix is
    not yet kept compact under tensor parallelism."""
    d = spec.head_dim
    heads, kv_heads, inter = spec.num_heads // n, max(1, spec.num_kv_heads // n), spec.intermediate_size // n
    q_rows = slice(rank * heads * d, (rank + 1) * heads * d)
    kv_head = rank // (n // spec.num_kv_heads) if kv_heads_replicated(spec, n) else rank * kv_heads
    k_rows = slice(spec.q_size + kv_head * d, spec.q_size + (kv_head + kv_heads) * d)
    v_rows = slice(k_rows.start + spec.kv_size, k_rows.stop + spec.kv_size)
    mlp = slice(rank * inter, (rank + 1) * inter)
    up = slice(spec.intermediate_size + rank * inter, spec.intermediate_size + (rank + 1) * inter)
    vocab = slice(*vocab_range(spec, rank, n))
    out: dict[str, AnyWeight] = {}  # every shard a plain tensor (typed as LoadedModel.weights holds them)
    for name, t in weights.items():
        key = name.rsplit(".", 1)[-1]
        t = dense(t)  # GGUF blocks kept compact (model/gguf_quant.py): shards are dense
        if key in ("qkv", "qkv_bias"):  # [q + 2 kv, hidden] / [q + 2 kv]
            part = torch.cat([t[q_rows], t[k_rows], t[v_rows]])
        elif key == "o_proj":  # [hidden, q]
            part = t[:, q_rows]
        elif key == "o_proj_bias":  # added once, by rank 0, before the sum
            part = t if rank == 0 else torch.zeros_like(t)
        elif key == "gate_up":  # [2 inter, hidden]
            part = torch.cat([t[mlp], t[up]])
        elif key == "down":  # [hidden, inter]
            part = t[:, mlp]
        elif key in ("embed", "lm_head"):  # [vocab, hidden]
            part = t[vocab]
        else:  # norms: replicated
            part = t
        out[name] = part.contiguous()
    return out
