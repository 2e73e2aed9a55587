"""A compiled, static-shape decode step.

    model = torchgemma.compile(torchgemma.load(...))   # then Engine / generate / LLM use it

``decode_step`` runs one token for *every* slot of a cache, from tensors alone: the tokens (S, 1),
each slot's position (S,) and which slots really decode (S,). Idle slots compute on whatever they are
fed and change nothing, so the shapes never change with the batch's occupancy, and nothing in the
step reads host state: ``torch.compile(fullgraph=True)`` traces it once, with no graph break and no
recompile across steps, slot changes or occupancy. On CUDA the compiled step is also captured in
CUDA graphs (``mode="reduce-overhead"``, the cache buffers marked as static addresses).

What changes under compilation: the mixture of experts takes its gathered (static-shape) path,
which sums each token's expert outputs as the uncompiled expert loop does for the model's experts
implementation (``Experts``): the traced step's ops give the uncompiled step's bf16 bits on the CPU
(inductor's fused kernels do not round between ops, which moves bf16 logits, dense models too);
prefill is never compiled (its shapes vary).
"""

from __future__ import annotations

import weakref

import torch

from ..cache import KVCache
from ..model import Gemma
from ..notices import slow_notice


def decode_step(
    model: Gemma, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, active: torch.Tensor
) -> torch.Tensor:
    """One token for every slot: tokens (S, 1), positions (S,), active (S,) -> float32 logits (S, V).

    ``tokens`` are already text ids (``model.text_ids``). The caller records the new lengths with
    ``cache.advance``.
    """
    return model.language_model.decode(tokens, cache, positions, active)[:, -1].float()


class CompiledDecode:
    """``decode_step`` compiled for one model (the engine calls it with its cache)."""

    def __init__(self, model: Gemma, *, backend: str = "inductor", mode: str | None = None, cuda_graphs=None):
        on_cuda = model.device.type == "cuda"
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and not on_cuda:
            raise ValueError(f"CUDA graphs need the model on a CUDA device; it is on {model.device}")
        if backend == "inductor" and mode is None and self.cuda_graphs:
            mode = "reduce-overhead"
        options = {"mode": mode} if backend == "inductor" else {}
        self.model = model
        self.step = torch.compile(decode_step, backend=backend, fullgraph=True, dynamic=False, **options)
        self._static: weakref.WeakSet[KVCache] = weakref.WeakSet()
        self._shapes: set[tuple[int, int]] = set()  # (slots, columns) traced so far: one graph each

    def __call__(
        self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, active: torch.Tensor
    ) -> torch.Tensor:
        cache.reserve(cache.max_len)  # the static step reads every column; a no-op once whole
        if self.cuda_graphs:
            if cache not in self._static:
                # The graphs write into the cache in place: its buffers must keep their addresses.
                for layer in cache.layers:
                    if layer is not None:
                        torch._dynamo.mark_static_address(layer.keys)
                        torch._dynamo.mark_static_address(layer.values)
                self._static.add(cache)
            torch.compiler.cudagraph_mark_step_begin()
        shape = (tokens.shape[0], cache.max_len)
        if shape in self._shapes:
            logits = self.step(self.model, cache, tokens, positions, active)
        else:
            # torch.compile traces and compiles at the first call of each cache shape.
            with slow_notice(
                f"torchgemma: compiling the decode step for {shape[0]} slot(s) x {shape[1]:,} tokens "
                "(torch.compile, once per cache shape: minutes on a small CPU)..."
            ):
                logits = self.step(self.model, cache, tokens, positions, active)
            self._shapes.add(shape)
        # A graph replay reuses its output memory: hand out a copy.
        return logits.clone() if self.cuda_graphs else logits


def compile(  # noqa: A001 - torchgemma.compile, as torch.compile
    model: Gemma, *, backend: str = "inductor", mode: str | None = None, cuda_graphs: bool | None = None
) -> Gemma:
    """Give ``model`` a compiled static-shape decode step; returns the same model.

    ``Engine`` (and so ``generate``, ``stream`` and ``LLM``) then decode with it. ``backend`` and
    ``mode`` go to ``torch.compile``; ``cuda_graphs`` defaults to on for a model on CUDA.
    """
    if getattr(model, "shard_plan", None) is not None:  # (torchgemma.distributed)
        raise ValueError("torchgemma.compile does not compile a tensor-parallel model yet: run it eagerly")
    model.compiled_decode = CompiledDecode(model, backend=backend, mode=mode, cuda_graphs=cuda_graphs)
    return model
