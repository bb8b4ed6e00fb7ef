"""The tuning of each implementation as one frozen, typed config: what a call may set beside its inputs.

`config=` on a public op entry takes one of these; its class names the implementation it tunes, so the call runs
that implementation (with `implementation=None`) or raises if another one is named. Left out, each implementation
runs its defaults: every field's default below, where None means "from the shapes" as the field says. A config is
checked once, when it is built: a value outside a field's range raises a ValueError naming the field; what depends on
the inputs (tile sizes against K and V, the device) is each backend's `supports`. Configs are hashable, so they are
static arguments of the jitted entries. The measurements behind the defaults are in bench/README.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

# the Mosaic GPU kernels' sequence split: the piece scan is unrolled, and N * pieces lanes sit on one grid axis
MAX_MOSAIC_PIECES = 64
MAX_SSD_PIECES = 64


def _choice(config, name: str, allowed: tuple) -> None:
    value = getattr(config, name)
    # bool is an int: True must not pass for 1
    if isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed) or value not in allowed:
        raise ValueError(f"{name}: must be one of {allowed}, got {value!r}")


def _positive_int(config, name: str, *, optional: bool = False, power_of_two: bool = False,
                  bounds: tuple[int, int] | None = None) -> None:
    value = getattr(config, name)
    if value is None and optional:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    ok = ok and (not power_of_two or value & (value - 1) == 0)
    ok = ok and (bounds is None or bounds[0] <= value <= bounds[1])
    if not ok:
        rule = "a power of two" if power_of_two else "a positive int"
        rule += f" in [{bounds[0]}, {bounds[1]}]" if bounds else ""
        raise ValueError(f"{name}: must be {rule}{' or None' if optional else ''}, got {value!r}")


def _bool(config, name: str) -> None:
    if not isinstance(getattr(config, name), bool):
        raise ValueError(f"{name}: must be a bool, got {getattr(config, name)!r}")


def _interpret(config) -> None:
    """Mosaic GPU kernels take a bool or the interpreter's own settings (`plgpu.InterpretGPUParams`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    value = config.interpret
    if not isinstance(value, (bool, plgpu.InterpretGPUParams)):
        raise ValueError(f"interpret: must be a bool or a plgpu.InterpretGPUParams, got {value!r}")


def _pieces(config, name: str, most: int) -> None:
    value = getattr(config, name)
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most):
        raise ValueError(f"{name}: must be an int in [1, {most}] or 'auto', got {value!r}")


