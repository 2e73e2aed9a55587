"""What quantization costs in quality, measured on the real Gemma 3 270M (Q4_K_M GGUF).

For every mode of ``torchgemma.load`` on the file, against the full-precision run (the file's blocks
dequantized to float32, ``quantize=None``):

* greedy agreement: 64 new tokens on 5 prompts; tokens equal to the full-precision run's before the
  first difference, and in all. The prompts are short (5-10 tokens: their products take the one-row
  kernels), so a sixth run continues the passage's first 128 tokens (its prefill takes the products
  of 16 rows or more: ``qlinear_dense`` with float activations, else ``qlinear_int``);
* perplexity of ``data/passage.txt`` (one forward pass over the whole passage);
* max |Δ logits| over every position of the passage, in one forward pass (calls of 16 rows or more:
  the float32 BLAS on dequantized slabs, or integer activations) and token by token through the
  cache for the passage's first 64 tokens (one-row calls: the C++ kernels, float activations).

llama.cpp (llama-cpp-python, when installed) computes the same passage's perplexity from its own
logits of the same file and the same token ids. The modes:

    fp32        the GGUF dequantized to float32 (the reference row)
    gguf+float  each tensor at the file's own precision (Q8_0, Q5_0, Q6_K as 8-bit groups, Q4_K as
                4-bit), float activations in every product (activations=None)
    gguf+int16  the same, activations rounded to int16 in products of 16 rows or more (prefill): what
                load(..., quantize="gguf") does by default ("auto") where the CPU has AVX-512 VNNI
    gguf+int8   ... rounded to int8 there (llama.cpp's arithmetic)
    int8        round-to-nearest 8-bit, one scale per row, of the dequantized float32 weights
    int8-g32    the same with one scale per 32 values
    int4        round-to-nearest 4-bit, scale and offset per 32, of the dequantized float32 weights
                (the int* modes with the default activations, "auto")

    python benchmarks/quality.py [--json] [--modes fp32,gguf,...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import torchgemma
from torchgemma.weights.source import gemma3_270m

PASSAGE = Path(__file__).parent / "data" / "passage.txt"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics state that",
    "To make a good cup of tea, first",
]
# name: (quantize, group size for torchgemma.quantize or None to quantize while loading, activations)
MODES = {
    "fp32": (None, None, None),
    "gguf+float": ("gguf", None, None),
    "gguf+int16": ("gguf", None, "int16"),
    "gguf+int8": ("gguf", None, "int8"),
    "int8": ("int8", None, "auto"),
    "int8-g32": ("int8", 32, "auto"),
    "int4": ("int4", 32, "auto"),
}
LONG_PROMPT = 128  # tokens of the passage the sixth greedy run continues


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean NLL of each next token) from (T, V) logits of ``ids``."""
    logp = F.log_softmax(logits[:-1].double(), dim=-1)
    target = torch.tensor(ids[1:])
    return math.exp(-logp[torch.arange(len(target)), target].mean().item())


def stepwise_logits(model, ids: list[int], steps: int) -> torch.Tensor:
    """(steps, V) logits of ``ids[:steps]`` fed one token at a time through a cache."""
    cache = model.make_cache(1, steps)
    with torch.inference_mode():
        return torch.cat([model(torch.tensor([[i]]), cache=cache)[0].float() for i in ids[:steps]])


def greedy(model, tokenizer, prompt: str | list[int], new: int) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt) if isinstance(prompt, str) else prompt])
    out = torchgemma.generate(
        model, ids, max_new_tokens=new, sampling=torchgemma.SamplingParams(temperature=0.0), stop_token_ids=[]
    )
    return out[0, ids.shape[1] :].tolist()


def agreement(ours: list[int], reference: list[int]) -> tuple[int, int]:
    """(tokens before the first difference, tokens equal position by position)."""
    prefix = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), len(reference))
    return prefix, sum(a == b for a, b in zip(ours, reference))


