"""C++ CPU operators (torchgemma::*), their fakes and pure-PyTorch references."""

from .ops import *  # noqa: F403
from .ops import (  # noqa: F401
    _dequantize_reference,
    _qlinear_int_reference,
    ensure_kernels,
    features_of,
    int_span,
    kernel_status,
    pack,
    packed_width,
    round_to_ints,
    unpack,
    vnni_available,
)
