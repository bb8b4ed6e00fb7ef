"""What every public op entry shares: implementation choice, batch flattening, metadata validation, paged pools and
the split-at-checkpoint driver.

Implementations are looked up by name in an op's registry, `{name: "module:function"}`, and imported on first use. A
module may define `supports(**call) -> str | None`: a reason string declines the call, and `implementation=None`
then falls back to the next (the portable "xla" path last); the returned `Choice` keeps the reasons. A `config`
(`jaxckpt.ops.common.configs`) names the implementation it tunes: the call runs that one, or raises if it declines
or another is named, and its fields go to it as keyword options. A module that JAX can differentiate through says
so with `differentiable(**call) -> bool`; `run` wraps every other one so that `jax.grad`, `jax.vjp`, `jax.jvp` and
`jax.linearize` raise a ValueError naming `implementation="xla"` instead of failing inside the kernel.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.ops.common.contract import check_call, check_paged
from jaxckpt.plan.conventions import NULL_SLOT, validate_checkpoints, validate_cu_seqlens, validate_slots
from jaxckpt.plan.layout import split_layout

# first the fastest on the H200 (bench/README.md); each declines what it cannot run (pallas_mosaic_gpu: Hopper and
# 16-bit q, k, v only), so the order falls back to the portable path
DEFAULT_ORDER = ("pallas_mosaic_gpu", "pallas_triton", "xla")


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str
    function: Callable
    declined: tuple[tuple[str, str], ...]  # (implementation, reason) tried before this one
    differentiable: bool = False  # JAX can differentiate through `function` for this call


def _load(target: str):
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return module, getattr(module, attr)


def _decline_reason(module, call: Mapping[str, object], cu_seqlens) -> str | None:
    supports = getattr(module, "supports", None)
    if supports is None:
        return None
    # launch grids can depend on the row count; a `supports` that does not name cu_seqlens takes only the call
    if cu_seqlens is not None and "cu_seqlens" in inspect.signature(supports).parameters:
        call = {**call, "cu_seqlens": cu_seqlens}
    return supports(**call)


def _differentiable(module, call: Mapping[str, object]) -> bool:
    differentiable = getattr(module, "differentiable", None)
    return differentiable is not None and differentiable(**call)


def _unhonoured(function, needs: Mapping[str, object]) -> str | None:
    if not needs:
        return None
    params = inspect.signature(function).parameters
    for name, value in needs.items():
        if name not in params:
            return f"{name}: {value!r} is not an option of this implementation"
    return None


def choose_implementation(registry: Mapping[str, str], implementation: str | None, *, cu_seqlens=None,
                          needs: Mapping[str, object] | None = None, **call) -> Choice:
    """The implementation to run: the one named, or the first of DEFAULT_ORDER that supports this call here.

    `call` goes to each module's `supports`; `cu_seqlens` too where `supports` names it. `needs`: options the call
    sets that an implementation honours only if its function takes them by name (e.g. checkpoint_method=
    "forced_break"); one that does not declines.
    """
    needs = needs or {}
    if implementation is not None:
        if implementation not in registry:
            raise ValueError(f"implementation: must be one of {sorted(registry)} or None, got {implementation!r}")
        try:
            module, function = _load(registry[implementation])
        except ImportError as error:
            raise ValueError(f"implementation: {implementation!r} is unavailable here: {error}") from error
        reason = _decline_reason(module, call, cu_seqlens) or _unhonoured(function, needs)
        if reason is not None:
            raise ValueError(f"implementation: {implementation!r} does not support this call: {reason}")
        return Choice(implementation, function, (), _differentiable(module, call))
    declined = []
    for name in DEFAULT_ORDER:
        if name not in registry:
            continue
        try:
            module, function = _load(registry[name])
        except ImportError as error:
            declined.append((name, f"unavailable: {error}"))
            continue
        reason = _decline_reason(module, call, cu_seqlens) or _unhonoured(function, needs)
        if reason is None:
            return Choice(name, function, tuple(declined), _differentiable(module, call))
        declined.append((name, reason))
    raise ValueError(f"implementation: nothing supports this call; declined: {declined}")


def is_traced(*values) -> bool:
    return any(isinstance(v, jax.core.Tracer) for v in values)


def _not_differentiable(function: Callable, message: str) -> Callable:
    """`function(**kwargs)` with the same forward, whose derivative rule raises ValueError(message) at trace time.

    Only traced values become arguments of the `jax.custom_jvp` (integer metadata included: its tangents are zero, and
    a call whose tangents are all zero never reaches the rule); Python options and concrete arrays stay closed over.
    A JVP rule, not a VJP one, so forward mode (`jax.jvp`, `jax.linearize`) meets the same error as `jax.grad`.
    """
    def call(**kwargs):
        leaves, tree = jax.tree.flatten(kwargs)
        traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.core.Tracer)]
        if not traced:
            return function(**kwargs)

        @jax.custom_jvp
        def forward(*values):
            filled = list(leaves)
            for i, value in zip(traced, values):
                filled[i] = value
            return function(**jax.tree.unflatten(tree, filled))

        @forward.defjvp
        def _refuse(primals, tangents):
            raise ValueError(message)

        return forward(*(leaves[i] for i in traced))

    return call


def flatten_batch(arrays: Sequence, cu_seqlens, *, packed_ndim: int, name: str):
    """Accepts packed `[T, ...]` inputs as they are, dense `[B, T, ...]` inputs (B packed rows of length T), and
    `[1, T, ...]` inputs with `cu_seqlens` (FLA's, FlashQLA's and vLLM's varlen convention: the rows packed along T).

    `packed_ndim` is the rank of the first array in packed form. Returns (packed arrays, cu_seqlens, the batch shape
    the outputs take back, or None).
    """
    first = arrays[0]
    if first.ndim != packed_ndim + 1:
        return list(arrays), cu_seqlens, None
    batch, length = first.shape[:2]
    packed = [None if a is None else a.reshape(batch * length, *a.shape[2:]) for a in arrays]
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens: with [B, T, ...] inputs the rows are packed along T, so B must be 1 "
                             f"(FLA's varlen convention), got {name} of shape {first.shape}")
        return packed, cu_seqlens, (1, length)
    return packed, np.arange(batch + 1, dtype=np.int32) * length, (batch, length)


def unflatten(array, batch_shape):
    return array if batch_shape is None else array.reshape(*batch_shape, *array.shape[1:])


def host_metadata(num_tokens: int, cu_seqlens, checkpoint_cu, checkpoint_offsets):
    """Validates concrete metadata once on the host (skipped when traced: the caller vouches for it)."""
    if is_traced(cu_seqlens, checkpoint_cu, checkpoint_offsets):
        if (checkpoint_cu is None) != (checkpoint_offsets is None):
            raise ValueError("checkpoint_cu and checkpoint_offsets: give both or neither")
        return cu_seqlens, checkpoint_cu, checkpoint_offsets
    cu = validate_cu_seqlens(None if cu_seqlens is None else np.asarray(cu_seqlens), num_tokens)
    ccu, offsets = validate_checkpoints(None if checkpoint_cu is None else np.asarray(checkpoint_cu),
                                        None if checkpoint_offsets is None else np.asarray(checkpoint_offsets), cu)
    return cu, ccu, offsets


def validate_pool_slots(num_slots: int, *, initial_state_indices, final_state_indices, checkpoint_state_indices,
                        checkpoint_cu):
    """Host checks of the paged form's values: slots in range, no slot written twice (`check_paged` has checked the
    lengths)."""
    if is_traced(initial_state_indices, final_state_indices, checkpoint_state_indices, checkpoint_cu):
        return
    validate_slots(initial_state_indices, num_slots, name="initial_state_indices")
    final = validate_slots(final_state_indices, num_slots, name="final_state_indices")
    written = [final]
    if checkpoint_state_indices is not None:
        ckpt = validate_slots(checkpoint_state_indices, num_slots, name="checkpoint_state_indices")
        real = int(np.asarray(checkpoint_cu)[-1])
        if np.any(ckpt[real:] != NULL_SLOT):
            raise ValueError("checkpoint_state_indices: padded checkpoint entries must carry the null slot")
        written.append(ckpt[:real])
    written = np.concatenate(written)
    written = written[written != NULL_SLOT]
    if np.unique(written).size != written.size:
        raise ValueError("final_state_indices/checkpoint_state_indices: a slot is written twice in one call")


def _real_slots(idx, num_slots: int):
    """Slots that address a real state: not the null slot and inside the pool. Under traced metadata a negative or
    out-of-range slot must neither wrap (JAX indexing would read or write slot S - 1) nor clamp: it is masked."""
    return (idx > NULL_SLOT) & (idx < num_slots)


def gather_states(state_pool, initial_state_indices, has_initial_state):
    """Initial states [N, ...] fp32 from the pool; zeros for fresh rows, the null slot and slots outside the pool."""
    idx = jnp.asarray(initial_state_indices, jnp.int32)
    use = jnp.asarray(has_initial_state, bool) & _real_slots(idx, state_pool.shape[0])
    states = state_pool[jnp.where(use, idx, NULL_SLOT)].astype(jnp.float32)
    return jnp.where(use.reshape(-1, *([1] * (states.ndim - 1))), states, 0.0)


def scatter_states(state_pool, slots, states, valid=None):
    """Writes states into the pool (cast to its dtype); the null slot, slots outside the pool and invalid entries
    write nothing."""
    idx = jnp.asarray(slots, jnp.int32)
    keep = _real_slots(idx, state_pool.shape[0])
    if valid is not None:
        keep = keep & valid
    idx = jnp.where(keep, idx, state_pool.shape[0])
    return state_pool.at[idx].set(states.astype(state_pool.dtype), mode="drop")


def checkpoint_valid_mask(checkpoint_cu, num_checkpoints: int):
    return jnp.arange(num_checkpoints, dtype=jnp.int32) < jnp.asarray(checkpoint_cu, jnp.int32)[-1]


def run_split(function: Callable, token_arrays: Mapping[str, object], initial_state, cu_seqlens, checkpoint_cu,
              checkpoint_offsets, **options):
    """Split-at-checkpoint: launch j runs segment j of every row from the previous launch's final states.

    `function(**token arrays, initial_state=..., cu_seqlens=..., **options)` must return (out, final_state, _). The
    checkpoint states are the launches' final states; k checkpoints per row cost k + 1 dependent launches.
    `initial_state` is [N, ...] fp32 (zeros for fresh rows); the metadata must be concrete.
    """
    first = next(iter(token_arrays.values()))
    states = initial_state
    out = None
    checkpoint_states = None
    for launch in split_layout(cu_seqlens, checkpoint_cu, checkpoint_offsets):
        tokens = jnp.asarray(launch.token_indices)
        rows = jnp.asarray(launch.rows)
        seg_out, seg_final, _ = function(**{name: a[tokens] for name, a in token_arrays.items()},
                                         initial_state=states[rows], cu_seqlens=jnp.asarray(launch.cu_seqlens),
                                         **options)
        if out is None:
            out = jnp.zeros((first.shape[0], *seg_out.shape[1:]), seg_out.dtype)
            checkpoint_states = jnp.zeros((np.asarray(checkpoint_offsets).size, *seg_final.shape[1:]),
                                          seg_final.dtype)
        out = out.at[tokens].set(seg_out)
        states = states.at[rows].set(seg_final)
        has_ckpt = launch.checkpoint_ids >= 0
        if has_ckpt.any():
            checkpoint_states = checkpoint_states.at[jnp.asarray(launch.checkpoint_ids[has_ckpt])].set(
                seg_final[jnp.asarray(np.nonzero(has_ckpt)[0])])
    return out, states, checkpoint_states


CHECKPOINT_METHODS = ("in_chunk", "forced_break", "split")


def resolve_config(configs: Mapping[str, type], implementation: str | None, config) -> tuple[str | None, dict]:
    """(the implementation to run, the keyword options of `config`): a config runs the implementation it tunes."""
    if config is None:
        return implementation, {}
    owner = next((name for name, cls in configs.items() if type(config) is cls), None)
    if owner is None:
        expected = sorted({cls.__name__ for cls in configs.values()})
        raise ValueError(f"config: a {type(config).__name__} tunes none of this op's implementations; expected one "
                         f"of {expected} or None")
    if implementation not in (None, owner):
        raise ValueError(f"config: a {type(config).__name__} tunes {owner!r}, but implementation={implementation!r}")
    return owner, config.options()


def _named_options(function: Callable, options: Mapping[str, object]) -> dict:
    """The op's options that the implementation's signature names (e.g. the kernels take no checkpoint_method)."""
    params = inspect.signature(function).parameters
    return {name: value for name, value in options.items() if name in params}


def run(registry: Mapping[str, str], arrays: Mapping[str, object], options: Mapping[str, object], *, initial_state,
        cu_seqlens, checkpoint_cu, checkpoint_offsets, implementation: str | None, checkpoint_method: str,
        num_decodes: int, decode_step: Callable | None, state_shape: tuple[int, ...], chunk_size: int | None,
        configs: Mapping[str, type] = MappingProxyType({}), config=None):
    """One public op call on packed inputs: picks the implementation, peels off leading decode rows, runs.

    `arrays` are the per-token inputs by parameter name; `options` the op's other arguments (per-head parameters such
    as SSD's `A` included), passed on to an implementation only where its signature takes them; `chunk_size` to every
    implementation but the reference (None for an op without chunks). `config` (one of
    `configs`' classes) picks the implementation it tunes (`resolve_config`). The first `num_decodes` rows must be
    single tokens (vLLM puts decode rows first); they take `decode_step(**arrays, initial_state=..., **options)`
    instead of chunk machinery.
    """
    if checkpoint_method not in CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint_method: must be one of {CHECKPOINT_METHODS}, got {checkpoint_method!r}")
    check_call(next(iter(arrays.values())).shape[0], options, initial_state=initial_state, cu_seqlens=cu_seqlens,
               checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, num_decodes=num_decodes,
               state_shape=state_shape)
    named = implementation
    implementation, tuning = resolve_config(configs, implementation, config)
    kernel = ({} if chunk_size is None else {"chunk_size": chunk_size}) | tuning
    # all rows, decode rows included: a bound on the prefill rows the kernel gets
    # the chunked paths read "forced_break" (a chunk starts at every checkpoint); the kernels export inside their
    # fixed chunks only, so they decline it rather than run "in_chunk" in its place (the reference has no chunks)
    forced_break = checkpoint_method == "forced_break" and implementation != "reference"
    choice = choose_implementation(registry, implementation, cu_seqlens=cu_seqlens,
                                   needs={"checkpoint_method": checkpoint_method} if forced_break else {},
                                   **arrays, **kernel)
    function = choice.function
    if not choice.differentiable:
        picked = (repr(choice.name) if named else f"None picked {choice.name!r}, which" if config is None
                  else f"the {type(config).__name__} picked {choice.name!r}, which")
        advice = "implementation=\"xla\"" if config is None else "implementation=\"xla\" with an XlaConfig or no config"
        function = _not_differentiable(function, f"implementation: {picked} is not differentiable (jax.grad, jax.vjp, "
                                                f"jax.jvp, jax.linearize); pass {advice} to differentiate through "
                                                f"this op")
    first = next(iter(arrays.values()))
    cu, ccu, offsets = host_metadata(first.shape[0], cu_seqlens, checkpoint_cu, checkpoint_offsets)
    if choice.name == "reference":
        # token by token in float64: no chunks, no tuning
        return function(**arrays, **options, initial_state=initial_state, cu_seqlens=cu, checkpoint_cu=ccu,
                        checkpoint_offsets=offsets)
    if num_decodes and not is_traced(cu) and np.any(np.asarray(cu)[:num_decodes + 1] != np.arange(num_decodes + 1)):
        raise ValueError(f"num_decodes: the first {num_decodes} rows must hold one token each (decode rows first)")
    extra = {"checkpoint_method": checkpoint_method} if checkpoint_method != "split" else {}
    call = {**_named_options(choice.function, {**options, **extra}), **kernel}
    prefill_arrays = {name: a[num_decodes:] for name, a in arrays.items()}
    prefill_cu = jnp.asarray(cu)[num_decodes:] - num_decodes if num_decodes else cu
    prefill_ccu = jnp.asarray(ccu)[num_decodes:] if num_decodes else ccu
    prefill_state = None if initial_state is None else initial_state[num_decodes:]
    if num_decodes == jnp.shape(cu)[0] - 1:
        out, final, ckpt = None, None, jnp.zeros((jnp.shape(offsets)[0], *state_shape), jnp.float32)
    elif checkpoint_method == "split":
        if is_traced(cu, ccu, offsets):
            raise ValueError("checkpoint_method: 'split' plans on the host and needs concrete metadata")
        prefill_cu = np.asarray(prefill_cu)
        state0 = (jnp.zeros((prefill_cu.size - 1, *state_shape), jnp.float32) if prefill_state is None
                  else jnp.asarray(prefill_state, jnp.float32))
        out, final, ckpt = run_split(function, prefill_arrays, state0, prefill_cu, np.asarray(prefill_ccu),
                                     np.asarray(offsets), **call)
    else:
        out, final, ckpt = function(**prefill_arrays, **call, initial_state=prefill_state, cu_seqlens=prefill_cu,
                                    checkpoint_cu=prefill_ccu, checkpoint_offsets=offsets)
    if not num_decodes:
        return out, final, ckpt
    decode_arrays = {name: a[:num_decodes] for name, a in arrays.items()}
    d_out, d_final = decode_step(**decode_arrays, initial_state=None if initial_state is None
                                 else initial_state[:num_decodes], **options)
    if out is None:
        padding = first.shape[0] - num_decodes
        return jnp.pad(d_out, [(0, padding)] + [(0, 0)] * (d_out.ndim - 1)), d_final, ckpt
    return jnp.concatenate([d_out.astype(out.dtype), out]), jnp.concatenate([d_final, final]), ckpt


@jax.jit
def _write_pool(state_pool, final_slots, final_states, checkpoint_slots, checkpoint_states, checkpoint_valid):
    state_pool = scatter_states(state_pool, final_slots, final_states)
    return scatter_states(state_pool, checkpoint_slots, checkpoint_states, checkpoint_valid)


_write_pool_donated = jax.jit(_write_pool.__wrapped__, donate_argnums=0)


def run_paged(registry: Mapping[str, str], arrays: Mapping[str, object], options: Mapping[str, object], state_pool,
              *, initial_state_indices, has_initial_state, final_state_indices, checkpoint_state_indices, cu_seqlens,
              checkpoint_cu, checkpoint_offsets, donate: bool = True, **run_options):
    """`run` over a paged state pool: gathers initial states, runs, writes final and checkpoint states in place.

    The null slot is never read as a real state nor written; padded checkpoints write nothing; a bf16 pool gets the
    fp32 states cast on write. Concrete slots outside the pool raise; traced ones read as fresh states and write
    nothing (a caller's mistake can lose a state, never overwrite another's). With `donate`, the pool's buffer is
    reused for the result.
    """
    first = next(iter(arrays.values()))
    num_rows, num_checkpoints = check_call(
        first.shape[0], options, initial_state=None, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
        checkpoint_offsets=checkpoint_offsets, num_decodes=run_options["num_decodes"],
        state_shape=run_options["state_shape"])
    check_paged(state_pool, num_rows=num_rows, num_checkpoints=num_checkpoints,
                state_shape=run_options["state_shape"], initial_state_indices=initial_state_indices,
                has_initial_state=has_initial_state, final_state_indices=final_state_indices,
                checkpoint_state_indices=checkpoint_state_indices, donate=donate)
    cu, ccu, offsets = host_metadata(first.shape[0], cu_seqlens, checkpoint_cu, checkpoint_offsets)
    validate_pool_slots(state_pool.shape[0], initial_state_indices=initial_state_indices,
                        final_state_indices=final_state_indices, checkpoint_state_indices=checkpoint_state_indices,
                        checkpoint_cu=ccu)
    initial = gather_states(state_pool, initial_state_indices, has_initial_state)
    out, final, ckpt = run(registry, arrays, options, initial_state=initial, cu_seqlens=cu, checkpoint_cu=ccu,
                           checkpoint_offsets=offsets, **run_options)
    num_ckpt = ckpt.shape[0]
    slots = (jnp.zeros(num_ckpt, jnp.int32) if checkpoint_state_indices is None
             else jnp.asarray(checkpoint_state_indices, jnp.int32))
    writer = _write_pool_donated if donate else _write_pool
    pool = writer(state_pool, jnp.asarray(final_state_indices, jnp.int32), jnp.asarray(final),
                  slots, jnp.asarray(ckpt), checkpoint_valid_mask(ccu, num_ckpt))
    return out, pool
