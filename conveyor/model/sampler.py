"""Vectorized per-request sampling: one pass over the batch, whatever each row asks for.

Randomness is counter-based: the noise for (request seed, output index, vocab id) is a
hash of those three numbers, computed with integer tensor ops. A row's draw therefore
depends on its seed and position only — never on the other rows of the batch, on the
step it lands in, on async vs sync execution, or on the device — and needs no
per-request generator object or Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from conveyor.structured.bitmask import GrammarKernels, apply_bitmask, native_applies

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, without int64 overflow (split c in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection with full avalanche (values in int64)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, output_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, output_index: [rows] int64 -> [rows, vocab] float32 uniform in (0, 1)."""
    hi = _fmix32(((seeds >> 32) & _MASK32) ^ 0x9E3779B9)
    key = _fmix32((seeds & _MASK32) ^ hi)
    key = _fmix32(key ^ _fmix32((output_index & _MASK32) ^ 0x7F4A7C15))  # [rows]
    vocab = _fmix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) ^ 0x165667B1)  # [vocab]
    bits = _fmix32(_fmix32(key[:, None] ^ vocab[None, :]) ^ key[:, None])  # [rows, vocab]
    # 23 bits, so that (k + 0.5) / 2**23 is exact in float32 and never rounds to 0 or 1
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class PenaltyTensors:
    """Token histories of the rows with penalties, flattened: entry i is token `tokens[i]` of row `rows[i]`."""

    rows: torch.Tensor  # [entries] int64
    tokens: torch.Tensor  # [entries] int64 (placeholders already filled)
    is_output: torch.Tensor  # [entries] bool: generated (True) or prompt (False)
    presence: torch.Tensor  # [rows] float32 (0 where off)
    frequency: torch.Tensor  # [rows] float32 (0 where off)
    repetition: torch.Tensor  # [rows] float32 (1 where off)


@dataclass
class SamplingTensors:
    # The five below are read only for random rows: None when every row is greedy (all_greedy), so that a greedy
    # step builds none of them (five small host tensors a step, on the host's critical path of a CPU decode step).
    temperature: torch.Tensor | None  # [rows] float32; 0 = greedy
    top_k: torch.Tensor | None  # [rows] int64; <= 0 = off
    top_p: torch.Tensor | None  # [rows] float32; 1.0 = off
    seeds: torch.Tensor | None  # [rows] int64
    output_index: torch.Tensor | None  # [rows] int64
    all_greedy: bool
    any_top_k_or_p: bool
    min_p: torch.Tensor | None = None  # [rows] float32; 0.0 = off
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, tokens, values [entries]
    suppress: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, tokens [entries]
    penalties: PenaltyTensors | None = None
    num_logprobs: int | None = None
    """Largest top-N any row asked for; None when no row wants logprobs."""


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [rows] int64
    logprob: torch.Tensor | None = None  # [rows] float32: the sampled token's raw logprob
    rank: torch.Tensor | None = None  # [rows] int64
    top_ids: torch.Tensor | None = None  # [rows, N] int64
    top_logprobs: torch.Tensor | None = None  # [rows, N] float32
    finite: torch.Tensor | None = None
    """[rows] bool: False where the row's logits were not finite (see finite_rows); None where not checked."""


