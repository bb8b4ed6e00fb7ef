"""torch_bridge as a vLLM general plugin: vLLM 0.33's checkpoint fields derived in `MambaBase`, not declared per layer.

With `JAXCKPT_VLLM_PLUGIN=1`, `register` (the `vllm.general_plugins` entry point, run by vLLM in every process)
installs the patch; without it, nothing changes. The patch:

- gives the six layer classes that opt into prefill checkpoints in vLLM 0.33 `get_prefill_checkpoint_alignment`,
  from the functions of `torch_bridge.spec`, and removes their `get_kv_cache_spec` overrides;
- makes `MambaBase.get_kv_cache_spec` fill `num_prefill_checkpoint_blocks` and `prefill_checkpoint_alignment` only
  when every Mamba layer of the model declares an alignment (vLLM's own base spec otherwise);
- moves Kimi-K3 ROCm KDA's "prefill checkpoint enabled" log to the layer's construction.

Layer modules are patched when vLLM imports them (an import hook), so the plugin imports no model code itself.
Importing this module imports neither vLLM nor torch. README.md says what it changes and what it leaves alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import logging
import os
import sys
import threading

from jaxckpt.plan.rules import model_checkpoint_alignment
from torch_bridge import spec

ENV_VAR = "JAXCKPT_VLLM_PLUGIN"
SUPPORTED_VERSION_PREFIX = "0.33."
ABSTRACT_MODULE = "vllm.model_executor.layers.mamba.abstract"

# Under vLLM's logger, so its handler prints the line.
logger = logging.getLogger("vllm.torch_bridge")


def _mamba2(layer) -> int | None:
    return spec.mamba2_alignment()


def _qwen_gdn(layer) -> int | None:
    return spec.flashinfer_gdn_alignment(gdn_prefill_backend=layer.gdn_prefill_backend,
                                         mamba_cache_mode=layer.vllm_config.cache_config.mamba_cache_mode)


def _ple_short_conv(layer) -> int | None:
    return spec.short_conv_alignment(mamba_cache_mode=layer.cache_config.mamba_cache_mode)


def _flashkda(layer) -> int | None:
    return spec.flashkda_alignment(kda_prefill_backend=layer.kda_prefill_backend)


def _rocm_fused_kda(layer) -> int | None:
    return spec.rocm_fused_kda_alignment(kda_prefill_backend=layer.kda_prefill_backend,
                                         use_safe_gate=layer.use_safe_gate, num_speculative_tokens=None,
                                         use_prefill_checkpoint=layer.use_prefill_checkpoint)


# (module, class, alignment, publishes the prefix-cache grid): vLLM 0.33's FlashInfer GDN sizes its checkpoint
# buffer by the grid and its PLE short conv follows it, so their specs carry the grid; the others carry the LCM.
LAYERS = (
    ("vllm.model_executor.layers.mamba.mamba_mixer2", "MambaMixer2", _mamba2, False),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention", _qwen_gdn, True),
    ("vllm.models.qwen4_exp.nvidia.ple_layer", "Qwen4ExpPLELayer", _ple_short_conv, True),
    ("vllm.models.kimi_k3.nvidia.kda", "KimiK3DeltaAttention", _flashkda, False),
    ("vllm.models.kimi_k3.amd.kda", "KimiK3DeltaAttention", _rocm_fused_kda, False),
    ("vllm.models.glm5next.common.kda", "Glm5NextLinearAttention", _flashkda, False),
)
ROCM_KDA_MODULE = "vllm.models.kimi_k3.amd.kda"

_lock = threading.RLock()
_state: dict = {"installed": False, "saved": [], "grid_classes": [], "finder": None}


def enabled() -> bool:
    """Whether `JAXCKPT_VLLM_PLUGIN` asks for the patch ("1"); "0" or unset: no. Any other value raises."""
    value = os.environ.get(ENV_VAR, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_VAR}: must be 1 (install the checkpoint-spec patch) or 0 / unset, got {value!r}")
    return value == "1"


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: installs the patch when `JAXCKPT_VLLM_PLUGIN=1`."""
    if enabled():
        install()


def is_installed() -> bool:
    return _state["installed"]


def install() -> bool:
    """Patch vLLM (idempotent). Returns False, with a warning and nothing changed, on a vLLM other than 0.33.x."""
    with _lock:
        if _state["installed"]:
            return True
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        if not version.startswith(SUPPORTED_VERSION_PREFIX):
            logger.warning("torch_bridge vLLM plugin: written for vLLM %sx, found %s; not patching anything",
                           SUPPORTED_VERSION_PREFIX, version)
            return False
        _state["installed"] = True
        finder = _PatchOnImport()
        _state["finder"] = finder
        for name in {ABSTRACT_MODULE, *(entry[0] for entry in LAYERS)}:
            if name in sys.modules:
                _patch_module(sys.modules[name])
        sys.meta_path.insert(0, finder)
        logger.info("torch_bridge vLLM plugin: MambaBase.get_kv_cache_spec derives the prefill checkpoint fields "
                    "from get_prefill_checkpoint_alignment (all Mamba layers or none); hooks set and overrides "
                    "removed on MambaMixer2, QwenGatedDeltaNetAttention, Qwen4ExpPLELayer, Kimi-K3 KDA (NVIDIA, "
                    "ROCm), Glm5NextLinearAttention (vLLM %s)", version)
        return True


