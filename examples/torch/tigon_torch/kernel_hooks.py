"""tigon's RMSNorm behind transformers' kernel hooks.

transformers 5.x, with a compatible `kernels` package installed, marks its RMSNorm classes with
use_kernel_forward_from_hub("RMSNorm") and kernelizes a model when from_pretrained loads it and
again whenever its mode changes (model.train(), model.eval()): every marked module's forward is set
from the kernel mapping in force (the Hub's kernels) or reset to its class's forward. A forward that
a patch binds on an instance would be reset by the next model.train().

So a model patched in place (apply_tigon_to_<family>(model=model)) gets a kernel configuration whose
mapping sends its norm class's hook name to TigonRMSNorm, a stateless layer whose forward is tigon's
patched norm forward: each re-kernelization installs tigon's forward again on the modules the patch
chose (and Hugging Face's on the others), and kernels.get_kernelized_layers(model) reports them. The
configuration keeps the model's own mapping for every other hook. Classes patched before the model
is built (model=None) are tigon's subclasses; they ask kernelize to leave them alone
(kernel_condition), so the Hub's RMSNorm does not replace theirs.
"""

from __future__ import annotations

import inspect

from torch import nn
from transformers.utils.kernel_config import KernelConfig

from . import patch


class TigonRMSNorm(nn.Module):
    """The layer kernelize binds to a patched RMSNorm module: tigon's norm forward, which reads the
    family's offset, casting and fallback from the module (Hugging Face's forward where the patch did
    not choose the module)."""

    can_torch_compile = True
    has_backward = True
    forward = patch._rms_norm_forward


class TigonRepository:
    """A kernels layer repository that holds tigon_torch's layer in this process (nothing to download)."""

    layer_name = "TigonRMSNorm"

    def load(self) -> type[nn.Module]:
        return TigonRMSNorm

    def __eq__(self, other) -> bool:
        return isinstance(other, TigonRepository)

    def __hash__(self) -> int:
        return hash(TigonRepository)

    def __str__(self) -> str:
        return "tigon_torch (in process), layer `TigonRMSNorm`"

    __repr__ = __str__


REPOSITORY = TigonRepository()
DEVICES = ("cuda", "cpu")  # off a CUDA device the layer runs Hugging Face's forward


class TigonKernelConfig(KernelConfig):
    """A transformers KernelConfig whose kernel_mapping is already in the kernels package's form
    ({hook name: {device: {mode: repository}}}): nothing to validate or convert."""

    def sanitize_kernel_mapping(self, model) -> None:
        pass

    def create_compatible_mapping(self, model, compile=False) -> None:
        pass


def _modes():
    from kernels import Mode

    return (Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE, Mode.INFERENCE | Mode.TORCH_COMPILE)


def kernel_mapping(hook_names) -> dict:
    """The kernels mapping that sends each hook name to TigonRMSNorm on every device in DEVICES."""
    return {name: {device: dict.fromkeys(_modes(), REPOSITORY) for device in DEVICES} for name in hook_names}


def usable(model, norm_cls) -> bool:
    """Whether transformers re-kernelizes model's norm_cls modules on its own: the class carries a
    hook name, the model re-kernelizes on mode changes (its kernels_mode; transformers 5.0 kernelizes
    only when asked), the installed kernels package is one this transformers uses, and hub kernels are
    not switched off (USE_HUB_KERNELS)."""
    if norm_cls is None or not hasattr(norm_cls, "kernel_layer_name") or not hasattr(type(model), "kernels_mode"):
        return False
    try:
        from transformers.integrations.hub_kernels import _kernels_enabled
        from transformers.utils.import_utils import is_kernels_available
    except ImportError:
        return False
    enabled = _kernels_enabled() if callable(_kernels_enabled) else _kernels_enabled
    return bool(is_kernels_available() and enabled)


def route(model, norm_cls, set_attr) -> None:
    """Gives model a kernel configuration that maps norm_cls's hook to TigonRMSNorm, on top of the
    mapping it had (set_attr: the patch's undoable setattr)."""
    old = getattr(model, "kernel_config", None)
    mapping = dict(old.kernel_mapping) if old is not None and _compatible(old.kernel_mapping) else {}
    mapping.update(kernel_mapping((norm_cls.kernel_layer_name,)))
    flags = {"use_local_kernel": bool(getattr(old, "use_local_kernel", False)),
             "inherit_mapping": bool(getattr(old, "inherit_mapping", True))}
    taken = inspect.signature(KernelConfig.__init__).parameters
    config = TigonKernelConfig(kernel_mapping=mapping, **{k: v for k, v in flags.items() if k in taken})
    set_attr(model, "kernel_config", config)


def _compatible(mapping) -> bool:
    """Whether a KernelConfig's mapping is in the kernels package's form (transformers converts it so
    when it kernelizes with it); a mapping still in its user form is not carried over."""
    return isinstance(mapping, dict) and all(
        isinstance(v, dict) and all(isinstance(r, dict) for r in v.values()) for v in mapping.values())
