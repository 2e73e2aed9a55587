"""Hostile calls of the torchgemma operators (test_hostile_files.py runs them in a child process,
where a crash is a signal the parent sees): zero-size and mismatched arguments for every operator.
Imports only torch and torchgemma.kernels, so that the child starts quickly."""

from __future__ import annotations

import json

import torch

from torchgemma import kernels

# Each case: (name, call, expected), `expected` either the output shape(s) (an empty input gives an
# empty output, as the math says) or the text the error must contain (the operator's name and what
# is wrong). The cases run in one child process (a crash is a signal, not an exception): under every
# instruction set the CPU runs (kernels.set_isa), then on the pure-PyTorch references (each
# Operator's `reference`, the function TORCHGEMMA_ISA=reference and every other device dispatch to).

_OPS = torch.ops.torchgemma  # what the cases call: the dispatcher, or (for "reference") the references


def _weight(n: int, k: int, bits: int, group: int = 32):
    q = torch.zeros(n, kernels.packed_width(k, bits), dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.ones(n, k // group)
    return q, scales, torch.zeros_like(scales)


PRODUCTS = ("qlinear", "qlinear_dense", "qlinear_int", "qlinear_bounds", "dequantize", "row_norms")


def _product(op: str, x, q, scales, mins, bits: int, group: int):
    """One call of a quantized-weight operator, each with the arguments its schema takes."""
    f = getattr(_OPS, op)
    if op == "dequantize":
        return f(q, scales, mins, bits, group)
    if op == "row_norms":
        return f(q, scales, bits, group)
    if op == "qlinear_bounds":
        return f(x, q, scales, mins, bits, group, torch.ones(q.shape[0]))
    if op == "qlinear_int":
        return f(x, q, scales, mins, bits, group, 8)
    return f(x, q, scales, mins, bits, group)


def _product_cases(op: str, bits: int) -> list[tuple[str, tuple, object]]:
    """(label, _product's arguments after op, expected) for one operator and width."""
    q, scales, mins = _weight(4, 64, bits)  # 4 rows of 64 features
    x = torch.ones(2, 64)

    def shape(m: int, n: int, k: int):  # the result for x (m, k) and a weight (n, k)
        if op == "qlinear_bounds" and bits == 5:
            return "qlinear_bounds: bits must be 8 or 4, got 5"  # the greedy head takes no 5-bit rows
        return {"dequantize": [[n, k]], "row_norms": [[n]], "qlinear_bounds": [[m, n], [m, n]]}.get(
            op, [[m, n]]
        )

    no_features = torch.zeros(4, 0, dtype=q.dtype)
    cases = [
        ("0 rows", (torch.ones(3, 64), *_weight(0, 64, bits), bits, 32), shape(3, 0, 64)),
        ("0 features", (torch.ones(3, 0), no_features, torch.ones(4, 0), None, bits, 32), f"{op}: qweight [4, 0] has no input features"),
        ("scales too few", (x, q, torch.ones(4, 1), None, bits, 32), f"{op}: scales must be"),
        ("scales 1-D", (x, q, torch.ones(8), None, bits, 32), f"{op}: scales must be"),
        ("qweight 1-D", (x, q.reshape(-1), scales, None, bits, 32), f"{op}: qweight must be a"),
    ]  # fmt: skip
    cases += [
        (f"group {group}", (x, q, scales, mins, bits, group), f"{op}: group size {group} does not divide 64")
        for group in (0, -32, 48)
    ]
    if op != "row_norms":  # the one that takes no mins
        cases.append(("mins too few", (x, q, scales, torch.ones(2, 2), bits, 32), f"{op}: mins must be"))
    if op not in ("dequantize", "row_norms"):  # the ones that take an x
        cases += [
            ("0 inputs", (torch.ones(0, 64), q, scales, mins, bits, 32), shape(0, 4, 64)),
            ("x of 32 features", (torch.ones(2, 32), q, scales, mins, bits, 32), f"{op}: input x [2, 32] must end in the 64 features"),
            ("x 0-D", (torch.ones(()), q, scales, mins, bits, 32), f"{op}: input x [] must end in the 64 features"),
        ]  # fmt: skip
    return cases


def cases() -> list[tuple[str, object, object]]:
    """(name, a call of no arguments, expected) for every hostile case."""
    found = [
        (f"{op}/{bits}-bit/{label}", lambda op=op, args=args: _product(op, *args), expected)
        for bits in (4, 5, 8)
        for op in PRODUCTS
        for label, args, expected in _product_cases(op, bits)
    ]
    int8, x = torch.zeros(4, 64, dtype=torch.int8), torch.ones(2, 64)
    k = torch.ones(1, 2, 5, 8)  # one sequence's keys (and values): 2 KV heads, 5 positions, width 8
    others = [  # (op, label, arguments, expected)
        ("qlinear", "bits 3", (x, int8, torch.ones(4, 2), None, 3, 32), "qlinear: bits must be 4, 5 or 8"),
        ("qlinear", "qweight int32", (x, int8.int(), torch.ones(4, 2), None, 8, 32), "qlinear: qweight of bits 8 must be"),
        ("qlinear_int", "x_bits 4", (x, int8, torch.ones(4, 2), None, 8, 32, 4), "qlinear_int: x_bits must be 8 or 16"),
        ("qlinear_int", "48 features", (torch.ones(2, 48), int8[:, :48].contiguous(), torch.ones(4, 3), None, 8, 16, 8), "qlinear_int"),
        ("qlinear_bounds", "3 row norms", (x, int8, torch.ones(4, 2), None, 8, 32, torch.ones(3)), "qlinear_bounds: row_norms must be float32 (4)"),
        ("bounded_candidates", "0 rows", (torch.ones(0, 5), torch.ones(0, 5)), [[0], [0]]),
        ("bounded_candidates", "0 columns", (torch.ones(3, 0), torch.ones(3, 0)), "bounded_candidates: approx [3, 0] has no columns"),
        ("bounded_candidates", "two shapes", (torch.ones(3, 5), torch.ones(3, 4)), "bounded_candidates: approx must be a"),
        ("bounded_candidates", "1-D", (torch.ones(5), torch.ones(5)), "bounded_candidates: approx must be a"),
        ("rms_norm", "0 rows", (torch.ones(0, 8), torch.ones(8), 1e-6, True), [[0, 8]]),
        ("rms_norm", "0 features", (torch.ones(3, 0), None, 1e-6, True), "rms_norm: x [3, 0] has no features"),
        ("rms_norm", "0-D", (torch.ones(()), None, 1e-6, True), "rms_norm: x [] has no features"),
        ("rms_norm", "weight short", (torch.ones(3, 8), torch.ones(7), 1e-6, True), "rms_norm: weight [7] for 8 features"),
        ("rms_norm", "weight 2-D", (torch.ones(3, 8), torch.ones(2, 4), 1e-6, False), "rms_norm: weight [2, 4] for 8 features"),
        ("rope", "0 positions", (torch.ones(1, 0, 3, 4), torch.ones(1, 0, 4), torch.ones(1, 0, 4)), [[1, 0, 3, 4]]),
        ("rope", "0 heads", (torch.ones(1, 2, 0, 4), torch.ones(1, 2, 4), torch.ones(1, 2, 4)), [[1, 2, 0, 4]]),
        ("rope", "odd width", (torch.ones(1, 2, 3, 5), torch.ones(1, 2, 5), torch.ones(1, 2, 5)), "rope: x (B, T, H, D)"),
        ("rope", "tables of 3 positions", (torch.ones(1, 2, 3, 4), torch.ones(1, 3, 4), torch.ones(1, 3, 4)), "rope: x (B, T, H, D)"),
        ("rope", "sin half as wide", (torch.ones(1, 2, 3, 4), torch.ones(1, 2, 4), torch.ones(1, 2, 2)), "rope: x (B, T, H, D)"),
        ("rope", "3-D", (torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 3, 4)), "rope: x (B, T, H, D)"),
        ("decode_attention", "0 KV heads", (torch.ones(1, 4, 1, 8), k[:, :0], k[:, :0], 0.5), "decode_attention"),
        ("decode_attention", "0 of both heads", (torch.ones(1, 0, 1, 8), k[:, :0], k[:, :0], 0.5), "decode_attention"),
        ("decode_attention", "0 keys", (torch.ones(1, 4, 1, 8), k[:, :, :0], k[:, :, :0], 0.5), "decode_attention"),
        ("decode_attention", "3 heads over 2", (torch.ones(1, 3, 1, 8), k, k, 0.5), "decode_attention"),
        ("decode_attention", "0 queries", (torch.ones(1, 4, 0, 8), k, k, 0.5), "decode_attention"),
        ("decode_attention", "2 queries", (torch.ones(1, 4, 2, 8), k, k, 0.5), [[1, 2, 4, 8]]),
        (
            "decode_attention",
            "one query's marks for 2 queries",
            (torch.ones(1, 4, 2, 8), k, k, 0.5, torch.ones(1, 4, dtype=torch.bool)),
            "decode_attention",
        ),
        ("decode_attention", "values of 4 keys", (torch.ones(1, 4, 1, 8), k, k[:, :, :4], 0.5), "decode_attention"),
        ("decode_attention", "0 heads", (torch.ones(1, 0, 1, 8), k, k, 0.5), [[1, 1, 0, 8]]),
        ("decode_attention", "0 sequences", (torch.ones(0, 4, 1, 8), k[:0], k[:0], 0.5), [[0, 1, 4, 8]]),
        ("decode_attention", "0 width", (torch.ones(1, 4, 1, 0), k[..., :0], k[..., :0], 0.5), [[1, 1, 4, 0]]),
    ]  # fmt: skip
    found += [
        (f"{op}/{label}", lambda op=op, args=args: getattr(_OPS, op)(*args), expected)
        for op, label, args, expected in others
    ]
    return found


def run_cases(isas: list[str]) -> None:
    """In a child: every case under each set in `isas` ("reference": the references), one JSON line
    before each call (so that a crash names its case) and one with its outcome."""
    global _OPS
    all_cases = cases()
    for isa in isas:
        if isa == "reference":
            _OPS = type("References", (), {op.name: staticmethod(op.reference) for op in kernels.OPERATORS})
        else:
            kernels.set_isa(isa)
        for name, call, _ in all_cases:
            print(json.dumps({"start": f"{isa}:{name}"}), flush=True)
            try:
                out = call()
                outs = out if isinstance(out, tuple) else (out,)
                result = {"shapes": [list(t.shape) for t in outs]}
            except Exception as err:  # noqa: BLE001 - the type is part of what is checked
                result = {"error": f"{type(err).__name__}: {err}"}
            print(json.dumps({"case": f"{isa}:{name}", **result}), flush=True)