def llama_cpp_quality(
    path: Path, ids: list[int], tokenizer, new: int
) -> tuple[float, list[list[int]]] | None:
    """llama.cpp's perplexity of the passage and its greedy tokens for PROMPTS."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp row", file=sys.stderr)
        return None
    llm = Llama(model_path=str(path), n_ctx=2048, n_batch=2048, logits_all=True, verbose=False)
    llm.eval(ids)
    ppl = perplexity(torch.tensor(llm.scores[: len(ids)]), ids)
    tokens = []
    for prompt in [*(tokenizer.encode(p) for p in PROMPTS), ids[:LONG_PROMPT]]:
        llm.reset()
        out = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            out.append(token)
            if len(out) == new:
                break
        tokens.append(out)
    return ppl, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated; fp32 (the reference) first"
    )
    args = parser.parse_args(argv)
    asked = [m for m in args.modes.split(",") if m and m != "fp32"]
    unknown = [m for m in asked if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}: the modes are {', '.join(MODES)}")
    modes = {name: MODES[name] for name in ["fp32", *asked]}
    warnings.simplefilter("ignore")
    path = gemma3_270m()
    tokenizer = torchgemma.load_tokenizer("gemma3-270m")
    ids = tokenizer.encode(PASSAGE.read_text())
    rows, reference_logits, reference_tokens, reference_steps = {}, None, None, None
    for name, (mode, group, activations) in modes.items():
        if group is None:
            model = torchgemma.load(path, quantize=mode, activations=activations)
        else:
            model = torchgemma.quantize(
                torchgemma.load(path, quantize=None), mode, group_size=group, activations=activations
            )
        with torch.inference_mode():
            logits = model(torch.tensor([ids]))[0].float()
        steps = stepwise_logits(model, ids, 64)
        tokens = [greedy(model, tokenizer, p, args.new_tokens) for p in [*PROMPTS, ids[:LONG_PROMPT]]]
        if reference_logits is None:
            reference_logits, reference_tokens, reference_steps = logits, tokens, steps
        agree = [agreement(t, r) for t, r in zip(tokens, reference_tokens)]
        long_prefix, long_equal = agree.pop()
        rows[name] = {
            "perplexity": perplexity(logits, ids),
            "max_abs_dlogits": float((logits - reference_logits).abs().max()),
            "max_abs_dlogits_stepwise": float((steps - reference_steps).abs().max()),
            "greedy_prefix_agreement": [a for a, _ in agree],
            "greedy_tokens_equal": sum(b for _, b in agree),
            "greedy_tokens": len(PROMPTS) * args.new_tokens,
            "long_prompt_greedy_prefix_agreement": long_prefix,
            "long_prompt_greedy_tokens_equal": long_equal,
        }
        del model
    llama = llama_cpp_quality(path, ids, tokenizer, args.new_tokens)
    llama_ppl = None
    if llama is not None:
        llama_ppl, llama_tokens = llama
        agree = [agreement(t, r) for t, r in zip(llama_tokens, reference_tokens)]
        llama_long = agree.pop()
    print(
        f"Gemma 3 270M Q4_K_M, passage of {len(ids)} tokens, {len(PROMPTS)} prompts x {args.new_tokens} greedy tokens"
    )
    print(
        f"{'mode':10} {'perplexity':>11} {'max |Δ logits|':>15} {'(token by token)':>17} {'greedy equal':>13}  "
        f"{'tokens before 1st difference':30} {f'{LONG_PROMPT}-token prompt: equal, before 1st difference':>16}"
    )
    for name, row in rows.items():
        print(
            f"{name:10} {row['perplexity']:11.4f} {row['max_abs_dlogits']:15.4g} "
            f"{row['max_abs_dlogits_stepwise']:17.4g} "
            f"{row['greedy_tokens_equal']:>5}/{row['greedy_tokens']:<7}  {str(row['greedy_prefix_agreement']):30} "
            f"{row['long_prompt_greedy_tokens_equal']:>3}/{args.new_tokens}, {row['long_prompt_greedy_prefix_agreement']}"
        )
    if llama is not None:
        equal = sum(b for _, b in agree)
        print(
            f"{'llama.cpp':10} {llama_ppl:11.4f} {'-':>15} {'-':>17} {equal:>5}/{len(PROMPTS) * args.new_tokens:<7}  "
            f"{str([a for a, _ in agree]):30} {llama_long[1]:>3}/{args.new_tokens}, {llama_long[0]}"
            "  (llama-cpp-python, the same file and token ids)"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "quality-270m",
                    "passage_tokens": len(ids),
                    "llama_cpp_perplexity": llama_ppl,
                    "llama_cpp_long_prompt_greedy": None if llama is None else llama_long,
                    "results": rows,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
