"""The ``torchgemma::*`` operators: one table of schemas, fakes and pure-PyTorch references
(``ops.py``), and the C++ CPU kernels behind them (``csrc/``), built into one library with a
portable, an AVX2 and an AVX-512 variant of every kernel (``build.py``: at ``pip install``, else once
at first use) and dispatched at run time on the CPU's features (``library.py``; ``$TORCHGEMMA_ISA``
overrides the choice).
"""

from .library import (
    ISAS,
    available_isas,
    ensure_kernels,
    isa,
    kernel_status,
    set_isa,
    using_isa,
    vnni_available,
)
from .ops import (
    OPERATORS,
    Operator,
    features_of,
    int_span,
    pack,
    packed_width,
    round_to_ints,
    unpack,
)
from .ops import (
    _dequantize_reference as _dequantize_reference,  # the quantized modules' and tests' reference
)
from .ops import (
    _qlinear_int_reference as _qlinear_int_reference,
)

__all__ = [
    "ISAS",
    "OPERATORS",
    "Operator",
    "available_isas",
    "ensure_kernels",
    "features_of",
    "int_span",
    "isa",
    "kernel_status",
    "pack",
    "packed_width",
    "round_to_ints",
    "set_isa",
    "unpack",
    "using_isa",
    "vnni_available",
]
