"""Mamba2 mixer (mamba_ssm `modules/mamba2.py`, rmsnorm=True): in_proj, causal conv over xBC, SSD scan, gated
RMSNorm, out_proj; over packed rows with paged conv and SSM state pools."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.layers.common import Linear, PagedRunner, PlainRunner, ShortConv, a_log_init, dt_bias_init
from jaxckpt.layers.metadata import StepMetadata
from jaxckpt.layers.norm import GatedRMSNorm


class Mamba2Mixer(nnx.Module):
    """Mamba2 mixer; parameter names and shapes as the public Mamba2 checkpoints (`mixer.` prefix dropped).

    in_proj.weight   [2 * d_ssm + 2 * G * N + H, d_model]  -> [z (d_ssm) | xBC (d_ssm + 2GN) | dt (H)]
    conv1d.weight    [conv_dim, W] (torch [conv_dim, 1, W] loads too), conv1d.bias [conv_dim]; conv_dim = d_ssm + 2GN
    dt_bias, A_log, D [H]; norm.weight [d_ssm]; out_proj.weight [d_model, d_ssm]
    State per slot: conv window [conv_dim, W - 1] and SSM state [H, P, N] ("vk", mamba_ssm's layout), fp32.
    """

    def __init__(self, d_model: int, *, num_heads: int, head_dim: int, d_state: int, n_groups: int = 1,
                 conv_width: int = 4, norm_eps: float = 1e-5, chunk_size: int = 64, dtype=jnp.float32,
                 implementation: str | None = None, rngs: nnx.Rngs):
        if num_heads % n_groups:
            raise ValueError(f"n_groups: must divide num_heads={num_heads}, got {n_groups}")
        self.num_heads, self.head_dim, self.d_state, self.n_groups = num_heads, head_dim, d_state, n_groups
        self.d_ssm = num_heads * head_dim
        self.conv_dim = self.d_ssm + 2 * n_groups * d_state
        self.conv_width = conv_width
        self.chunk_size = chunk_size
        self.implementation = implementation
        self.in_proj = Linear(d_model, self.d_ssm + self.conv_dim + num_heads, dtype=dtype, rngs=rngs)
        self.conv1d = ShortConv(self.conv_dim, conv_width, bias=True, dtype=dtype, rngs=rngs)
        self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), (num_heads,)))
        self.A_log = nnx.Param(a_log_init(rngs.params(), (num_heads,)))
        self.D = nnx.Param(jnp.ones(num_heads))
        self.norm = GatedRMSNorm(self.d_ssm, eps=norm_eps, gate="silu", norm_before_gate=False,
                                 group_size=self.d_ssm // n_groups, dtype=dtype)
        self.out_proj = Linear(self.d_ssm, d_model, dtype=dtype, rngs=rngs)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of (conv_pool, recurrent_pool): ([conv_dim, W - 1], [H, P, N])."""
        return (self.conv_dim, self.conv_width - 1), (self.num_heads, self.head_dim, self.d_state)

    def get_prefill_checkpoint_alignment(self) -> int:
        return 1

    def _mix(self, x, runner):  # [T, d_model] -> [T, d_model]
        num_tokens = x.shape[0]
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.d_state
        z, xbc, dt = jnp.split(self.in_proj(x), [self.d_ssm, self.d_ssm + self.conv_dim], axis=-1)
        xbc = runner.conv(xbc, self.conv1d.weight[...], self.conv1d.bias[...])  # [T, conv_dim]
        xs, B, C = jnp.split(xbc, [self.d_ssm, self.d_ssm + G * N], axis=-1)
        y = runner.scan(xs.reshape(num_tokens, H, P), dt.astype(jnp.float32), -jnp.exp(self.A_log[...]),
                        B.reshape(num_tokens, G, N), C.reshape(num_tokens, G, N), D=self.D[...],
                        dt_bias=self.dt_bias[...], state_layout="vk")  # [T, H, P]
        y = self.norm(y.reshape(num_tokens, self.d_ssm).astype(x.dtype), z)
        return self.out_proj(y)

    @jax.named_scope("mamba2_mixer")
    def __call__(self, x, meta: StepMetadata, pools):
        """x [T, d_model] packed rows; pools (conv_pool [S, conv_dim, W - 1], ssm_pool [S, H, P, N]).

        Returns (out [T, d_model], (conv_pool, ssm_pool)) with final and checkpoint states written.
        """
        from jaxckpt.ops import ssd_paged

        runner = PagedRunner(meta, pools, ssd_paged, implementation=self.implementation, chunk_size=self.chunk_size)
        return self._mix(x, runner), runner.pools

    def reference(self, x, *, implementation: str | None = "reference"):
        """One whole sequence x [T, d_model] from a zero state, no pools (float64 ops by default)."""
        from jaxckpt.ops import ssd

        return self._mix(x, PlainRunner(ssd, implementation=implementation, chunk_size=self.chunk_size))