def finite_rows(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], tokens [rows] each row's first argmax of them -> [rows] bool: the value at the argmax
    is below +inf, i.e. no logit of the row is NaN or +inf.

    The check costs a gather of one value per row, no pass over the logits: the argmax the sampler takes anyway
    already found the row's largest value, and it ranks NaN above everything (torch's max, the native argmax).
    -inf is not an error: it is how masks (a grammar, min_tokens) forbid a token."""
    peak = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [rows]
    return peak < float("inf")


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (transformers' rule: divide a positive
    logit, multiply a negative one), then presence / frequency over output tokens (OpenAI:
    logit -= frequency * count + presence * [count > 0])."""
    seen = torch.zeros_like(logits, dtype=torch.bool)  # [rows, vocab]
    seen[p.rows, p.tokens] = True
    counts = torch.zeros_like(logits)  # [rows, vocab]
    out_rows, out_tokens = p.rows[p.is_output], p.tokens[p.is_output]
    counts.index_put_((out_rows, out_tokens), torch.ones_like(out_rows, dtype=logits.dtype), accumulate=True)
    rep = p.repetition.unsqueeze(1)  # [rows, 1]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's (transformers' MinP)."""
    probs = logits.softmax(dim=-1)  # [rows, vocab]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [rows, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Everything before temperature: logit bias, min_tokens suppression, penalties."""
    if t.bias is not None:
        rows, tokens, values = t.bias
        logits = logits.index_put((rows, tokens), values, accumulate=True)
    if t.suppress is not None:
        logits = logits.index_put(t.suppress, torch.tensor(float("-inf"), device=logits.device))
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
    return logits


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> SampleOutput:
    """Log-probabilities of the model's own distribution (before any processing), in float32."""
    lp = logits.float().log_softmax(dim=-1)  # [rows, vocab]
    chosen = lp.gather(1, tokens.unsqueeze(1))  # [rows, 1]
    rank = (lp > chosen).sum(dim=-1) + 1  # [rows]
    top = lp.topk(top_n, dim=-1) if top_n > 0 else None
    return SampleOutput(
        tokens, chosen.squeeze(1), rank, None if top is None else top.indices, None if top is None else top.values
    )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab] -> same, with tokens outside each row's top-k / nucleus set to -inf.

    Semantics of transformers' TopKLogitsWarper then TopPLogitsWarper: top-k keeps every
    token tied with the k-th largest; top-p drops the smallest tokens whose cumulative
    probability stays <= 1 - top_p, always keeping the most likely one.
    """
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)  # [rows, vocab] each
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))  # [rows]
    kth_largest = ascending.gather(1, (vocab - k).unsqueeze(1))  # [rows, 1]
    ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [rows, vocab]
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)  # [rows, vocab]
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


class SamplingKernels(GrammarKernels, Protocol):
    """The native CPU kernels the sampler uses (conveyor.model.native.NativeKernels has them)."""

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 or bfloat16 -> [rows] int64, exactly `logits.max(dim=-1).indices`."""
        ...


def _first_argmax(x: torch.Tensor, kernels: SamplingKernels | None = None) -> torch.Tensor:
    """[rows, vocab] -> [rows] index of each row's first maximum (the first NaN where a row has one).
    `max(dim).indices` has argmax's tie rule and is faster on CPU than argmax, whose reduction kernel is not
    vectorized the same way; the native kernel gives the same ids and reads the logits once at memory speed
    (64 x 49,152 bfloat16: benchmarks/kernels/decode_attention_bw.py has both)."""
    if kernels is not None and native_applies(x):
        return kernels.argmax_rows(x)
    return x.max(dim=-1).indices


def _greedy_allowed(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, kernels: SamplingKernels | None, owned: bool
) -> torch.Tensor:
    """logits [batch, vocab]; rows [k] int64 (distinct); bitmask [k, words] int32 -> [batch] each row's first
    argmax among the tokens its grammar allows (every token for a row not in `rows`): the argmax of the
    masked logits. The native kernel finds it without writing the mask and reads no logit of a word the
    mask forbids whole (64 x 49,152 bfloat16, all rows JSON-constrained: #19's report has the figures)."""
    if kernels is None or not native_applies(logits):
        return _first_argmax(apply_bitmask(logits, rows, bitmask, owned=owned))
    allowed = kernels.argmax_allowed(logits, rows.to(torch.int64).contiguous(), bitmask.contiguous())  # [k]
    tokens = (
        torch.empty(logits.shape[0], dtype=torch.int64)
        if rows.shape[0] == logits.shape[0]
        else _first_argmax(logits, kernels)
    )  # [batch]
    return tokens.index_copy_(0, rows, allowed)


def plain_greedy(t: SamplingTensors) -> bool:
    """Every row takes the raw argmax: greedy, with no bias, suppressed token, penalty or logprobs (a grammar is
    the caller's to check)."""
    return t.all_greedy and t.bias is None and t.suppress is None and t.penalties is None and t.num_logprobs is None


