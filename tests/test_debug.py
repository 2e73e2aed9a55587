"""`torchgemma debug trace`: per-module statistics, stopping at the module that first overflows;
`torchgemma debug compare`: two configurations on one input, module by module."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchgemma
from torchgemma.debug import (
    Side,
    capture_torchgemma,
    compare,
    compare_captures,
    format_compare,
    format_trace,
    plot_compare,
    trace,
)

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.tensor([[2, 17, 35, 99, 7, 64, 12, 5]])


def test_a_healthy_pass_records_every_module_by_checkpoint_name(gen_checkpoints):
    model = torchgemma.load(gen_checkpoints["26b"], attention="eager")
    report = trace(model, IDS)
    assert report.first_nonfinite is None
    names = [r.name for r in report.records]
    # The checkpoint's names, as torchgemma.reference records them.
    for name in ("model.language_model.layers.0.self_attn", "model.language_model.layers.0.mlp",
                 "model.language_model.layers.2.experts", "model.language_model.norm"):  # fmt: skip
        assert name in names, name
    assert all(r.finite and r.inputs_finite and r.headroom > 1 for r in report.records)
    assert "module outputs are finite" in format_trace(report)


def test_the_first_overflow_is_named_with_its_inputs(gen_checkpoints):
    """A down projection scaled past float32's range: the trace stops there, not at the NaN it
    spreads downstream, and says its inputs were finite."""
    model = torchgemma.load(gen_checkpoints["e2b"], attention="eager")
    culprit = model.language_model.layers[2].mlp.down_proj
    with torch.no_grad():
        culprit.weight.fill_(3e38)  # finite, but any sum of such products overflows
    report = trace(model, IDS)
    first = report.first_nonfinite
    assert first is not None and first.name == "model.language_model.layers.2.mlp.down_proj"
    assert first.inputs_finite and first.inf + first.nan > 0
    assert report.records[-1] is first  # stopped there
    everything = trace(model, IDS, stop=False)
    assert everything.first_nonfinite.name == first.name
    assert len(everything.records) > len(report.records)
    assert "first non-finite output: model.language_model.layers.2.mlp.down_proj" in format_trace(report)


def test_the_command(llm_checkpoint):  # noqa: F811
    command = [sys.executable, "-m", "torchgemma.cli", "debug", "trace", "--model", str(llm_checkpoint)]
    done = subprocess.run([*command, "--json", "Hello there"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["first_nonfinite"] is None and out["records"]
    assert {"name", "min", "max", "mean_abs", "nan", "inf", "headroom"} <= set(out["records"][0])


@pytest.mark.slow
def test_why_float16_fails_on_the_real_270m():
    """The real 270M in float16: the residual stream outgrows float16 (65504) inside a decoder layer
    whose inputs are still finite; README quotes the trace."""
    model = torchgemma.load("gemma3-270m", dtype=torch.float32, quantize=None).to(torch.float16)
    ids = torch.tensor([torchgemma.load_tokenizer("gemma3-270m").encode("The capital of France is")])
    first = trace(model, ids).first_nonfinite
    assert first is not None and first.inputs_finite
    assert first.input_max_abs > 32768  # the same order as float16's limit before it overflows


# ── compare ─────────────────────────────────────────────────────────────────────────────────────

LONGER = torch.tensor([[2, 17, 35, 99, 7, 64, 12, 5, 250, 31, 8, 140]])  # longer than the window


@pytest.mark.parametrize("style", ["e2b", "26b"])
def test_compare_with_transformers_lines_up_every_sublayer(text_checkpoints, style):
    """Our eager model against transformers': the same module names on both sides, every sublayer
    of every layer compared, bf16 to the bit and fp32 to rounding."""
    folder = text_checkpoints[style]
    bf16 = compare(folder, LONGER, "torchgemma:bf16", "transformers:bf16:eager")
    layers = torchgemma.ModelConfig.from_file(folder).text.num_hidden_layers
    expected = {"attention", "mlp", "residual"} | ({"experts"} if style == "26b" else {"ple"})
    for index in range(layers):
        assert {m.sublayer for m in bf16.modules if m.layer == index} >= expected, index
    assert all(m.max_abs == 0 for m in bf16.modules), [m.name for m in bf16.modules if m.max_abs]
    assert bf16.logits.max_abs == 0 and bf16.logits.top1_agree == bf16.logits.positions == 12
    assert bf16.first_past is None and not bf16.skipped
    fp32 = compare(folder, LONGER, "torchgemma:fp32", "transformers:fp32:eager")
    assert fp32.logits.max_abs < 1e-4 and max(m.max_rel for m in fp32.modules) < 1e-5


def test_compare_against_the_float64_reference(text_checkpoints):
    report = compare(text_checkpoints["31b"], LONGER, "torchgemma:fp32", "reference", threshold=1e-4)
    assert report.b == "reference:fp64" and report.first_past is None
    assert report.logits.max_abs < 6e-5 and report.logits.kl_mean < 1e-9
    bf16 = compare(text_checkpoints["31b"], LONGER, "torchgemma:bf16", "reference", threshold=1e-4)
    # bf16 keeps 8 bits: its first block is already past 1e-4 of the values' size.
    assert bf16.first_past is not None and bf16.first_past.layer == 0
    assert bf16.logits.max_abs > 100 * report.logits.max_abs
    table = format_compare(bf16)
    assert "first module past 0.0001 relative: model.language_model.layers.0." in table
    assert "top-1 agree" in table and "residual rel" in table


def test_compare_names_the_module_that_went_wrong(gen_checkpoints):
    """A fault planted in one layer's MLP: the first module past the threshold is that projection."""
    model = torchgemma.load(gen_checkpoints["e4b"], attention="eager")
    clean = capture_torchgemma(model, LONGER, "clean")
    with torch.no_grad():
        model.language_model.layers[3].mlp.down_proj.weight.mul_(1.01)
    faulty = capture_torchgemma(model, LONGER, "faulty")
    report = compare_captures(faulty, clean, threshold=1e-3)
    assert report.first_past.name == "model.language_model.layers.3.mlp.down_proj"
    by_name = {m.name: m for m in report.modules}
    assert by_name["model.language_model.layers.2"].max_abs == 0
    assert by_name["model.language_model.layers.3.mlp"].max_rel == pytest.approx(0.01, rel=1e-3)
    assert report.logits.max_abs > 0


