"""Speed as transforms of a built model; the model file stays plain.

    model = torchgemma.compile(torchgemma.load(...))        # a compiled static-shape decode step
    model = torchgemma.fuse_cpu_ops(torchgemma.load(...))   # norms, RoPE, decode attention in C++

``compiled``: the decode step traced once by ``torch.compile`` (CUDA graphs on CUDA).
``cpu_fusions``: the text decoder's small operators as single C++ calls on float32 CPU tensors;
quantized CPU models get them when quantized or loaded, any other model on request.
"""

from .compiled import CompiledDecode, compile, decode_step
from .cpu_fusions import fuse_cpu_ops

__all__ = ["CompiledDecode", "compile", "decode_step", "fuse_cpu_ops"]
