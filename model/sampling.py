"""Per-row token sampling: greedy, or temperature + top-k, seeded per row with a counter-based hash.

The noise for row b depends only on (seed_b, frame counter, stream, token id), never on other rows, the batch
size or a global generator, so a session's samples are reproducible from its seed wherever its slot sits, and
the whole thing is fixed-shape tensor math that a CUDA graph can capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model import launch
from model.attention import use_kernel
from model.fused import fusable
from model.sampling_params import SamplingParams

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_M32 = 0xFFFFFFFF
# The fused draw takes a row's whole vocabulary into one program's registers: the audio codebooks' 2048 fit, the
# text's 32,000 would spill, so the text draw stays on torch's path.
FUSED_DRAW_MAX_VOCAB = 4096


def hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seed: Tensor, salt: Tensor, ids: Tensor) -> Tensor:
    """Uniform (0, 1) floats for each row and id: seed, salt [B] (counter and stream); ids [B, K] -> [B, K] fp32."""
    base = hash32(hash32(seed) ^ hash32(salt))
    h = hash32(base.unsqueeze(1) + ids * 0x9E3779B1)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class RowSampling:
    """Sampling settings of every row as tensors [B] on the model's device."""

    greedy: Tensor  # bool
    temperature: Tensor  # fp32; <= 0 means greedy
    top_k: Tensor  # long, >= 1
    seed: Tensor  # long, [0, 2**32)

    def rows(self, index: slice) -> RowSampling:
        """A view of some rows."""
        return RowSampling(self.greedy[index], self.temperature[index], self.top_k[index], self.seed[index])

    def to(self, device: torch.device) -> RowSampling:
        return RowSampling(*(t.to(device) for t in (self.greedy, self.temperature, self.top_k, self.seed)))

    def set_row(self, row: int, greedy: bool, temperature: float, top_k: int, seed: int) -> None:
        """Set one row in place from Python values: fills on the device, no upload, so nothing waits for the
        work queued before it (a tick in flight)."""
        self.greedy[row].fill_(greedy)
        self.temperature[row].fill_(temperature)
        self.top_k[row].fill_(top_k)
        self.seed[row].fill_(seed_bits(seed))


@dataclass(frozen=True)
class Forced:
    """Rows whose token is given rather than drawn: where `rows` (bool [B]) is set, the token is `tokens` [B] (long)."""

    rows: Tensor
    tokens: Tensor

    def apply(self, drawn: Tensor) -> Tensor:
        return torch.where(self.rows, self.tokens, drawn)


def _salt(counter: Tensor, stream: int) -> Tensor:
    """The noise's salt of a row's draw: its frame `counter` [B] and the draw's `stream` (the fused draw's kernel
    computes the same)."""
    return counter * 64 + stream


def sample(logits: Tensor, params: RowSampling, counter: Tensor, stream: int, max_top_k: int,
           fused: bool = False, forced: Forced | None = None) -> Tensor:
    """One token per row from logits [B, V] (float32, or bf16 read as float32) -> [B] long; the `forced` rows take
    their given token.

    Sampled rows take argmax(logits / T + Gumbel) over their own top-k, which is the reference's draw
    (softmax, top-k, then argmax of p / q with q ~ Exp(1)) written in log space. Greedy rows take the reference's
    argmax, the first of equal maxima: logits out of bf16 products tie often, and topk orders ties its own way. The
    noise's salt is `counter * 64 + stream` (counter [B], the row's frame).
    `fused`: on CUDA, a vocabulary of up to FUSED_DRAW_MAX_VOCAB is drawn by one kernel (`draw_triton`).
    """
    if fused and logits.shape[-1] <= FUSED_DRAW_MAX_VOCAB and use_kernel(logits.device):
        return draw_triton(logits, params, counter, stream, forced)
    logits = logits.float()
    k = min(max_top_k, logits.shape[-1])
    values, ids = logits.topk(k, dim=-1)
    drawn = _choose(values, ids, logits.argmax(dim=-1), params.greedy, params.temperature, params.top_k,
                    params.seed, _salt(counter, stream))
    return drawn if forced is None else forced.apply(drawn)


def draw_reference(logits: Tensor, params: RowSampling, counter: Tensor, stream: int,
                   forced: Forced | None = None) -> Tensor:
    """The fused draw through torch ops (the kernel's oracle): every candidate ranked by value, equal values by
    index, which is where it may differ from `sample`'s (topk ranks equal values its own way)."""
    values, ids = logits.float().sort(dim=-1, descending=True, stable=True)
    drawn = _choose(values, ids, ids[:, 0], params.greedy, params.temperature, params.top_k, params.seed,
                    _salt(counter, stream))
    return drawn if forced is None else forced.apply(drawn)