def uninstall() -> None:
    """Undo `install`: every patched attribute back as it was, the import hook removed."""
    with _lock:
        if not _state["installed"]:
            return
        if _state["finder"] in sys.meta_path:
            sys.meta_path.remove(_state["finder"])
        for owner, name, had, value in reversed(_state["saved"]):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        _state.update(installed=False, saved=[], grid_classes=[], finder=None)


@contextlib.contextmanager
def installed():
    """The patch for the duration of a `with` block (tests compare vLLM with and without it in one process)."""
    was = is_installed()
    if not install():
        raise RuntimeError("torch_bridge vLLM plugin: this vLLM is not 0.33.x; the patch was not installed")
    try:
        yield
    finally:
        if not was:
            uninstall()


def _set(owner, name, value) -> None:
    had = name in owner.__dict__
    _state["saved"].append((owner, name, had, owner.__dict__.get(name)))
    setattr(owner, name, value)


def _remove(owner, name) -> None:
    if name in owner.__dict__:
        _state["saved"].append((owner, name, True, owner.__dict__[name]))
        delattr(owner, name)


def _patch_module(module) -> None:
    with _lock:
        if not _state["installed"]:
            return
        if module.__name__ == ABSTRACT_MODULE:
            _patch_base(module)
        for module_name, class_name, alignment, publishes_grid in LAYERS:
            if module.__name__ != module_name:
                continue
            cls = getattr(module, class_name)
            _set(cls, "get_prefill_checkpoint_alignment", alignment)
            _remove(cls, "get_kv_cache_spec")
            if publishes_grid:
                _state["grid_classes"].append(cls)
            if module_name == ROCM_KDA_MODULE:
                _set(cls, "__init__", _log_rocm_checkpoints(cls.__init__, module.logger))


def _patch_base(abstract) -> None:
    base = abstract.MambaBase
    vllm_base_spec = base.__dict__["get_kv_cache_spec"]

    def get_kv_cache_spec(self, vllm_config):
        kv_spec = vllm_base_spec(self, vllm_config)
        # Duck-typed layers (a SimpleNamespace with the state methods) have no hook: no checkpoint.
        hook = getattr(self, "get_prefill_checkpoint_alignment", None)
        if hook is None or hook() is None or not isinstance(kv_spec, abstract.MambaSpec):
            return kv_spec
        layers = list(abstract.get_layers_from_vllm_config(vllm_config, base).values())
        alignment = model_checkpoint_alignment(
            getattr(layer, "get_prefill_checkpoint_alignment", lambda: None)() for layer in layers)
        if alignment is None:
            return kv_spec
        grid_classes = tuple(_state["grid_classes"])
        if grid_classes and any(isinstance(layer, grid_classes) for layer in layers):
            cache = vllm_config.cache_config
            alignment = spec.vllm_published_alignment(alignment, prefix_match_unit=cache.prefix_match_unit,
                                                      block_size=cache.mamba_block_size)
        return dataclasses.replace(kv_spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=alignment)

    get_kv_cache_spec.__doc__ = ("vLLM's base spec; with both checkpoint fields when every Mamba layer of the model "
                                 "declares get_prefill_checkpoint_alignment (torch_bridge vLLM plugin).")
    _set(base, "get_kv_cache_spec", get_kv_cache_spec)


def _log_rocm_checkpoints(init, module_logger):
    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        init(self, config, vllm_config, prefix)
        if self.get_prefill_checkpoint_alignment() is not None \
                and vllm_config.cache_config.mamba_cache_mode == "align":
            module_logger.info_once("Kimi-K3 KDA prefill checkpoint enabled.")

    return __init__


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a target module right after vLLM imports it, so the plugin never imports model code itself."""

    def find_spec(self, fullname, path, target=None):
        if fullname != ABSTRACT_MODULE and all(fullname != entry[0] for entry in LAYERS):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            module_spec = finder.find_spec(fullname, path, target)
            if module_spec is not None:
                break
        else:
            return None
        loader = module_spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return module_spec
        module_spec.loader = _PatchingLoader(loader)
        return module_spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, module_spec):
        return self.loader.create_module(module_spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader
        _patch_module(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)
