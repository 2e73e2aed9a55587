"""timm's MobileNet-V5 (Gemma 3n's vision tower), importable without torchvision, and transformers'
Gemma 3n built with it.

transformers builds Gemma 3n's vision tower through timm (``TimmWrapperModel`` ->
``timm.create_model("mobilenetv5_300m_enc")``). timm imports torchvision at import time, and
torchvision has no CPU build next to this repository's torch (nor may one be installed: its wheels pull
another torch). MobileNet-V5 calls no torchvision function: timm only imports these names (data
transforms, datasets, a frozen batch norm, FX feature extraction), at its import. So timm is imported
once with a stand-in ``torchvision`` in ``sys.modules``: ``InterpolationMode`` (an enum, used by
timm's data module at import), and a placeholder class for every other name, which raises if it is ever
built or called. The stand-in is removed from ``sys.modules`` as soon as timm is imported, so that
nothing else (transformers' ``is_torchvision_available``, the video stand-in of video_reference.py)
sees a torchvision.

timm is not a dependency of torchgemma: it is installed with ``pip install --no-deps timm`` (its own
dependencies would pull torchvision); without it these tests skip, saying so.

``reference_gemma3n`` lets transformers build its real ``TimmWrapperModel`` around that timm:
transformers gates timm on torchvision being importable (``is_timm_available``), so only that gate is
lifted, in the wrapper's module, while the model is built. The wrapper's forward, the model's
``get_image_features`` and everything after are transformers' code as it ships.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import types

import pytest

# torchvision.transforms.InterpolationMode (timm's data module maps its members at import): the video
# tests' stand-in has it already.
from video_reference import InterpolationMode


def _placeholder(module: str, name: str) -> type:
    """A class standing for ``module.name``: subclassable (timm subclasses ``transforms.ToTensor``),
    never usable."""

    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"{module}.{name} is not part of the torchvision stand-in (timm_reference.py)"
        )

    return type(name, (), {"__init__": refuse, "__call__": refuse, "__module__": module})


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


STAND_IN_MODULES = (
    "torchvision",
    "torchvision.datasets",
    "torchvision.models",
    "torchvision.models.feature_extraction",
    "torchvision.ops",
    "torchvision.ops.misc",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.utils",
)


def timm_available() -> bool:
    return importlib.util.find_spec("timm") is not None


def import_timm():
    """``timm``, imported with the torchvision stand-in when torchvision is missing (see above)."""
    if not timm_available():
        pytest.skip("timm is not installed (pip install --no-deps timm): the MobileNet-V5 reference")
    if "timm" in sys.modules:
        return sys.modules["timm"]
    if importlib.util.find_spec("torchvision") is not None:
        import timm

        return timm
    stand_ins = {name: _StandIn(name) for name in STAND_IN_MODULES}
    for name, module in stand_ins.items():
        module.__path__ = []  # a package, so that its submodules import
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(stand_ins[parent], child, module)
    stand_ins["torchvision.transforms"].InterpolationMode = InterpolationMode
    stand_ins["torchvision.transforms.functional"].InterpolationMode = InterpolationMode
    sys.modules.update(stand_ins)
    try:
        import timm
    finally:
        for name in STAND_IN_MODULES:
            sys.modules.pop(name, None)
    return timm


def mobilenetv5(architecture: str = "mobilenetv5_300m_enc", **model_args):
    """timm's MobileNet-V5 encoder, as transformers' ``TimmWrapperModel`` creates it (no classifier)."""
    timm = import_timm()
    model_args = copy.deepcopy(model_args)  # timm edits block_args in place
    return timm.create_model(architecture, pretrained=False, num_classes=0, **model_args).eval()


@contextlib.contextmanager
def timm_in_transformers():
    """transformers builds its ``TimmWrapperModel`` (Gemma 3n's vision tower) on the timm imported
    here: the wrapper module's gate on torchvision is lifted while the block runs."""
    timm = import_timm()
    from transformers.models.timm_wrapper import modeling_timm_wrapper as wrapper

    saved = {name: getattr(wrapper, name, None) for name in ("timm", "requires_backends")}

    def create_model(*args, **kwargs):
        # timm edits its block_args argument in place, and transformers passes its config's own
        # model_args: a copy keeps the config as it is saved.
        return timm.create_model(*args, **copy.deepcopy(kwargs))

    wrapper.timm = types.SimpleNamespace(create_model=create_model, __version__=timm.__version__)
    wrapper.requires_backends = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(wrapper, name)
            else:
                setattr(wrapper, name, value)
