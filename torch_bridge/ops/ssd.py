"""Mamba2 SSD with prefill checkpoints at any token, in portable Triton (plain masked loads and stores, `tl.dot`).

The chunked form of `jaxckpt/ops/ssd/README.md` with 64-token chunks counted from each row's start
(`jaxckpt.plan.layout.chunk_layout` on the host, passed as int32 tables), in five launches:

1. `_cumsum_kernel` (chunk, head): delta = clamp(softplus(dt + dt_bias), dt_limit) and the chunk-local inclusive
   cumsum Acs of a = delta * A, both fp32 (delta = 0 past the chunk's end, so Acs stays flat there).
2. `_chunk_state_kernel` (chunk, head, P block): the local end-of-chunk state sum_j exp(Acs_last - Acs_j) delta_j
   x_j B_j^T.
3. `_state_passing_kernel` (row, head, P block): walks the row's chunks in order from its initial state,
   H_{c+1} = exp(Acs_last) H_c + S_loc(c); the slot of S_loc(c) is overwritten with H_c (the state entering chunk c),
   and the row's final state is written at the end. An empty row's final state is its initial state.
4. `_checkpoint_kernel` (checkpoint, head, P block): the state after the first r tokens of chunk c,
   exp(Acs_{r-1}) H_c + sum_{i<r} exp(Acs_{r-1} - Acs_i) delta_i x_i B_i^T (r = 0: H_c itself), exactly jaxckpt's
   XLA in-chunk export; no forced chunk break, so outputs do not depend on the checkpoints.
5. `_scan_kernel` (chunk, head, P block): y_i = sum_{j<=i} exp(Acs_i - Acs_j) (C_i . B_j) delta_j x_j
   + exp(Acs_i) H_c C_i + D x_i, times silu(z_i) when z is given; the decay ratios are masked before the exp.

Everything inside runs in fp32 whatever the input dtype, `tl.dot` at `dot_precision` ("ieee" by default, so fp32
inputs keep fp32 accuracy on GPUs whose fp32 dots would default to TF32). Tensor tiles are padded to at least 16
(the smallest `tl.dot` operand on GPUs). Token inputs are addressed through their strides (a column band of a fused
projection works); offsets are formed in int64. Without a GPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1 set before this module is imported). Triton's library functions (`tl.cumsum`, `tl.sum`,
`tl.sigmoid`) are `@triton.jit` functions the interpreter can call only when triton itself was imported with the
variable already set, so the kernels use builtins and their own `_add` combiner only and run whatever the import
order. Only long-standing Triton features are used, so Triton 3.6 and 3.8 and AMD GPUs run it.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from jaxckpt.plan.checks import check_dt_limit
from jaxckpt.plan.conventions import check_state_layout
from jaxckpt.plan.layout import chunk_layout
from torch_bridge.interop import check_pool, check_tensor, gather_states, host_metadata, pool_slots, write_states

CHUNK = 64
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_DOT_PRECISIONS = ("ieee", "tf32")


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _cumsum_kernel(dt_ptr, A_ptr, dt_bias_ptr, chunk_start_ptr, chunk_len_ptr, delta_ptr, acs_ptr,
                   stride_dt_t, stride_dt_h, num_heads, dt_lo, dt_hi,
                   HAS_LIMIT: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    i = tl.arange(0, CHUNK)
    valid = i < length
    dt = tl.load(dt_ptr + (start + i) * stride_dt_t + h * stride_dt_h, mask=valid, other=0.0).to(tl.float32)
    # softplus: mamba_ssm passes v through above 20; below -15, log(1 + e^v) rounds to 0 in fp32 while e^v does not
    v = dt + tl.load(dt_bias_ptr + h).to(tl.float32)
    e = tl.exp(tl.minimum(v, 20.0))
    delta = tl.where(v > 20.0, v, tl.where(v < -15.0, e, tl.log(1.0 + e)))
    if HAS_LIMIT:
        delta = tl.minimum(tl.maximum(delta, dt_lo), dt_hi)
    delta = tl.where(valid, delta, 0.0)
    acs = tl.associative_scan(delta * tl.load(A_ptr + h).to(tl.float32), 0, _add)
    base = (c * num_heads + h) * CHUNK
    tl.store(delta_ptr + base + i, delta)
    tl.store(acs_ptr + base + i, acs)


@triton.jit
def _tile(BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """This program's head and P block, and the N and chunk-token ranges."""
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    return h, p, tl.arange(0, BLOCK_N), tl.arange(0, CHUNK)