def sample(
    logits: torch.Tensor,
    t: SamplingTensors,
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    kernels: SamplingKernels | None = None,
    logits_owned: bool = False,
) -> SampleOutput:
    """logits: [rows, vocab] raw model logits, in the model's dtype -> sampled ids [rows] (+ raw
    logprobs when asked).

    Greedy rows take the argmax of the processed logits (exactly the raw argmax when they
    have no bias, penalty or min_tokens); sampled rows use the Gumbel-max trick with
    counter-based noise. Everything is computed in float32, except a batch that is only plain
    greedy rows: its argmax is taken in the model's dtype, which gives the same ids (widening to
    float32 is exact and keeps the order and the ties) without the float32 copy of the logits
    (tests/model/test_sampler.py checks the ids).

    `grammar` (rows [k], bitmask [k, words]): structured-output rows, whose forbidden tokens are set
    to -inf after the other logits processing (so no bias or penalty can bring them back), by the
    native `kernels` where given (CPU). A plain greedy batch takes each row's argmax among its allowed
    tokens in the model's dtype (widening is exact, so the ids are the same), with the native kernel
    without writing the mask at all; else masked in place when `logits_owned` (the caller reads
    `logits` no more). Every argmax goes through the native `kernels` too where given (the same ids as
    torch's `max(dim=-1).indices`, ties and NaN included).

    `finite` flags each row whose logits were not finite (finite_rows): a NaN or +inf among the tokens the
    row may draw (every token, or those its grammar and min_tokens allow; torch's grammar mask adds -inf, which
    leaves a forbidden NaN in place, so it counts there too), and for a row that asks for logprobs among all.
    One exception: a greedy grammar row on the native kernel, whose masked argmax does not rank NaN first, is
    flagged when its chosen logit is NaN (always so when the whole row is, as a broken forward makes it) but
    may pass a row with NaN in some allowed tokens only."""
    if plain_greedy(t):
        if grammar is not None:
            allowed = _greedy_allowed(logits, *grammar, kernels, logits_owned)  # [rows]
            return SampleOutput(allowed, finite=finite_rows(logits, allowed))
        tokens = _first_argmax(logits, kernels)  # [rows]
        return SampleOutput(tokens, finite=finite_rows(logits, tokens))
    raw = logits
    logits = logits.float()  # [rows, vocab]
    processed = process_logits(logits, t)  # [rows, vocab]
    if grammar is not None:
        # in place only into a tensor of our own: `logits` is still read for the raw logprobs below
        own = processed is not logits or (t.num_logprobs is None and (logits is not raw or logits_owned))
        processed = apply_bitmask(
            processed, *grammar, native=None if kernels is None else kernels.apply_token_bitmask_, owned=own
        )
    tokens = _first_argmax(processed, kernels)  # [rows]
    finite = finite_rows(processed, tokens)  # [rows]
    if not t.all_greedy:
        if t.temperature is None or t.top_k is None or t.top_p is None or t.seeds is None or t.output_index is None:
            raise ValueError(
                "SamplingTensors with random rows (all_greedy False) need temperature, top_k, top_p, "
                "seeds and output_index; build them with build_sampling_tensors"
            )
        is_greedy = t.temperature == 0  # [rows]
        temperature = torch.where(is_greedy, torch.ones_like(t.temperature), t.temperature)
        scaled = processed / temperature.unsqueeze(1)  # [rows, vocab]
        if t.any_top_k_or_p:
            scaled = apply_top_k_top_p(scaled, t.top_k, t.top_p)
        if t.min_p is not None:
            scaled = apply_min_p(scaled, t.min_p)
        u = uniform_noise(t.seeds, t.output_index, logits.shape[-1])  # [rows, vocab]
        gumbel = -torch.log(-torch.log(u))  # [rows, vocab]; argmax(logits + gumbel) ~ softmax(logits)
        sampled = _first_argmax(scaled + gumbel, kernels)  # [rows]
        tokens = torch.where(is_greedy, tokens, sampled)
    if t.num_logprobs is None:
        return SampleOutput(tokens, finite=finite)
    out = raw_logprobs(logits, tokens, t.num_logprobs)
    assert out.logprob is not None
    out.finite = finite & out.logprob.isfinite()  # the raw logprobs read every logit, masked ones too
    return out
