"""Where a model's tensors live: the per-layer-embedding table off the accelerator.

E2B and E4B carry a per-layer token table (``embed_tokens_per_layer``, 262144 x layers*256: 4.7 GB
in bf16 for E2B, 5.6 GB for E4B) that a forward pass reads only ``layers*256`` values per token
from. On a GPU, holding it in GPU memory costs more than the rest of the model; ``keep_on_host``
keeps it in host memory (pinned when the model is on CUDA, for fast copies) and a lookup gathers the
rows of the call's tokens there and moves only them, (B, T, layers*256) per call. The values are
the same, so logits are bit-identical to the all-on-GPU model.

    model = torchgemma.load("google/gemma-4-E2B-it", device="cuda")        # table on the host (default)
    model = torchgemma.load(..., device="cuda", per_layer_table="device")   # everything on the GPU

The placement survives ``model.to(...)``: a device move changes where lookups deliver their rows, a
dtype cast casts the table in place on the host. Under ``torchgemma.compile`` on CUDA the host
lookup is a CPU operation inside the step, so the step is compiled but not captured in CUDA graphs:
use ``per_layer_table="device"`` where the GPU has the memory and CUDA graphs matter more.
"""

from __future__ import annotations

import torch
from torch import nn

from .model.text import Embedding
from .quantization import Format, QuantizedEmbedding

HOST = torch.device("cpu")


class HostPlacement:
    """Mixin for a token table: its tensors stay in host memory whatever the model is moved to;
    ``output_device`` is where lookups deliver their rows (the model's device)."""

    output_device: torch.device = HOST

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input_ids.to(HOST))
        return rows.to(self.output_device, non_blocking=True)

    def _apply(self, fn, recurse=True):
        # What `fn` does to the model: its device becomes where rows go; its dtype applies here.
        self.output_device = fn(torch.zeros((), device=self.output_device)).device
        pin = self.output_device.type == "cuda"

        def on_host(t: torch.Tensor) -> torch.Tensor:
            dtype = fn(torch.zeros((), dtype=t.dtype)).dtype
            if t.is_meta:  # allocation by the loader: in host memory, never on the accelerator
                return torch.empty(t.shape, dtype=dtype, device=HOST, pin_memory=pin)
            out = t.to(device=HOST, dtype=dtype)
            return out.pin_memory() if pin and not out.is_pinned() else out

        return super()._apply(on_host, recurse)


class HostEmbedding(HostPlacement, Embedding):
    pass


class HostQuantizedEmbedding(HostPlacement, QuantizedEmbedding):
    pass


def keep_on_host(table: nn.Module) -> nn.Module:
    """The same table (its tensors shared) as a host-placed module."""
    if isinstance(table, HostPlacement):
        return table
    if isinstance(table, QuantizedEmbedding):
        f = table.format
        with torch.device("meta"):
            host = HostQuantizedEmbedding(
                table.num_embeddings,
                table.embedding_dim,
                Format(f.bits, f.group_size, f.has_mins, f.scale_dtype),
                table.compute_dtype,
            )
        for name in ("qweight", "scales", "mins"):
            setattr(host, name, getattr(table, name))
    elif isinstance(table, nn.Embedding):
        host = HostEmbedding(table.num_embeddings, table.embedding_dim, _weight=table.weight)
    else:
        raise TypeError(f"keep_on_host takes a token table, got {type(table).__name__}")
    host.output_device = table.scales.device if isinstance(table, QuantizedEmbedding) else table.weight.device
    if host.output_device.type != "meta":
        host.to(host.output_device)  # moves the tensors to the host (pinned for CUDA)
    return host


def offload_per_layer_table(model: nn.Module) -> nn.Module:
    """Keep ``model``'s per-layer-embedding table in host memory (see the module docstring); a model
    without one is returned as it is."""
    text = getattr(model, "language_model", model)
    table = getattr(text, "embed_tokens_per_layer", None)
    if table is not None:
        text.embed_tokens_per_layer = keep_on_host(table)
    return model