@triton.jit
def _chunk(chunk_start_ptr, chunk_len_ptr, i):
    """This program's chunk, its first token, and which of the chunk's CHUNK token slots hold tokens."""
    c = tl.program_id(0).to(tl.int64)
    return c, tl.load(chunk_start_ptr + c).to(tl.int64), i < tl.load(chunk_len_ptr + c)


@triton.jit
def _state_offsets(h, p, n, dim_p, dim_n):
    """Offsets of head h's [BLOCK_P, BLOCK_N] tile inside one [H, P, N] state, and its mask."""
    return (h * dim_p + p[:, None]) * dim_n + n[None, :], (p < dim_p)[:, None] & (n < dim_n)[None, :]


@triton.jit
def _load_tokens(ptr, start, i, take, head, cols, width, stride_t, stride_h, stride_c):
    """fp32 [CHUNK, BLOCK] of tokens start + i (zeros where not `take`), head or group `head`, columns `cols`."""
    return tl.load(ptr + (start + i)[:, None] * stride_t + head * stride_h + cols[None, :] * stride_c,
                   mask=take[:, None] & (cols < width)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _chunk_state_kernel(x_ptr, B_ptr, delta_ptr, acs_ptr, chunk_start_ptr, chunk_len_ptr, states_ptr,
                        stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g, stride_b_n,
                        num_heads, dim_p, dim_n, heads_per_group,
                        CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr):
    h, p, n, i = _tile(BLOCK_P, BLOCK_N, CHUNK)
    c, start, valid = _chunk(chunk_start_ptr, chunk_len_ptr, i)
    base = (c * num_heads + h) * CHUNK
    acs = tl.load(acs_ptr + base + i)
    weight = tl.where(valid, tl.exp(tl.load(acs_ptr + base + CHUNK - 1) - acs) * tl.load(delta_ptr + base + i), 0.0)
    x = _load_tokens(x_ptr, start, i, valid, h, p, dim_p, stride_x_t, stride_x_h, stride_x_p)     # [CHUNK, BLOCK_P]
    b = _load_tokens(B_ptr, start, i, valid, h // heads_per_group, n, dim_n, stride_b_t, stride_b_g, stride_b_n)
    state = tl.dot(tl.trans(x * weight[:, None]), b, input_precision=PRECISION)            # [BLOCK_P, BLOCK_N]
    offs, mask = _state_offsets(h, p, n, dim_p, dim_n)
    tl.store(states_ptr + c * num_heads * dim_p * dim_n + offs, state, mask=mask)


@triton.jit
def _state_passing_kernel(states_ptr, acs_ptr, initial_ptr, final_ptr, row_first_ptr, row_chunks_ptr,
                          num_heads, dim_p, dim_n,
                          CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h, p, n, _ = _tile(BLOCK_P, BLOCK_N, CHUNK)
    offs, mask = _state_offsets(h, p, n, dim_p, dim_n)
    size = num_heads * dim_p * dim_n
    state = tl.load(initial_ptr + r * size + offs, mask=mask, other=0.0)
    first = tl.load(row_first_ptr + r).to(tl.int64)
    num_chunks = tl.load(row_chunks_ptr + r)
    for j in range(0, num_chunks):
        c = first + j
        local = tl.load(states_ptr + c * size + offs, mask=mask, other=0.0)
        tl.store(states_ptr + c * size + offs, state, mask=mask)
        decay = tl.exp(tl.load(acs_ptr + (c * num_heads + h) * CHUNK + CHUNK - 1))
        state = decay * state + local
    tl.store(final_ptr + r * size + offs, state, mask=mask)


@triton.jit
def _checkpoint_kernel(x_ptr, B_ptr, delta_ptr, acs_ptr, states_ptr, chunk_start_ptr, ckpt_chunk_ptr, ckpt_pos_ptr,
                       out_ptr, stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g, stride_b_n,
                       num_heads, dim_p, dim_n, heads_per_group,
                       CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    h, p, n, i = _tile(BLOCK_P, BLOCK_N, CHUNK)
    c = tl.load(ckpt_chunk_ptr + m).to(tl.int64)
    r = tl.load(ckpt_pos_ptr + m)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    take = i < r
    base = (c * num_heads + h) * CHUNK
    acs = tl.load(acs_ptr + base + i)
    # Acs_{r-1}; 0 for r = 0, leaving H_c alone
    ref = tl.where(r > 0, tl.load(acs_ptr + base + tl.maximum(r - 1, 0)), 0.0)
    # masked before the exp: past token r the ratio Acs_{r-1} - Acs_i is positive and can overflow
    weight = tl.exp(tl.where(take, ref - acs, -1.0e30)) * tl.load(delta_ptr + base + i)
    x = _load_tokens(x_ptr, start, i, take, h, p, dim_p, stride_x_t, stride_x_h, stride_x_p)
    b = _load_tokens(B_ptr, start, i, take, h // heads_per_group, n, dim_n, stride_b_t, stride_b_g, stride_b_n)
    offs, mask = _state_offsets(h, p, n, dim_p, dim_n)
    size = num_heads * dim_p * dim_n
    entering = tl.load(states_ptr + c * size + offs, mask=mask, other=0.0)
    state = tl.exp(ref) * entering + tl.dot(tl.trans(x * weight[:, None]), b, input_precision=PRECISION)
    tl.store(out_ptr + m * size + offs, state, mask=mask)


@triton.jit
def _scan_kernel(x_ptr, B_ptr, C_ptr, z_ptr, D_ptr, y_ptr, delta_ptr, acs_ptr, states_ptr, chunk_start_ptr,
                 chunk_len_ptr, stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g, stride_b_n,
                 stride_c_t, stride_c_g, stride_c_n, stride_z_t, stride_z_h, stride_z_p,
                 stride_y_t, stride_y_h, stride_y_p, num_heads, dim_p, dim_n, heads_per_group,
                 HAS_Z: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr):
    h, p, n, i = _tile(BLOCK_P, BLOCK_N, CHUNK)
    c, start, valid = _chunk(chunk_start_ptr, chunk_len_ptr, i)
    base = (c * num_heads + h) * CHUNK
    acs = tl.load(acs_ptr + base + i)
    delta = tl.load(delta_ptr + base + i)
    group = h // heads_per_group
    cm = _load_tokens(C_ptr, start, i, valid, group, n, dim_n, stride_c_t, stride_c_g, stride_c_n)  # [CHUNK, BLOCK_N]
    bm = _load_tokens(B_ptr, start, i, valid, group, n, dim_n, stride_b_t, stride_b_g, stride_b_n)
    causal = (i[:, None] >= i[None, :]) & valid[None, :]
    # masked before the exp: Acs_i - Acs_j for j > i is positive and can overflow
    decay = tl.exp(tl.where(causal, acs[:, None] - acs[None, :], -1.0e30))
    scores = tl.dot(cm, tl.trans(bm), input_precision=PRECISION) * decay * delta[None, :]   # [CHUNK, CHUNK]
    x = _load_tokens(x_ptr, start, i, valid, h, p, dim_p, stride_x_t, stride_x_h, stride_x_p)     # [CHUNK, BLOCK_P]
    offs, mask = _state_offsets(h, p, n, dim_p, dim_n)
    entering = tl.load(states_ptr + c * num_heads * dim_p * dim_n + offs, mask=mask, other=0.0)  # [BLOCK_P, BLOCK_N]
    y = tl.dot(scores, x, input_precision=PRECISION)
    y += tl.exp(acs)[:, None] * tl.dot(cm, tl.trans(entering), input_precision=PRECISION)
    y += tl.load(D_ptr + h * dim_p + p, mask=p < dim_p, other=0.0)[None, :] * x
    if HAS_Z:
        z = _load_tokens(z_ptr, start, i, valid, h, p, dim_p, stride_z_t, stride_z_h, stride_z_p)
        y = y * z / (1.0 + tl.exp(-z))
    in_p = valid[:, None] & (p < dim_p)[None, :]
    tl.store(y_ptr + (start + i)[:, None] * stride_y_t + h * stride_y_h + p[None, :] * stride_y_p,
             y.to(y_ptr.dtype.element_ty), mask=in_p)


def _tensor(t, *, name: str, shape: tuple, spec: str, device, dtypes=_FLOATS) -> torch.Tensor:
    return check_tensor(t, device, name=name, device_of="x", dtypes=dtypes, shape=shape, spec=spec)


def _block(size: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(size)))


class _Call:
    """Checked arguments of one SSD call, with the host metadata."""

    def __init__(self, x, dt, A, B, C, *, D, dt_bias, z, dt_limit, cu_seqlens, checkpoint_cu, checkpoint_offsets,
                 state_layout, dot_precision):
        check_state_layout(state_layout)
        if dot_precision not in _DOT_PRECISIONS:
            raise ValueError(f"dot_precision: must be one of {_DOT_PRECISIONS}, got {dot_precision!r}")
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            raise ValueError(f"x: expected a torch.Tensor [T, H, P], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        device = x.device
        num_tokens, num_heads, dim_p = x.shape
        _tensor(x, name="x", shape=x.shape, spec="[T, H, P]", device=device)
        _tensor(dt, name="dt", shape=(num_tokens, num_heads), spec="[T, H]", device=device)
        _tensor(A, name="A", shape=(num_heads,), spec="[H]", device=device)
        if not isinstance(B, torch.Tensor) or B.ndim != 3 or B.shape[0] != num_tokens:
            raise ValueError(f"B: expected a torch.Tensor [T, G, N] with T={num_tokens}, got "
                             f"{tuple(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__}")
        num_groups, dim_n = B.shape[1:]
        if num_groups == 0 or num_heads % num_groups:
            raise ValueError(f"B: groups G={num_groups} must divide the heads H={num_heads}")
        _tensor(B, name="B", shape=B.shape, spec="[T, G, N]", device=device, dtypes=(x.dtype,))
        _tensor(C, name="C", shape=B.shape, spec="[T, G, N] like B", device=device, dtypes=(x.dtype,))
        if z is not None:
            _tensor(z, name="z", shape=x.shape, spec="[T, H, P] like x", device=device, dtypes=(x.dtype,))
        if D is None:
            D = torch.zeros((num_heads, dim_p), dtype=torch.float32, device=device)
        elif isinstance(D, torch.Tensor) and D.ndim == 1:
            D = _tensor(D, name="D", shape=(num_heads,), spec="[H]", device=device)[:, None].expand(num_heads, dim_p)
        else:
            _tensor(D, name="D", shape=(num_heads, dim_p), spec="[H] or [H, P]", device=device)
        if dt_bias is None:
            dt_bias = torch.zeros(num_heads, dtype=torch.float32, device=device)
        else:
            _tensor(dt_bias, name="dt_bias", shape=(num_heads,), spec="[H]", device=device)
        self.limit = check_dt_limit(dt_limit)
        self.cu, self.ccu, self.offsets = host_metadata(num_tokens, cu_seqlens, checkpoint_cu, checkpoint_offsets)
        self.x, self.dt, self.B, self.C, self.z = x, dt, B, C, z
        self.A = A.float().contiguous()
        self.D = D.float().contiguous()
        self.dt_bias = dt_bias.float().contiguous()
        self.device = device
        self.num_rows = self.cu.size - 1
        self.dims = (num_tokens, num_heads, dim_p, dim_n, num_heads // num_groups)
        self.state_layout = state_layout
        self.precision = dot_precision

    def state_shape(self, layout: str | None = None) -> tuple:
        _, num_heads, dim_p, dim_n, _ = self.dims
        return (num_heads, dim_p, dim_n) if (layout or self.state_layout) == "vk" else (num_heads, dim_n, dim_p)

    def initial(self, initial_state) -> torch.Tensor:
        """[N, H, P, N] fp32 contiguous ("vk" inside the kernels)."""
        shape = (self.num_rows, *self.state_shape())
        if initial_state is None:
            return torch.zeros((self.num_rows, *self.state_shape("vk")), dtype=torch.float32, device=self.device)
        _tensor(initial_state, name="initial_state", shape=shape, spec=f'[N, {self.state_layout!r} state]',
                device=self.device, dtypes=(torch.float32,))
        if self.state_layout == "kv":
            initial_state = initial_state.transpose(-1, -2)
        return initial_state.contiguous()

    def output_states(self, states: torch.Tensor) -> torch.Tensor:
        return states if self.state_layout == "vk" else states.transpose(-1, -2).contiguous()


def _run(call: _Call, initial: torch.Tensor):
    """The five launches; returns (y, final_state, checkpoint_states) with states in "vk"."""
    num_tokens, num_heads, dim_p, dim_n, heads_per_group = call.dims
    device = call.device
    layout = chunk_layout(call.cu, call.ccu, call.offsets, chunk_size=CHUNK, num_tokens=num_tokens)
    num_chunks = int(np.asarray(layout.row_num_chunks).sum())
    num_real = int(call.ccu[-1])
    ints = lambda a: torch.as_tensor(np.ascontiguousarray(a, dtype=np.int32), device=device)  # noqa: E731
    chunk_start, chunk_len = ints(layout.chunk_start), ints(layout.chunk_len)
    y = torch.zeros((num_tokens, num_heads, dim_p), dtype=call.x.dtype, device=device)
    final = torch.empty((call.num_rows, num_heads, dim_p, dim_n), dtype=torch.float32, device=device)
    checkpoint_states = torch.zeros((call.offsets.size, num_heads, dim_p, dim_n), dtype=torch.float32, device=device)
    delta = torch.empty((max(num_chunks, 1), num_heads, CHUNK), dtype=torch.float32, device=device)
    acs = torch.empty_like(delta)
    states = torch.empty((max(num_chunks, 1), num_heads, dim_p, dim_n), dtype=torch.float32, device=device)
    block_p, block_n = _block(dim_p, 32), _block(dim_n, 256)
    p_blocks = triton.cdiv(dim_p, block_p)
    x, B, C = call.x, call.B, call.C
    z = call.z if call.z is not None else x
    tiles = dict(CHUNK=CHUNK, BLOCK_P=block_p, BLOCK_N=block_n)
    lo, hi = call.limit or (0.0, 0.0)
    if num_chunks:
        _cumsum_kernel[(num_chunks, num_heads)](
            call.dt, call.A, call.dt_bias, chunk_start, chunk_len, delta, acs, *call.dt.stride(), num_heads, lo, hi,
            HAS_LIMIT=call.limit is not None, CHUNK=CHUNK)
        _chunk_state_kernel[(num_chunks, num_heads, p_blocks)](
            x, B, delta, acs, chunk_start, chunk_len, states, *x.stride(), *B.stride(), num_heads, dim_p, dim_n,
            heads_per_group, PRECISION=call.precision, **tiles)
    if call.num_rows:
        _state_passing_kernel[(call.num_rows, num_heads, p_blocks)](
            states, acs, initial, final, ints(layout.row_first_chunk), ints(layout.row_num_chunks), num_heads, dim_p,
            dim_n, **tiles)
    if num_real:
        _checkpoint_kernel[(num_real, num_heads, p_blocks)](
            x, B, delta, acs, states, chunk_start, ints(layout.checkpoint_chunk), ints(layout.checkpoint_pos),
            checkpoint_states, *x.stride(), *B.stride(), num_heads, dim_p, dim_n, heads_per_group,
            PRECISION=call.precision, **tiles)
    if num_chunks:
        _scan_kernel[(num_chunks, num_heads, p_blocks)](
            x, B, C, z, call.D, y, delta, acs, states, chunk_start, chunk_len, *x.stride(), *B.stride(), *C.stride(),
            *z.stride(), *y.stride(), num_heads, dim_p, dim_n, heads_per_group, HAS_Z=call.z is not None,
            PRECISION=call.precision, **tiles)
    return y, final, checkpoint_states


def ssd(x, dt, A, B, C, *, D=None, dt_bias=None, z=None, dt_limit=None, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="vk", dot_precision="ieee"):
    """Mamba2's SSD over packed varlen rows with checkpoints at any offset, as `jaxckpt.ops.ssd`.

    x               # [T, H, P] fp32/fp16/bf16, any strides; z [T, H, P] optional gate (y * silu(z))
    dt              # [T, H] raw: delta = softplus(dt + dt_bias), clamped to dt_limit = (lo, hi) when given
    A               # [H]; dt_bias [H]; D [H] or [H, P]
    B, C            # [T, G, N] in x's dtype; head h reads group h // (H // G)
    initial_state   # fp32 [N, H, P, N] ("vk", mamba_ssm's) or [N, H, N, P] ("kv"); None = zeros
    cu_seqlens      # i32[N + 1]; checkpoint_cu i32[N + 1] + checkpoint_offsets i32[M] (CSR, row-relative)
    Returns (y [T, H, P] in x's dtype, final_state fp32 [N, ...], checkpoint_states fp32 [M, ...]); padding tokens
    and padded CSR entries give zeros. Every argument is checked on the host before the first launch.
    """
    call = _Call(x, dt, A, B, C, D=D, dt_bias=dt_bias, z=z, dt_limit=dt_limit, cu_seqlens=cu_seqlens,
                 checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, state_layout=state_layout,
                 dot_precision=dot_precision)
    y, final, checkpoint_states = _run(call, call.initial(initial_state))
    return y, call.output_states(final), call.output_states(checkpoint_states)


def ssd_paged(x, dt, A, B, C, state_pool, *, initial_state_indices, has_initial_state, final_state_indices,
              checkpoint_state_indices=None, D=None, dt_bias=None, z=None, dt_limit=None, cu_seqlens=None,
              checkpoint_cu=None, checkpoint_offsets=None, state_layout="vk", dot_precision="ieee"):
    """`ssd` over a state pool [S, H, P, N] ("vk") or [S, H, N, P] ("kv"), fp32/bf16/fp16: returns y.

    Initial states are read from the pool (-1, the null slot or has_initial_state False: zeros); final and checkpoint
    states are written in place in the pool's dtype (-1 / null slots and padded CSR entries write nothing). Slots are
    validated before the first launch.
    """
    call = _Call(x, dt, A, B, C, D=D, dt_bias=dt_bias, z=z, dt_limit=dt_limit, cu_seqlens=cu_seqlens,
                 checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, state_layout=state_layout,
                 dot_precision=dot_precision)
    check_pool(state_pool, call.state_shape(), call.device)
    slots = pool_slots(state_pool.shape[0], call.num_rows, call.ccu, call.offsets.size,
                       initial_state_indices=initial_state_indices, has_initial_state=has_initial_state,
                       final_state_indices=final_state_indices, checkpoint_state_indices=checkpoint_state_indices)
    initial = call.initial(gather_states(state_pool, slots.initial))
    y, final, checkpoint_states = _run(call, initial)
    write_states(state_pool, slots.final, call.output_states(final))
    write_states(state_pool, slots.checkpoint, call.output_states(checkpoint_states))
    return y
