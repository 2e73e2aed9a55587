"""The CPU fusions (``torchgemma.acceleration.cpu_fusions``): each fused operator against the one it
replaces, and a float model with the fusions against the same model without them."""

from __future__ import annotations

import pytest
import torch

import torchgemma
from checkpoints import padded_batch
from torchgemma import kernels
from torchgemma.acceleration import cpu_fusions
from torchgemma.acceleration.cpu_fusions import FUSED_ATTENTION, FusedRMSNorm, fuse_cpu_ops, fused_rope
from torchgemma.model.attention import ATTENTION
from torchgemma.model.layers import RMSNorm, apply_rope
from torchgemma.model.text import Attention

pytestmark = pytest.mark.usefixtures("one_thread")

decode = torch.ops.torchgemma.decode_attention.default


@pytest.fixture(autouse=True)
def _kernels():
    if not kernels.ensure_kernels():
        pytest.skip(kernels.kernel_status())


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Hidden-state-like rows: mostly small values, a few large ones."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, torch.randint(0, k, (3,), generator=gen)] *= 300
    return x


# ── the fused operators ────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(("plus_one", "with_scale"), [(True, True), (False, True), (False, False)])
def test_fused_rms_norm_is_the_reference_to_rounding(plus_one, with_scale):
    """One C++ call = RMSNorm's dozen operators to a float32 rounding (not to the bit: the mean is
    summed in another order), for every variant: Gemma 3's 1 + w, Gemma 4's w, no scale."""
    from torchgemma.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    reference = RMSNorm(640, 1e-6, with_scale=with_scale, plus_one=plus_one)
    if with_scale:
        reference.weight.data = torch.randn(640, generator=gen) * 0.3
    fused = FusedRMSNorm.replacing(reference)
    x = _activations(12, 640, seed=4).view(2, 3, 2, 640).transpose(1, 2)  # not contiguous
    ours, theirs = fused(x), reference(x)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert ((ours - theirs).abs() <= 4e-7 * theirs.abs().amax(-1, keepdim=True)).all()
    assert torch.equal(fused(x.bfloat16()), reference(x.bfloat16()))  # other dtypes: the reference


def test_fused_rope_is_apply_rope_to_the_bit():
    """One C++ call = apply_rope's operators to the bit (float32 CPU), on a non-contiguous input with
    several rows, tokens and heads; other dtypes take apply_rope itself."""
    from torchgemma.model.layers import apply_rope, rope_cos_sin

    gen = torch.Generator().manual_seed(2)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 256, 2).float() / 256)
    positions = torch.tensor([[0, 1, 2, 7, 4095], [9, 10, 11, 12, 13]])
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
    x = torch.randn(2, 4, 5, 256, generator=gen).transpose(1, 2) * 3  # (B, T, H, D), not contiguous
    assert torch.equal(fused_rope(x, cos, sin), apply_rope(x, cos, sin))
    half = [t.bfloat16() for t in (x, cos, sin)]
    assert torch.equal(fused_rope(*half), apply_rope(*half))


def _run(model, ids, mask) -> torch.Tensor:
    """Logits of a padded prefill, then of five cached decode steps of the first row (B, 17 + 5, V)."""
    with torch.no_grad():
        prefill = model(ids, attention_mask=mask)
        cache = model.make_cache(1, 24)
        steps = [model(ids[:1, :12], cache=cache)]
        steps += [model(ids[:1, t : t + 1], cache=cache) for t in range(12, 17)]
    return torch.cat((prefill[:1], torch.cat(steps, 1)), 1)


@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_a_float32_model_with_the_fusions_gives_its_logits(text_checkpoints, style, monkeypatch):
    """fuse_cpu_ops on a float32 model (not quantized): every text-decoder norm, rotation and backend
    swapped, the state dict the same names and storage; logits through prefill and cached decode steps equal
    the unfused model's to float32 rounding (the fused norm and decode attention promise that, not
    the bits), and to the bit with the fused RoPE alone (which promises the bits)."""
    folder = text_checkpoints[style]
    plain = torchgemma.load(folder, dtype=torch.float32)
    assert FusedRMSNorm not in {type(m) for m in plain.modules()}  # float models: only on request
    ids, mask = padded_batch(seed=3)
    expected = _run(plain, ids, mask)

    rope_only = torchgemma.load(folder, dtype=torch.float32)
    for module in rope_only.language_model.modules():
        if isinstance(module, Attention):
            module.rope = fused_rope
    assert torch.equal(_run(rope_only, ids, mask), expected)

    model = torchgemma.load(folder, dtype=torch.float32)
    before = model.state_dict()
    assert torchgemma.fuse_cpu_ops(model) is model
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k].data_ptr() == before[k].data_ptr() for k in before)
    norms = [type(m) for m in model.language_model.modules() if isinstance(m, RMSNorm)]
    assert norms and set(norms) == {FusedRMSNorm}
    attention = [m for m in model.language_model.modules() if isinstance(m, Attention)]
    assert all(m.rope is fused_rope and m.backends is FUSED_ATTENTION for m in attention)
    assert not model.training
    calls = []
    monkeypatch.setattr(cpu_fusions, "_DECODE_ATTENTION", lambda *args: calls.append(1) or decode(*args))
    fused = _run(model, ids, mask)
    assert calls  # the decode steps' full layers took the one-call attention
    # Measured: 5.8e-7 of the largest logit (e2b, e4b), 3.6e-7 (26b, 31b).
    assert (fused - expected).abs().max() <= 4e-6 * expected.abs().max()


def test_the_fusions_leave_other_dtypes_to_the_reference(text_checkpoints):
    """On a bf16 model every fused operator takes the reference's own path: the same bits."""
    folder = text_checkpoints["e4b"]
    plain = torchgemma.load(folder, dtype=torch.bfloat16)
    fused = fuse_cpu_ops(torchgemma.load(folder, dtype=torch.bfloat16))
    ids, mask = padded_batch(seed=4)
    assert torch.equal(_run(fused, ids, mask), _run(plain, ids, mask))
    assert {m.rope for m in plain.modules() if isinstance(m, Attention)} == {apply_rope}
    assert all(m.backends is ATTENTION for m in plain.modules() if isinstance(m, Attention))
