"""Loading by shard (issue 27, item 3): a GGUF file's blocks read piece by piece under tensor
parallelism, quantized weights split in whole groups (ShardPlan.granule), and the fallback where a
rank's share is not whole groups. Ranks are gloo processes (tests/distributed_fixtures.py).

Logits: a GGUF block's values dequantize exactly, so the float64 model of the dequantized weights is
the exact arithmetic of the quantized one; the ranks' logits must lie within twice one process's
own distance from it (quantized products with float activations, ``activations=None``: with int16
activations the products' rounding of x dominates, see test_gguf_blocks_with_int_activations).
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import torchgemma
from distributed_fixtures import Ranks
from gguf_fixtures import random_model, write_gguf
from test_gguf import GEMMA4_STYLES
from torchgemma.distributed import ShardPlan
from torchgemma.weights.gguf import GGUFError, read_gguf
from tp_worker import logits_and_tokens, seed_of


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict:
    """Tiny Gemma 4 GGUF files: E2B-like (PLE table, KV sharing, one KV head) and 26B-like (experts
    whose 256-wide down rows take k-quants, cut mid super-block at 2 ranks; a dense MLP of 96 = 3
    groups of 32, split 64 + 32)."""
    folder = tmp_path_factory.mktemp("gguf_shards")
    files = {}
    for style in ("e2b", "26b"):
        files[style] = folder / f"{style}.gguf"
        model = random_model("gemma4_text", GEMMA4_STYLES[style], seed=3)
        write_gguf(files[style], model, seed=1, extra_shared_kv=style == "e2b")
    return files


def _references(files: dict, activations=None) -> dict:
    refs = {}
    for name, path in files.items():
        model = torchgemma.load(path, dtype=torch.float32, quantize="gguf", activations=activations)
        refs[name] = logits_and_tokens(model, seed_of(name))
        refs[name]["layers"] = [len(model.quantization["layers"]), len(model.quantization["kept"])]
        if activations is None:
            exact = torchgemma.load(path, dtype=torch.float64, quantize=None)
            refs[name]["exact"] = logits_and_tokens(exact, seed_of(name), tokens=False)["logits"]
    return refs


def _ranks(tmp_path, size: int, files: dict, activations: str = "none") -> tuple[dict, Ranks]:
    args = ["logits", "--quantize", "gguf", "--activations", activations]
    with Ranks(tmp_path, size, [*args, *(f"{n}={f}" for n, f in files.items())], timeout=300) as ranks:
        refs = _references(files, None if activations == "none" else activations)  # while the ranks run
        got = ranks.results()
    return {name: (got, ref) for name, ref in refs.items()}, ranks


def _within_rounding(name: str, got: dict, ref: dict) -> None:
    assert torch.equal(got[f"{name}.tokens"], ref["tokens"]), name
    own = (ref["logits"].double() - ref["exact"]).abs().max().item()
    drift = (got[f"{name}.logits"] - ref["logits"]).abs().max().item()
    assert drift <= max(2 * own, 1e-5), f"{name}: {drift} from one process, which is {own} from float64"


def test_gguf_blocks_split_over_two_ranks(gguf_files, tmp_path, one_thread):
    """Every layer one process keeps in blocks is in blocks on rank 0 too (none kept in float), and
    the tokens and logits are one process's (measured: logits 3e-4 / 5e-6 apart, one process 2e-4 /
    9e-6 from float64)."""
    results, _ = _ranks(tmp_path, 2, gguf_files)
    for name, (got, ref) in results.items():
        assert got[f"{name}.layers"].tolist() == ref["layers"], name
        assert ref["layers"][1] == 0
        _within_rounding(name, got, ref)


@pytest.mark.slow
def test_gguf_blocks_fall_back_where_a_share_is_not_whole_groups(gguf_files, tmp_path, one_thread):
    """4 ranks of the 26B-like file: a sliding layer's o_proj share is one 16-wide head (half a
    group of 32) and the dense MLP's 96 features (3 groups) cannot give each rank a whole one (even
    split: 24): those layers are dequantized into float on each rank, with a warning naming the
    rank's share; the experts (8 groups) stay in blocks. Tokens and logits as one process's."""
    files = {"26b": gguf_files["26b"]}
    results, ranks = _ranks(tmp_path, 4, files)
    got, ref = results["26b"]
    quantized, kept = got["26b.layers"].tolist()
    assert kept > 0 and quantized + kept == ref["layers"][0]
    log = ranks.logs[0].read_text()
    assert f"{kept} layer(s) kept in full precision, their width (this rank's share of 4)" in log
    _within_rounding("26b", got, ref)


@pytest.mark.slow
def test_gguf_blocks_with_int_activations(gguf_files, tmp_path, one_thread):
    """The default activations (int16 where the CPU has VNNI): the ranks round x per 32 values as
    one process does (their columns start at whole groups), so the greedy tokens are the same
    (logits measured 8e-3 apart on the E2B-like file, where int16 activations themselves move one
    process's logits by 9e-2 from float activations)."""
    results, _ = _ranks(tmp_path, 2, gguf_files, activations="auto")
    for name, (got, ref) in results.items():
        assert torch.equal(got[f"{name}.tokens"], ref["tokens"]), name


# ── pieces of a GGUF tensor, in one process ─────────────────────────────────────────────────


def _cut(tensor: torch.Tensor, pieces) -> torch.Tensor:
    return torch.cat([tensor.narrow(d, a, b - a) for d, a, b in pieces], dim=pieces[0][0])


def test_gguf_pieces_read_as_the_whole_tensor_cut(gguf_files, tmp_path):
    """Every tensor a rank splits, at 2 and 4 ranks (and whole experts at 2): its piece, dequantized
    or as grouped integers (where its columns are whole groups), holds the values of the whole
    tensor cut; a piece whose columns are not whole groups is refused as integers, naming them. A
    file with gate and up experts apart reads each one's piece."""
    split = tmp_path / "split.gguf"
    write_gguf(split, random_model("gemma4_text", GEMMA4_STYLES["26b"], seed=4), seed=2, split_experts=True)
    plans = [(size, rank, False) for size in (2, 4) for rank in range(size)] + [(2, 1, True)]
    assert _check_pieces(read_gguf(gguf_files["26b"]), plans)  # 4 ranks: the sliding o_proj's 16 columns
    _check_pieces(read_gguf(split), [(2, 1, False), (2, 1, True)], "experts")


def _check_pieces(checkpoint, plans, only: str = "") -> int:
    """The tensors whose names hold ``only`` checked under ``plans``; the pieces refused as integers."""
    config = checkpoint.model_config
    refused = 0
    for size, rank, whole_experts in plans:
        plan = ShardPlan(config.text, size, rank, whole_experts, granule=32)
        for name in checkpoint.tensor_names():
            pieces = plan.slices(config.module_path(name))
            if pieces is None or only not in name:
                continue
            want = _cut(checkpoint.tensor(name), pieces)
            assert torch.equal(checkpoint.tensor(name, pieces=pieces), want), (name, pieces)
            if checkpoint.int_format(name) is None:
                continue
            try:
                ints = checkpoint.grouped_ints(name, pieces)
            except GGUFError as err:
                assert "are not whole groups of" in str(err), err
                refused += 1
                continue
            mins = None if ints.mins is None else ints.mins.float()
            values = torch.ops.torchgemma.dequantize(
                ints.qweight, ints.scales.float(), mins, ints.bits, ints.group_size
            )
            assert torch.equal(values, want.reshape(values.shape)), (name, pieces)
    return refused


def test_a_piece_reads_only_its_blocks(tmp_path):
    """An infinite block scale in the token table's last row: the whole table and the half holding
    that row are refused (naming the block), the other half reads, as its bytes are never decoded."""
    path = tmp_path / "31b.gguf"
    write_gguf(path, random_model("gemma4_text", GEMMA4_STYLES["31b"], seed=3), seed=1)
    checkpoint = read_gguf(path)
    info = checkpoint._file.tensors["token_embd.weight"]
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[info.qtype]
    vocab, hidden = info.shape
    last_block = vocab * hidden // block - 1
    name = "model.embed_tokens.weight"
    clean = checkpoint.tensor(name, pieces=[(0, 0, vocab // 2)])
    with open(path, "r+b") as handle:  # the scale (fp16, first field of every 32-wide type) of its last block
        handle.seek(info.offset + last_block * size)
        handle.write(np.array([np.inf], np.float16).tobytes())
    checkpoint = read_gguf(path)
    assert torch.equal(checkpoint.tensor(name, pieces=[(0, 0, vocab // 2)]), clean)
    for pieces in (None, [(0, vocab // 2, vocab)]):
        with pytest.raises(GGUFError, match=f"NaN or infinite block scale in block {last_block}\\b"):
            checkpoint.tensor(name, pieces=pieces)


# ── the split in whole groups ───────────────────────────────────────────────────────────────


def test_plan_splits_intermediate_features_in_whole_groups(tmp_path, gguf_files):
    """The published 26B-A4B at 4 ranks, granule 32: its 704 expert features (22 groups) and 2112
    dense ones (66) split unevenly in whole groups, where the even split (176, 528) is not; without
    a granule the split stays even; fewer groups than ranks keeps the even split."""
    from published_configs import A26B

    (tmp_path / "config.json").write_text(json.dumps(A26B))
    text = torchgemma.ModelConfig.from_file(tmp_path).text
    shares = [ShardPlan(text, 4, r, granule=32) for r in range(4)]
    assert [p.expert_features for p in shares] == [(0, 192), (192, 384), (384, 544), (544, 704)]
    assert [p.layers[0].mlp for p in shares] == [(0, 544), (544, 1088), (1088, 1600), (1600, 2112)]
    for plan in shares:
        local = plan.local_text()
        assert local.moe_intermediate_size % 32 == 0
        assert all(spec.intermediate_size % 32 == 0 for spec in local.layers)
    assert ShardPlan(text, 4, 1).expert_features == (176, 352)
    small = read_gguf(gguf_files["26b"]).model_config.text  # a 96-wide MLP: 3 groups
    assert ShardPlan(small, 2, 1, granule=32).layers[0].mlp == (64, 96)
    assert ShardPlan(small, 4, 3, granule=32).layers[0].mlp == (72, 96)  # 4 ranks: even


@pytest.mark.slow
def test_int4_quantizes_uneven_shares_in_whole_groups(tmp_path, one_thread):
    """int4 on a 26B-like checkpoint whose MLP and experts have 96 features (3 groups of 32): at 2
    ranks they split 64 + 32, so every layer is quantized (the even split, 48, kept them in float),
    each rank quantizing the groups one process does: the same tokens, logits within the bound of
    test_distributed.py's int4 test (float32 reordering of the down sums)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from checkpoints import COMMON, randomize_
    from checkpoints import STYLES as SHAPES

    fields = {**COMMON, **SHAPES["26b"], "intermediate_size": 96, "moe_intermediate_size": 96}
    model = Gemma4ForCausalLM(Gemma4TextConfig(**fields))
    randomize_(model, 7)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.05)
    model.save_pretrained(tmp_path / "26b")
    folder = tmp_path / "26b"
    args = ["logits", "--quantize", "int4", "--activations", "none", f"26b={folder}"]
    with Ranks(tmp_path, 2, args, timeout=300) as ranks:
        one = torchgemma.load(folder, dtype=torch.float32, quantize="int4", activations=None)
        ref = logits_and_tokens(one, seed_of("26b"))
        got = ranks.results()
    assert one.quantization["kept"] == {}
    assert got["26b.layers"].tolist() == [len(one.quantization["layers"]), 0]
    assert torch.equal(got["26b.tokens"], ref["tokens"])
    assert (got["26b.logits"] - ref["logits"]).abs().max() < 2e-3


# ── the real Gemma 3 270M (Q4_K_M), in its blocks ───────────────────────────────────────────


@pytest.mark.slow
def test_real_270m_in_blocks_under_torchrun(real_270m_file):
    """`generate` under torchrun at 2 ranks, the file's blocks kept (quantize "auto" is "gguf"):
    rank 0 prints what one process does, greedy."""
    from distributed_fixtures import rank_env, run_command
    from test_distributed import _torchrun

    argv = ["generate", "--model", str(real_270m_file), "--max-new-tokens", "24", "-q", "--temperature", "0"]
    argv.append("The tallest mountain in the world is")
    env = rank_env(0, 1, 0)
    one = run_command([sys.executable, "-m", "torchgemma.cli", *argv], env, timeout=300)
    two = run_command(_torchrun(2, *argv, "--tensor-parallel-size", "2"), env, timeout=300)
    assert one.returncode == two.returncode == 0, two.stderr.decode()[-3000:]
    assert two.stdout == one.stdout and one.stdout.strip()


@pytest.mark.slow
def test_real_270m_rank_memory_in_blocks(real_270m_file, tmp_path, one_thread):
    """Each rank of 2 holds its share of the file's blocks (the k/v projections and norms whole,
    the rest halved) and its resident memory grows by about that share of one process's growth
    while loading (measured: see the README's "Many devices")."""
    from distributed_fixtures import free_port, rank_env, run_command

    args = ["memory", "--quantize", "gguf", f"real={real_270m_file}"]
    env = {**rank_env(0, 1, free_port()), "WORLD_SIZE": "1"}
    worker = [sys.executable, str(Path(__file__).parent / "tp_worker.py")]
    done = run_command([*worker, str(tmp_path / "one.safetensors"), *args], env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    one = load_file(tmp_path / "one.safetensors")
    weights, (_, _, peak, before) = one["real.weights"].item(), one["real.memory"].tolist()
    with Ranks(tmp_path, 2, args, timeout=300) as ranks:
        got = ranks.results()
    share = got["real.weights"].item() / weights
    _, _, rank_peak, rank_before = got["real.memory"].tolist()
    gained = (rank_peak - rank_before) / (peak - before)
    print(f"weights per rank {share:.3f} of one process's; peak RSS gained {gained:.3f} of one process's")
    assert 0.5 < share < 0.6
    assert gained < share + 0.1, (share, gained)