class Config:
    """What every config shares: the implementation it tunes and its fields as keyword options."""

    implementation: ClassVar[str]

    def options(self) -> dict[str, Any]:
        """The keyword options the implementation's function takes (fields left None keep its defaults)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaConfig(Config):
    """The portable path (GDN, KDA, SSD; differentiable).

    state_pass: how the chunks' states are chained, "associative" (a parallel scan over the chunks' affine maps: the
    default, log-depth in the chunk count) or "sequential" (a loop over the chunks: less memory, no parallelism).
    """

    implementation: ClassVar[str] = "xla"
    state_pass: str = "associative"

    def __post_init__(self):
        _choice(self, "state_pass", ("associative", "sequential"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeltaPallasTritonConfig(Config):
    """The Pallas Triton kernels of GDN and KDA (any NVIDIA GPU; fp32 inputs on Hopper).

    interpret: run the kernels in the Pallas interpreter (CPU). num_warps, num_stages: the state and output
    launches. intra_num_warps: the gate cumsum and intra launches. block_v / output_block_v: the V tile of the state
    / output launches (None: min(V, 64)). fuse_output: the state pass writes O itself (three launches instead of
    four). kda_block_k: KDA's intra column block (None: min(K, V, 32)).
    """

    implementation: ClassVar[str] = "pallas_triton"
    interpret: bool = False
    num_warps: int = 4
    num_stages: int = 2
    intra_num_warps: int = 4
    block_v: int | None = None
    output_block_v: int | None = None
    fuse_output: bool = False
    kda_block_k: int | None = None

    def __post_init__(self):
        _bool(self, "interpret")
        _bool(self, "fuse_output")
        for name in ("num_warps", "intra_num_warps"):
            _positive_int(self, name, power_of_two=True, bounds=(1, 16))
        _positive_int(self, "num_stages", bounds=(1, 8))
        for name in ("block_v", "output_block_v", "kda_block_k"):
            _positive_int(self, name, optional=True, power_of_two=True, bounds=(16, 256))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeltaPallasMosaicGpuConfig(Config):
    """The Pallas Mosaic GPU kernels of GDN and KDA (Hopper, 16-bit q, k, v; what `implementation=None` runs there).

    interpret: True, or a `plgpu.InterpretGPUParams` (e.g. detect_races=True), runs the kernels on CPU.
    state: the state pass, "v2" (the lanes kernel fed by the intra pass: the default, fastest on the H200) or, GDN
    only, "fused" (forms W, U and O inside the state loop: states about 50x more accurate against float64, 1.2-2x
    slower). pieces: each row cut into this many pieces run in parallel and joined exactly by their state maps, or
    "auto" (1 unless the plain pass leaves most SMs idle). state_terms: the state chain's products fed as one 16-bit
    term each (1, FLA's and jla's precision, the default) or as hi + lo pairs (2: states ~1e-6 from float64 instead
    of the ~2e-3 class, 17-19% more device time for GDN at one row). intra_inverse: the intra pass's (I + A)^-1,
    "blocked", "split" or "f16" (None: the kernel's default, "blocked"). kda_score_parts: KDA's score operands as one
    fp16 term (1, the default) or hi + lo pairs (2). intra_num_warps, num_stages: the gate cumsum launch.
    """

    implementation: ClassVar[str] = "pallas_mosaic_gpu"
    interpret: Any = False
    state: str = "v2"
    pieces: int | str = "auto"
    state_terms: int = 1
    intra_inverse: str | None = None
    kda_score_parts: int | None = None
    intra_num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        _interpret(self)
        _choice(self, "state", ("v2", "fused"))
        _pieces(self, "pieces", MAX_MOSAIC_PIECES)
        _choice(self, "state_terms", (1, 2))
        if self.intra_inverse is not None:
            _choice(self, "intra_inverse", ("blocked", "split", "f16"))
        if self.kda_score_parts is not None:
            _choice(self, "kda_score_parts", (1, 2))
        if self.state == "fused" and (self.intra_inverse is not None or self.kda_score_parts is not None):
            raise ValueError("state: 'fused' replaces the intra pass, so intra_inverse and kda_score_parts must be "
                             "None with it")
        _positive_int(self, "intra_num_warps", power_of_two=True, bounds=(1, 16))
        _positive_int(self, "num_stages", bounds=(1, 8))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SsdPallasTritonConfig(Config):
    """The Pallas Triton kernels of SSD. interpret: the Pallas interpreter (CPU); num_warps, num_stages: every launch;
    state_block_p: the P tile of the state launch (capped at P)."""

    implementation: ClassVar[str] = "pallas_triton"
    interpret: bool = False
    num_warps: int = 4
    num_stages: int = 2
    state_block_p: int = 16

    def __post_init__(self):
        _bool(self, "interpret")
        _positive_int(self, "num_warps", power_of_two=True, bounds=(1, 16))
        _positive_int(self, "num_stages", bounds=(1, 8))
        _positive_int(self, "state_block_p", power_of_two=True, bounds=(1, 256))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SsdPallasMosaicGpuConfig(Config):
    """The Pallas Mosaic GPU kernel of SSD (Hopper, 16-bit inputs). interpret: True or a `plgpu.InterpretGPUParams`
    runs it on CPU; pieces: the sequence split, an int in [1, 64] or "auto"; stages: the TMA ring depth (2, 3 or 4;
    None: as many as the shared memory holds)."""

    implementation: ClassVar[str] = "pallas_mosaic_gpu"
    interpret: Any = False
    pieces: int | str = "auto"
    stages: int | None = None

    def __post_init__(self):
        _interpret(self)
        _pieces(self, "pieces", MAX_SSD_PIECES)
        if self.stages is not None:
            _choice(self, "stages", (2, 3, 4))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceParallelConfig(Config):
    """GDN and KDA with long rows cut into pieces run in parallel and joined by their affine state maps (named only:
    `implementation=None` never picks it). base: the kernels that run the pieces, "pallas_triton", "xla" or None
    (Pallas where it takes the widened call, else XLA); base_config: that base's config (its class sets the base
    when base is None). piece_len: tokens per piece (None: from the shapes, or the plain base call where pieces do
    not pay); target_programs, min_piece_len: that choice's targets. piece_cuts: where pieces end ("checkpoints",
    "snap", "grid"); compose: how piece maps chain ("associative", "sequential"); correction: the pass that applies
    the composed states ("pallas", "xla"; None: Pallas with the Pallas base). interpret: Pallas on CPU.
    """

    implementation: ClassVar[str] = "sequence_parallel"
    base: str | None = None
    base_config: XlaConfig | DeltaPallasTritonConfig | None = None
    piece_len: int | None = None
    target_programs: int | None = None
    min_piece_len: int | None = None
    piece_cuts: str = "checkpoints"
    compose: str = "associative"
    correction: str | None = None
    interpret: bool = False

    def __post_init__(self):
        if self.base is not None:
            _choice(self, "base", ("pallas_triton", "xla"))
        if self.base_config is not None:
            if not isinstance(self.base_config, (XlaConfig, DeltaPallasTritonConfig)):
                raise ValueError(f"base_config: must be an XlaConfig or a DeltaPallasTritonConfig, got "
                                 f"{type(self.base_config).__name__}")
            if self.base not in (None, self.base_config.implementation):
                raise ValueError(f"base_config: a {type(self.base_config).__name__} tunes "
                                 f"{self.base_config.implementation!r}, but base={self.base!r}")
            if getattr(self.base_config, "interpret", False) and not self.interpret:
                raise ValueError("base_config: set interpret on the SequenceParallelConfig, which passes it on")
        for name in ("piece_len", "target_programs", "min_piece_len"):
            _positive_int(self, name, optional=True)
        _choice(self, "piece_cuts", ("checkpoints", "snap", "grid"))
        _choice(self, "compose", ("associative", "sequential"))
        if self.correction is not None:
            _choice(self, "correction", ("pallas", "xla"))
        _bool(self, "interpret")

    def options(self) -> dict[str, Any]:
        own = {name: value for name, value in super().options().items() if name != "base_config"}
        if self.base_config is None:
            return own
        base = {name: value for name, value in self.base_config.options().items() if name != "interpret"}
        return {**own, "base": self.base or self.base_config.implementation, **base}


DELTA_CONFIGS = {"xla": XlaConfig, "pallas_triton": DeltaPallasTritonConfig,
                 "pallas_mosaic_gpu": DeltaPallasMosaicGpuConfig, "sequence_parallel": SequenceParallelConfig}
SSD_CONFIGS = {"xla": XlaConfig, "pallas_triton": SsdPallasTritonConfig, "pallas_mosaic_gpu": SsdPallasMosaicGpuConfig}