def draw_triton(logits: Tensor, params: RowSampling, counter: Tensor, stream: int, forced: Forced | None = None
                ) -> Tensor:
    """The draw of `sample` as one Triton kernel per row, on whatever device Triton runs (CUDA; the CPU through its
    interpreter). torch's path sorts each row's candidates (a top 2048 of 2048 is a whole sort) and takes four more
    kernels; at one row on the H200 the tick's eight audio draws spent 0.27 ms in topk alone, of a depformer of 2.1
    (docs/bench/h200_roofline_graphs.jsonl). The kernel draws over the whole row and keeps that token where it is one
    of the row's top_k (most draws); else it finds the top_k-th largest logit by bisection on the floats'
    order-preserving integer keys and draws again among the top_k, equal values at that boundary lowest index
    first. The salt and the forced rows' select are its own too (they were three more launches a draw)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and vocab <= FUSED_DRAW_MAX_VOCAB
    tokens = torch.empty(rows, device=logits.device, dtype=torch.long)
    given = (tokens, tokens) if forced is None else (forced.rows, forced.tokens)  # read only with HAS_FORCED
    _draw_kernel[(rows,)](logits, logits.stride(0), params.greedy, params.temperature, params.top_k, params.seed,
                          counter, stream, *given, given[0].stride(0), given[1].stride(0), tokens, vocab,
                          HAS_FORCED=forced is not None, BLOCK=triton.next_power_of_2(vocab),
                          **launch.arguments(logits.device), num_warps=4)
    return tokens


@fusable
def _choose(values: Tensor, ids: Tensor, first_max: Tensor, greedy: Tensor, temperature: Tensor, top_k: Tensor,
            seed: Tensor, salt: Tensor) -> Tensor:
    """The draw among each row's sorted top candidates (values, ids [B, K]); greedy rows take first_max [B]."""
    gumbel = -torch.log(-torch.log(uniform_noise(seed, salt, ids)))
    scores = values / temperature.clamp(min=1e-5).unsqueeze(1) + gumbel
    ranks = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    scores = scores.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    sampled = ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(greedy | (temperature <= 0), first_max, sampled)


def seed_bits(seed: int) -> int:
    """Fold a 64-bit seed into the 32 bits the noise hash takes."""
    return (seed ^ (seed >> 32)) & _M32


def row_sampling(
    params: list[SamplingParams], seeds: list[int], device: torch.device
) -> tuple[RowSampling, RowSampling]:
    """Text and audio RowSampling tensors for rows with these params and resolved seeds."""
    greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
    seed = torch.tensor([seed_bits(s) for s in seeds], dtype=torch.long)
    text = RowSampling(greedy, torch.tensor([p.temp_text for p in params]), torch.tensor([p.topk_text for p in params]),
                       seed)
    audio = RowSampling(greedy, torch.tensor([p.temp_audio for p in params]),
                        torch.tensor([p.topk_audio for p in params]), seed)
    return text.to(device), audio.to(device)


if triton is not None:

    @triton.jit
    def _hash32(x):
        """hash32 on int64 lanes holding [0, 2**32), as torch's: the products wrap, their low 32 bits kept."""
        x = x & 0xFFFFFFFF
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _draw_kernel(LOGITS, s_row, GREEDY, TEMPERATURE, TOP_K, SEED, COUNTER, stream, FORCED, GIVEN, s_forced,
                     s_given, TOKENS, V, HAS_FORCED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        row = tl.program_id(0)
        ids = tl.arange(0, BLOCK)
        valid = ids < V
        x = tl.load(LOGITS + row * s_row + ids, mask=valid, other=float("-inf")).to(tl.float32)  # bf16 exactly
        first_max = tl.min(tl.where(valid & (x == tl.max(x, 0)), ids, BLOCK), 0)
        # Keys order as the floats do (a negative float's magnitude bits flipped; -0 made +0 first, as they are
        # equal): candidates are the first k in (key descending, index ascending).
        bits = (x + 0.0).to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        k = tl.minimum(tl.load(TOP_K + row), V)

        seed = tl.load(SEED + row)
        salt = tl.load(COUNTER + row).to(tl.int64) * 64 + stream
        base = _hash32(_hash32(seed) ^ _hash32(salt))
        h = _hash32(base + ids.to(tl.int64) * 0x9E3779B1)
        uniform = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24))
        temperature = tl.load(TEMPERATURE + row)
        scores = tl.where(valid, x / tl.maximum(temperature, 1e-5) - tl.log(-tl.log(uniform)), float("-inf"))
        # The draw over the whole codebook is the draw over the top k whenever its winner is one of them (most
        # draws: top_k is 250 of 2048, and a winner outside is a token of the tail): then no search is needed.
        sampled = tl.min(tl.where(valid & (scores == tl.max(scores, 0)), ids, BLOCK), 0)
        winner = tl.max(tl.where(ids == sampled, key, -(2**31)), 0)
        rank = tl.sum((valid & ((key > winner) | ((key == winner) & (ids < sampled)))).to(tl.int32), 0)
        if rank >= k:
            # The row's top_k-th largest key: the largest t with at least k keys >= t, by 32 halvings of the int32
            # range (exact), then the draw among the keys above t and the lowest-indexed of those equal to it.
            lo = tl.min(tl.where(valid, key, 2**31), 0)
            hi = tl.max(tl.where(valid, key, -(2**31)), 0)
            for _ in range(32):
                mid = (lo + hi + 1) >> 1
                enough = tl.sum((valid & (key >= mid)).to(tl.int32), 0) >= k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid - 1)
            above = valid & (key > lo)
            at = valid & (key == lo)
            taken_at = tl.cumsum(at.to(tl.int32), 0) <= k - tl.sum(above.to(tl.int32), 0)
            candidate = above | (at & taken_at)
            masked = tl.where(candidate, scores, float("-inf"))
            sampled = tl.min(tl.where(candidate & (masked == tl.max(masked, 0)), ids, BLOCK), 0)
        greedy = (tl.load(GREEDY + row) != 0) | (temperature <= 0)
        # A row of NaN logits matches no maximum: it still gets a token of the vocabulary (the embedding that takes
        # it would fault the device, every session's), and its audio then fails that session alone.
        token = tl.minimum(tl.where(greedy, first_max, sampled), V - 1).to(tl.int64)
        if HAS_FORCED:
            token = tl.where(tl.load(FORCED + row * s_forced) != 0, tl.load(GIVEN + row * s_given), token)
        tl.store(TOKENS + row, token)
