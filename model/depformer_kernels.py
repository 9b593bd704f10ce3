"""The depformer's products for a lone row as Triton GEMVs with their neighbours fused in
(EngineConfig.fused_depformer).

At one row the depformer is a chain of ~260 dependent launches a frame (8 steps x 6 layers of four products, the
attention, two residual-add-and-norms and a SiLU gate, each a few microseconds of work), and its products run far
from the memory's speed: on an H100 the 208 products of a frame took 1.26 ms through cuBLAS at one row (6 us each,
1.1 TB/s) and 1.00 ms as a plain Triton GEMV (docs/benchmarks.md). Here a layer is five launches instead of eight:
the residual add and RMS norm ride in the next product's prologue (each program recomputes its row's norm; the first
program writes the new residual stream), the SiLU gate in the gate product's epilogue, the depformer's input sum in
its product's epilogue.

Reduction orders differ from cuBLAS's, so tokens move: a flag until docs/fidelity.md's agreement says otherwise. The
torch ops (`fused_linear_reference`) are the CPU path and the kernel's oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model import launch
from model.attention import TRITON_INTERPRETED

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# The engine takes the kernel for a lone row only: each row's programs read the weights again (H100: the depformer
# 1.83 -> 1.42 ms at one row in one run, none in another: docs/benchmarks.md; 1.91 -> 2.94 at eight), and a variant
# whose programs took every row's share of a weight block was no better (H200: 1.88 -> 1.44 at one, 2.00 at two,
# 2.82 at four, 4.49 at eight).
FUSED_ROWS_MAX = 1
BLOCK_N = 8              # outputs a program computes (the fastest of 2-16 at one row on an H100)
INTERPRETED_BLOCK_N = 128  # Triton's interpreter pays per program: the tests' 2,048-logit heads in 16, not 256
BLOCK_K = 512            # inputs a program loads at once (at most)


def fused_linear_reference(x: Tensor, weight: Tensor, *, delta: Tensor | None = None, alpha: Tensor | None = None,
                           eps: float = 0.0, gate: bool = False, add: Tensor | None = None,
                           out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """fused_linear through the torch path's own ops: (the residual stream `x + delta` (x itself without delta),
    the product)."""
    stream = x if delta is None else x + delta
    inputs = stream if alpha is None else \
        F.rms_norm(stream.float(), (stream.shape[-1],), alpha.reshape(-1).float(), eps).to(stream.dtype)
    y = F.linear(inputs, weight)
    if gate:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    if add is not None:
        y = y + add
    return stream, y if out_dtype is None else y.to(out_dtype)


def fused_linear(x: Tensor, weight: Tensor, *, delta: Tensor | None = None, alpha: Tensor | None = None,
                 eps: float = 0.0, gate: bool = False, add: Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """`weight` [N, K] times the rows of x [M, K], with what sits around a depformer product:
    - `delta`: the residual add before it (x + delta is the new residual stream, returned first);
    - `alpha`, `eps`: the RMS norm (fp32, as the torch path's) of that stream is what the product takes;
    - `gate`: weight stacks gate rows then up rows ([2N, K]); the result is silu(gate) * up [M, N];
    - `add`: [M, N] added to the product; `out_dtype`: the product's dtype (x's by default).
    Returns (residual stream, product) [M, K], [M, N]; the stream is x itself without `delta`."""
    if triton is None or not (x.is_cuda or TRITON_INTERPRETED):
        return fused_linear_reference(x, weight, delta=delta, alpha=alpha, eps=eps, gate=gate, add=add,
                                      out_dtype=out_dtype)
    M, K = x.shape
    n_total = weight.shape[0]
    N = n_total // 2 if gate else n_total
    assert weight.shape[1] == K and weight.stride(1) == 1 and x.stride(1) == 1
    assert (delta is None or delta.stride(1) == 1) and (add is None or add.stride(1) == 1)
    y = torch.empty(M, N, device=x.device, dtype=out_dtype or x.dtype)
    stream = x if delta is None else torch.empty_like(x)
    block_n = BLOCK_N if x.is_cuda else INTERPRETED_BLOCK_N
    _fused_linear_kernel[(triton.cdiv(N, block_n), M)](
        x, x if delta is None else delta, x if alpha is None else alpha, weight, x if add is None else add, y, stream,
        N, K, x.stride(0), 0 if delta is None else delta.stride(0), weight.stride(0),
        0 if add is None else add.stride(0), y.stride(0), stream.stride(0), eps,
        HAS_DELTA=delta is not None, HAS_NORM=alpha is not None, GATE=gate, HAS_ADD=add is not None,
        BLOCK_N=block_n, BLOCK_K=min(BLOCK_K, triton.next_power_of_2(K)), **launch.arguments(x.device), num_warps=4,
    )
    return stream, y


if triton is not None:

    @triton.jit
    def _stream_block(X, D, ALPHA, row_x, row_d, rk, K, rstd, HAS_DELTA: tl.constexpr, HAS_NORM: tl.constexpr):
        """Inputs rk of one row as the product takes them: x (+ delta, rounded to x's dtype as torch's add is),
        normed in fp32 and rounded back where there is a norm; and the stream itself, in x's dtype."""
        valid = rk < K
        x = tl.load(X + row_x + rk, mask=valid, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(D + row_d + rk, mask=valid, other=0.0).to(tl.float32)).to(x.dtype)
        inputs = x
        if HAS_NORM:
            alpha = tl.load(ALPHA + rk, mask=valid, other=0.0).to(tl.float32)
            inputs = (x.to(tl.float32) * rstd * alpha).to(x.dtype)
        return x, inputs

    @triton.jit
    def _weight_blocks(W, rn, rk, n_valid, N, K, sw, GATE: tl.constexpr):
        """The weight block [rn, rk] and, for a gated product, its up rows' block (else the same block again)."""
        mask = n_valid[:, None] & (rk[None, :] < K)
        w = tl.load(W + rn[:, None] * sw + rk[None, :], mask=mask, other=0.0)
        w_up = w
        if GATE:
            w_up = tl.load(W + (rn[:, None] + N) * sw + rk[None, :], mask=mask, other=0.0)
        return w, w_up

    @triton.jit
    def _accumulate(X, D, ALPHA, STREAM, acc, up, w, w_up, m, row_x, row_d, ss, rk, K, rstd, pid_n,
                    HAS_DELTA: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr):
        """acc (and up) plus the weight blocks times the inputs rk of row m; program 0 stores that stream block."""
        stream, inputs = _stream_block(X, D, ALPHA, row_x, row_d, rk, K, rstd, HAS_DELTA, HAS_NORM)
        # A branch, not a store masked by the program's number: with the mask the depformer at one row took 1.90 ms
        # instead of 1.42 (H100, two runs differing in this line; why is not known).
        if HAS_DELTA and pid_n == 0:
            tl.store(STREAM + m * ss + rk, stream, mask=rk < K)
        taken = inputs.to(tl.float32)[None, :]
        acc += w.to(tl.float32) * taken
        if GATE:
            up += w_up.to(tl.float32) * taken
        return acc, up

    @triton.jit
    def _fused_linear_kernel(X, D, ALPHA, W, ADD, Y, STREAM, N, K, sx, sd, sw, sa, sy, ss, eps,
                             HAS_DELTA: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
                             HAS_ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PDL: tl.constexpr):
        """Program (n, m): outputs [n * BLOCK_N, (n + 1) * BLOCK_N) of row m, on CUDA cores (one row leaves the
        tensor cores' tiles empty); program (0, m) also writes row m's residual stream. Launched as a programmatic
        dependent (model/launch.py), it loads its first block of weights, which no kernel writes, before it waits
        for the kernel before: the chain's launches are latency, not bytes."""
        launch.allow_next(PDL)
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        row_x = m * sx
        row_d = m * sd
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = rn < N
        rk = tl.arange(0, BLOCK_K)
        w_first, w_up_first = _weight_blocks(W, rn, rk, n_valid, N, K, sw, GATE)
        launch.wait_for_previous(PDL)
        rstd = 0.0
        if HAS_NORM:
            squares = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                stream, _ = _stream_block(X, D, ALPHA, row_x, row_d, k0 + tl.arange(0, BLOCK_K), K, rstd,
                                          HAS_DELTA, False)
                s = stream.to(tl.float32)
                squares += s * s
            rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc, up = _accumulate(X, D, ALPHA, STREAM, acc, up, w_first, w_up_first, m, row_x, row_d, ss, rk, K, rstd,
                              pid_n, HAS_DELTA, HAS_NORM, GATE)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w, w_up = _weight_blocks(W, rn, rk, n_valid, N, K, sw, GATE)
            acc, up = _accumulate(X, D, ALPHA, STREAM, acc, up, w, w_up, m, row_x, row_d, ss, rk, K, rstd, pid_n,
                                  HAS_DELTA, HAS_NORM, GATE)
        # Rounded to the activations' dtype where the torch path's product is, before its epilogue's ops.
        y = tl.sum(acc, 1).to(X.dtype.element_ty).to(tl.float32)
        if GATE:
            u = tl.sum(up, 1).to(X.dtype.element_ty).to(tl.float32)
            y = (y / (1.0 + tl.exp(-y)) * u).to(X.dtype.element_ty).to(tl.float32)
        if HAS_ADD:
            y += tl.load(ADD + m * sa + rn, mask=n_valid, other=0.0).to(tl.float32)
        tl.store(Y + m * sy + rn, y.to(Y.dtype.element_ty), mask=n_valid)