def test_sides_are_parsed_and_bad_ones_named():
    side = Side.parse("torchgemma:sdpa:int8:bf16")
    assert (side.implementation, side.dtype, side.attention, side.quantize) == (
        "torchgemma",
        torch.bfloat16,
        "sdpa",
        "int8",
    )
    assert side.label == "torchgemma:bf16:sdpa:int8" and Side.parse("reference").label == "reference:fp64"
    for bad, words in [
        ("vllm:bf16", "implementation must be one of"),
        ("torchgemma:fp8", "unknown option 'fp8'"),
        ("reference:fp32", "takes no options"),
        ("transformers:int4", "quantization is torchgemma's"),
    ]:
        with pytest.raises(ValueError, match=words):
            Side.parse(bad)


def test_the_plot_and_its_missing_extra(text_checkpoints, tmp_path, monkeypatch):
    report = compare(text_checkpoints["e2b"], LONGER, "torchgemma:bf16", "reference")
    plot_compare(report, tmp_path / "errors.png")
    assert (tmp_path / "errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"torchgemma\[plot\]"):
        plot_compare(report, tmp_path / "again.png")


def test_the_compare_command(llm_checkpoint, tmp_path):  # noqa: F811
    command = [sys.executable, "-m", "torchgemma.cli", "debug", "compare", "--model", str(llm_checkpoint)]
    options = ["--a", "torchgemma:fp32", "--b", "transformers:fp32", "--plot", str(tmp_path / "e.png")]
    done = subprocess.run(
        [*command, *options, "--json", "Hello there"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["a"] == "torchgemma:fp32:eager" and out["b"] == "transformers:fp32:eager"
    assert out["logits"]["max_abs"] < 1e-4 and out["modules"] and out["first_past"] is None
    assert np.isfinite([m["max_abs"] for m in out["modules"]]).all()
    assert (tmp_path / "e.png").stat().st_size > 1000
    bad = subprocess.run(
        [*command, "--a", "torchgemma:fp8", "Hi"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "unknown option 'fp8'" in bad.stderr


# ── compare against transformers' defaults ─────────────────────────────────────────────────────


def test_sdpa_compares_against_transformers_default_on_a_checkpoint_with_an_audio_tower(tmp_path):
    """transformers refuses ``attn_implementation="sdpa"`` for a checkpoint with an audio tower
    (its audio tower has no sdpa); ``transformers:...:sdpa`` is its default instead (sdpa in the
    text decoder and the vision tower, eager in the audio tower), what our sdpa equals."""
    from transformers import AutoModelForCausalLM

    from checkpoints import build_omni_checkpoint

    folder = build_omni_checkpoint(tmp_path / "omni", seed=5)
    with pytest.raises(ValueError, match="does not support"):
        AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    report = compare(folder, LONGER, "torchgemma:bf16:sdpa", "transformers:bf16:sdpa")
    assert report.modules and all(m.max_abs == 0 for m in report.modules)
    assert report.logits.max_abs == 0 and not report.skipped


def test_experts_are_a_side_option_compared_as_transformers_names_them(text_checkpoints):
    """experts=eager on both sides: equal to the bit; our default (grouped_mm) against
    transformers' eager experts: the first module apart is an experts module."""
    side = Side.parse("transformers:bf16:experts=eager")
    assert (side.attention, side.experts, side.label) == (
        "eager",
        "eager",
        "transformers:bf16:eager:experts=eager",
    )
    assert (
        Side.parse("torchgemma").experts == "grouped_mm"
        and Side.parse("torchgemma").label == "torchgemma:fp32:eager"
    )
    with pytest.raises(
        ValueError, match="unknown option 'experts=batched'.*experts=grouped_mm, experts=eager"
    ):
        Side.parse("torchgemma:experts=batched")
    folder = text_checkpoints["26b"]
    same = compare(folder, LONGER, "torchgemma:bf16:experts=eager", "transformers:bf16:experts=eager")
    assert all(m.max_abs == 0 for m in same.modules) and same.logits.max_abs == 0
    apart = compare(folder, LONGER, "torchgemma:bf16", "transformers:bf16:experts=eager", threshold=0)
    assert apart.first_past is not None and apart.first_past.sublayer == "experts", apart.first_past
