from .audio import AudioTower
from .gemma import Gemma
from .text import TextModel
from .vision import VisionTower

__all__ = ["AudioTower", "Gemma", "TextModel", "VisionTower"]
