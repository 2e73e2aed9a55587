"""transformers' own ``Gemma4UnifiedImageProcessor`` and ``Gemma4UnifiedVideoProcessor``, runnable
without torchvision (see video_reference.py for the stand-in and why it is there).

``image_processing_gemma4_unified.py`` and ``video_processing_gemma4_unified.py`` import torchvision's
functional module at their top, so each module is executed with a ``torchvision.transforms.v2`` stub whose ``functional`` is the stand-in
(plus ``to_dtype``, used by the backend's RGBA conversion: torchvision 0.28's ``to_dtype_image``),
and the backend base classes get the same stand-in. Everything else is transformers' code.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import torch

from video_reference import TORCHVISION_STAND_IN, torchvision_available


def _to_dtype(image, dtype=torch.float32, scale=False):
    # torchvision.transforms.v2.functional.to_dtype_image, for the uint8 <-> float32 pairs used here.
    if image.dtype == dtype:
        return image
    if not scale:
        return image.to(dtype)
    if image.is_floating_point() and not dtype.is_floating_point:
        return image.mul(float(torch.iinfo(dtype).max) + 1.0 - 1e-3).to(dtype)
    if not image.is_floating_point() and dtype.is_floating_point:
        return image.to(dtype).mul_(1.0 / torch.iinfo(image.dtype).max)
    raise NotImplementedError(f"the stand-in converts uint8 <-> float only, not {image.dtype} -> {dtype}")


STAND_IN = types.SimpleNamespace(**vars(TORCHVISION_STAND_IN), to_dtype=_to_dtype)


def reference_image_processor_class(monkeypatch):
    """transformers' ``Gemma4UnifiedImageProcessor`` class."""
    return _load("image_processing_gemma4_unified", monkeypatch).Gemma4UnifiedImageProcessor


def reference_video_processor_class(monkeypatch):
    """transformers' ``Gemma4UnifiedVideoProcessor`` class."""
    return _load("video_processing_gemma4_unified", monkeypatch).Gemma4UnifiedVideoProcessor


def _load(module_name: str, monkeypatch):
    name = f"transformers.models.gemma4_unified.{module_name}"
    if torchvision_available():
        return importlib.import_module(name)
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as video_utils

    # The base classes look the functions up in their modules' globals, which lack them here.
    monkeypatch.setattr(backends, "tvF", STAND_IN, raising=False)
    monkeypatch.setattr(video_utils, "tvF", STAND_IN, raising=False)
    stubs = {key: types.ModuleType(key) for key in ("torchvision", "torchvision.transforms")}
    v2 = types.ModuleType("torchvision.transforms.v2")
    v2.functional = STAND_IN
    stubs["torchvision.transforms.v2"] = v2
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    saved = {key: sys.modules.get(key) for key in [*stubs, name]}
    sys.modules.update(stubs)
    sys.modules[name] = module  # its docstring decorator inspects the class's source file
    try:
        spec.loader.exec_module(module)
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    return module
