from .gemma import Gemma
from .text import TextModel

__all__ = ["Gemma", "TextModel"]
