"""`torchgemma debug trace`: per-module statistics, stopping at the module that first overflows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import torchgemma
from test_llm import llm_checkpoint  # noqa: F401  (the fixture: a tiny E2B-like checkpoint with a tokenizer)
from torchgemma.debug import format_trace, trace

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
