"""Parallel sampling in the engine (generation/fork.py): one prefill forked into n sequences, each
equal to its request alone."""

from __future__ import annotations

import pytest
import torch

import torchgemma
from torchgemma import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(engine: Engine) -> dict:
    out: dict = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            out.setdefault(output.request_id, []).append(output.token_id)
    return out


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=40, seed=seed)


def alone(model, ids, seed, new=8) -> list[int]:
    engine = Engine(model, max_batch_size=1, max_len=48, prefill_chunk=4)
    engine.add_request("x", ids, sampling=sampled(seed), max_new_tokens=new, stop_token_ids=[])
    return drain(engine)["x"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_followers_equal_their_requests_alone_and_share_one_prefill(gen_checkpoints, dtype, monkeypatch):
    """A prompt longer than the chunk and the sliding window: three forked sequences with seeds
    5, 6, 7 each equal a request alone with that seed, and the prompt was prefilled once."""
    model = torchgemma.load(gen_checkpoints["e4b"], dtype=dtype)
    ids = prompt(11)
    engine = Engine(model, max_batch_size=4, max_len=48, prefill_chunk=4)
    prefilled = []
    original = Engine._prefill

    def counting(self, group):
        # Only the calls that run a forward themselves: a group the engine runs request by request
        # (batch invariance on this machine's kernels) calls _prefill again for each member.
        before = len(prefilled)
        result = original(self, group)
        if len(prefilled) == before:
            prefilled.extend(r.request_id for r in group)
        return result

    monkeypatch.setattr(Engine, "_prefill", counting)
    engine.add_request("n0", ids, sampling=sampled(5), max_new_tokens=8, stop_token_ids=[])
    for i in (1, 2):
        engine.add_request(
            f"n{i}", ids, sampling=sampled(5 + i), max_new_tokens=8, stop_token_ids=[], fork_of="n0"
        )
    # A neighbour with another prompt shares the steps.
    engine.add_request("other", prompt(6, 1), sampling=sampled(9), max_new_tokens=5, stop_token_ids=[])
    together = drain(engine)
    assert prefilled.count("n0") == 3 and "n1" not in prefilled and "n2" not in prefilled  # 11 = 4+4+3
    monkeypatch.undo()
    for i in range(3):
        assert together[f"n{i}"] == alone(model, ids, 5 + i), i
    assert len({tuple(together[f"n{i}"]) for i in range(3)}) == 3  # distinct streams
    assert engine.cache.lengths == [0] * 4


def test_fork_groups_wait_for_their_slots_and_survive_their_leaders_abort(gen_checkpoints):
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)
    ids = prompt(9, 2)
    engine = Engine(model, max_batch_size=3, max_len=48, prefill_chunk=4)
    engine.add_request("busy", prompt(5, 3), sampling=sampled(1), max_new_tokens=3, stop_token_ids=[])
    engine.add_request("a", ids, sampling=sampled(2), max_new_tokens=6, stop_token_ids=[])
    for name, seed in (("b", 3), ("c", 4)):
        engine.add_request(
            name, ids, sampling=sampled(seed), max_new_tokens=6, stop_token_ids=[], fork_of="a"
        )
    first = {o.request_id for o in engine.step()}
    assert "a" not in first and engine.requests["a"].slot is None  # three sequences need three slots
    engine.abort_request("a")  # before its fork: b leads c, queued in a's place
    out = drain(engine)
    assert out["b"] == alone(model, ids, 3, new=6) and out["c"] == alone(model, ids, 4, new=6)
    assert "a" not in out

    # A leader aborted while it prefills (after one of its three chunks): its first follower
    # prefills in its own slot and leads the rest.
    engine.add_request("d", ids, sampling=sampled(5), max_new_tokens=4, stop_token_ids=[])
    for name, seed in (("e", 6), ("f", 7)):
        engine.add_request(
            name, ids, sampling=sampled(seed), max_new_tokens=4, stop_token_ids=[], fork_of="d"
        )
    assert engine.step() == [] and engine.requests["d"].prefilled == 4
    engine.abort_request("d")
    out = drain(engine)
    assert set(out) == {"e", "f"}
    assert out["e"] == alone(model, ids, 6, new=4) and out["f"] == alone(model, ids, 7, new=4)
    assert engine.cache.lengths == [0, 0, 0]


def test_fork_requests_are_checked(gen_checkpoints):
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)
    engine = Engine(model, max_batch_size=2, max_len=48)
    engine.add_request("a", prompt(5), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("b", prompt(6), max_new_tokens=2, fork_of="a")
    with pytest.raises(ValueError, match="fork_of='nope'"):
        engine.add_request("b", prompt(5), max_new_tokens=2, fork_of="nope")
    engine.add_request("b", prompt(5), max_new_tokens=2, fork_of="a")
    with pytest.raises(ValueError, match="3 sequences of one prompt need as many slots; the engine has 2"):
        engine.add_request("c", prompt(5), max_new_tokens=2, fork_of="a")
    engine.abort_request("b")  # a follower leaves before its fork
    assert engine.requests["a"].followers == [] and set(drain(engine)) == {"a"}
