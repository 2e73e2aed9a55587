"""Speculative decoding (generation/speculative.py, verify.py): greedy output equals the output
without it, token for token, and bit for bit where the products are row-invariant.

The drafts come from prompt lookup and from an "oracle" drafter that knows the reply without
speculation and proposes it with every third proposal's last token wrong: most drafts are accepted,
some are rejected (a rollback), over replies several times the tiny models' sliding window (5)."""

from __future__ import annotations

import pytest
import torch

import torchgemma
import torchgemma.generation.invariance as invariance
from checkpoints import STYLES
from row_kernels import RowByRowProducts
from torchgemma import Engine, SamplingParams
from torchgemma.generation import generate, speculative
from torchgemma.generation.prefix_cache import PrefixCache
from torchgemma.generation.speculative import (
    MAX_NUM_TOKENS,
    Adaptive,
    DraftRequest,
    NgramDrafter,
    NgramIndex,
    SpeculativeConfig,
    parse_cli,
    speculative_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(sampling=SamplingParams(temperature=0), stop_token_ids=[])
PROMPTS = {"a": 9, "b": 3, "c": 14}  # ragged: shorter and longer than the window (5)
NEW = {"a": 30, "b": 12, "c": 25}


class Recording(Engine):
    """Keeps every logits row a token was chosen from (no greedy head: every row has logits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, greedy_head=False, **kwargs)
        self.logits: dict = {}

    def _emit(self, request, choice):
        self.logits.setdefault(request.request_id, []).append(choice[0].clone())
        return super()._emit(request, choice)


class Oracle:
    """Proposes the reference continuation of the request's tokens, 1 to ``num_tokens`` of them by
    turns (ragged drafts in one pass), every third proposal's last token wrong (so some are
    rejected)."""

    needs_hidden = False

    def __init__(self, references: list[list[int]], vocab: int = 300):
        self.references, self.vocab, self.calls = references, vocab, 0

    def propose(self, requests: list[DraftRequest], cache) -> list[list[int]]:
        out = []
        for request in requests:
            tokens = list(request.tokens)
            assert cache.lengths[request.slot] == len(tokens) - 1  # the slot holds tokens[:-1]
            reference = next(r for r in self.references if r[: len(tokens)] == tokens)
            self.calls += 1
            # Ragged: 1 to num_tokens drafts, by turns.
            length = request.num_tokens - self.calls % request.num_tokens
            draft = reference[len(tokens) : len(tokens) + length]
            if self.calls % 3 == 0 and draft:
                draft[-1] = (draft[-1] + 1) % self.vocab
            out.append(draft)
        return out


def prompts(seed: int = 0) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {r: torch.randint(3, 300, (n,), generator=gen).tolist() for r, n in PROMPTS.items()}


def run(engine: Engine, requests: dict, new: dict = NEW, **kwargs) -> dict[str, list[int]]:
    for name, prompt in requests.items():
        engine.add_request(name, prompt, max_new_tokens=new[name], **{**GREEDY, **kwargs})
    out: dict[str, list[int]] = {}
    done = set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            assert output.request_id not in done, "a token after the request finished"
            out.setdefault(output.request_id, []).append(output.token_id)
            if output.finished:
                done.add(output.request_id)
    return out


def with_and_without(model, drafter_for, engine=Recording, **engine_args):
    """The reference run, then the run with the drafter ``drafter_for(references)`` gives."""
    requests = prompts()
    plain = engine(model, max_batch_size=3, max_len=64, prefill_chunk=4, **engine_args)
    reference = run(plain, requests)
    references = [requests[r] + reference[r] for r in requests]
    drafted = engine(
        model,
        max_batch_size=3,
        max_len=64,
        prefill_chunk=4,
        speculative={"method": "mtp", "model": drafter_for(references), "num_tokens": 3},
        **engine_args,
    )
    return plain, reference, drafted, run(drafted, requests)


@pytest.fixture
def row_invariant_bf16(monkeypatch):
    """bf16 products whose rows get the bits they get alone, as on CPUs without AVX-512: emulated
    by computing every product a row at a time (``row_kernels.RowByRowProducts``; torch's backends
    as they are); the row probe is told this machine has no oneDNN switch."""
    monkeypatch.setattr(invariance, "onednn_takes_reduced_precision", lambda: False)
    with RowByRowProducts():
        yield


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
@pytest.mark.parametrize("style", list(STYLES))
def test_bf16_logits_are_bit_identical_with_drafts(gen_checkpoints, style, backend, row_invariant_bf16):
    """Three ragged requests in one batch, drafts accepted and rejected across the sliding window's
    edge: every token and every logits row it was chosen from equal the run without speculation, to
    the bit (each verify query attends as its decode step; the products are row-invariant here)."""
    model = torchgemma.load(gen_checkpoints[style], dtype=torch.bfloat16, attention=backend)
    plain, reference, drafted, tokens = with_and_without(model, Oracle)
    assert tokens == reference
    for request in reference:
        assert torch.equal(torch.stack(drafted.logits[request]), torch.stack(plain.logits[request])), request
    stats = drafted.speculative_stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # some kept, some rolled back
    assert stats.verify_passes < sum(NEW.values()) // 2


@pytest.mark.parametrize("quantize", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_quantized_float32_logits_are_bit_identical(gen_checkpoints, quantize):
    """A quantized target (31B style: every product quantized) in float32: the row kernels below
    DENSE_ROWS give each verify row a decode step's bits."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32, quantize=quantize)
    plain, reference, drafted, tokens = with_and_without(model, Oracle)
    assert tokens == reference
    for request in reference:
        assert torch.equal(torch.stack(drafted.logits[request]), torch.stack(plain.logits[request])), request


@pytest.mark.parametrize("style", list(STYLES))
def test_float32_tokens_are_identical(gen_checkpoints, style):
    """float32 with MKL's dense products (which round 1, 2-3 and 4+ rows differently): the logits
    agree to rounding, the tokens exactly (no near-tie on these models), prompt lookup and oracle."""
    model = torchgemma.load(gen_checkpoints[style], dtype=torch.float32)
    plain, reference, drafted, tokens = with_and_without(model, Oracle)
    assert tokens == reference
    for request in reference:
        ours, theirs = torch.stack(drafted.logits[request]), torch.stack(plain.logits[request])
        assert (ours - theirs).abs().max() <= 5e-4  # as tests/test_engine.py's batched float32
    looked_up = run(
        Engine(model, max_batch_size=3, max_len=64, prefill_chunk=4, speculative="ngram"), prompts()
    )
    assert looked_up == reference


def test_batch_invariant_bf16_stays_bit_identical(gen_checkpoints):
    """A batch-invariant engine (bf16 on the CPU by default) keeps verify calls below the row
    probe's first boundary (none at all where it is 2 rows: tiny models on AVX-512 CPUs), so its
    logits stay those of the run without speculation whatever the CPU."""
    model = torchgemma.load(gen_checkpoints["e2b"], dtype=torch.bfloat16)
    plain, reference, drafted, tokens = with_and_without(model, Oracle)
    assert drafted.batch_invariant
    assert tokens == reference
    for request in reference:
        assert torch.equal(torch.stack(drafted.logits[request]), torch.stack(plain.logits[request])), request


def test_stops_budget_and_logprobs_as_without(gen_checkpoints):
    """A stop token met inside an accepted run ends the request there; no token past
    max_new_tokens; every output (token, finish reason, log-probabilities) as without speculation."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32, quantize="int8")
    requests = prompts()
    reference = run(Engine(model, max_batch_size=3, max_len=64, prefill_chunk=4), requests)
    references = [requests[r] + reference[r] for r in requests]

    def both(new: dict, **kwargs) -> list[dict]:
        tables = []
        for spec in (None, {"method": "mtp", "model": Oracle(references), "num_tokens": 4}):
            engine = Engine(model, max_batch_size=3, max_len=64, prefill_chunk=4, speculative=spec)
            for name, prompt in requests.items():
                engine.add_request(name, prompt, max_new_tokens=new[name], **kwargs)
            table: dict = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    table.setdefault(o.request_id, []).append((o.token_id, o.finish_reason, o.logprobs))
            tables.append(table)
        return tables

    stop = reference["a"][12]  # a token inside the oracle's accepted runs
    plain, drafted = both(NEW, sampling=SamplingParams(temperature=0), stop_token_ids=[stop], logprobs=3)
    assert drafted == plain
    assert drafted["a"][-1][:2] == (stop, "stop") and len(drafted["a"]) <= 13
    budget = {"a": 30, "b": 5, "c": 7}
    plain, drafted = both(budget, sampling=SamplingParams(temperature=0), stop_token_ids=[], logprobs=0)
    assert drafted == plain
    assert {name: len(outputs) for name, outputs in drafted.items()} == budget


def test_prefix_cache_with_speculation(gen_checkpoints):
    """Prompts stored and reused by a prefix cache, decoded with prompt lookup: the same tokens."""
    model = torchgemma.load(gen_checkpoints["e2b"], dtype=torch.float32)
    requests = prompts()
    reference = run(Engine(model, max_batch_size=3, max_len=64, prefill_chunk=4), requests)
    store = PrefixCache(max_bytes=1 << 20, block_size=4)
    for _ in range(2):  # the second round reuses the first's prompts
        engine = Engine(
            model, max_batch_size=3, max_len=64, prefill_chunk=4, prefix_cache=store, speculative="ngram"
        )
        assert run(engine, requests) == reference
    assert store.stats()["hits"] > 0


def test_generate_takes_speculative(gen_checkpoints):
    model = torchgemma.load(gen_checkpoints["26b"], dtype=torch.float32)
    requests = list(prompts().values())
    plain = generate(
        model, requests, max_new_tokens=20, sampling=SamplingParams(temperature=0), stop_token_ids=[]
    )
    spec = generate(
        model,
        requests,
        max_new_tokens=20,
        sampling=SamplingParams(temperature=0),
        stop_token_ids=[],
        speculative={"method": "ngram", "num_tokens": 2},
    )
    assert spec == plain


# ── prompt lookup, adaptive drafting ─────────────────────────────────────────────────────────


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(max_n=3, min_n=1)
    index.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    # Suffix (7, 2, 3)? not seen before; (2, 3) last seen at 5-6, followed by 4, 5, 7.
    assert index.propose(3) == [4, 5, 7]
    index.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3, 4, 5, 7])
    # (5, 7) ... the trigram (4, 5, 7) last seen at 7-9, followed by 2, 3, 4, 5, then its own span.
    assert index.propose(6) == [2, 3, 4, 5, 7, 2]
    index.extend([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3, 4, 5, 7, 8])
    assert index.propose(4) == []  # 8 never seen


def test_ngram_index_grows_with_the_new_tokens_only():
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 6, (200,), generator=gen).tolist()
    grown = NgramIndex()
    for end in range(1, len(seq) + 1):
        grown.extend(seq[:end])
        whole = NgramIndex()
        whole.extend(seq[:end])
        assert grown.latest == whole.latest
        assert grown.propose(4) == whole.propose(4)


def test_ngram_drafter_starts_over_for_a_new_sequence_in_a_slot():
    drafter = NgramDrafter()
    (first,) = drafter.propose([DraftRequest([5, 6, 7, 5, 6], 2, slot=0)], cache=None)
    assert first == [7, 5]
    (second,) = drafter.propose([DraftRequest([1, 2, 1], 2, slot=0)], cache=None)  # another request
    assert second == [2, 1]


def test_adaptive_drafting_backs_off_when_drafts_fail():
    state = Adaptive()
    assert state.budget(4) == 4
    budgets = []
    for _ in range(12):
        budget = state.budget(4)
        budgets.append(budget)
        if budget:
            state.update(budget, 0)
    assert budgets.count(0) >= 6  # paused more and more
    state.update(2, 2)
    assert state.pause == 1


# ── options ──────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("beam", ValueError, "method must be one of"),
        ({"method": "ngram", "num_tokens": 0}, ValueError, "num_tokens must be in"),
        ({"method": "ngram", "num_tokens": MAX_NUM_TOKENS + 1}, ValueError, "num_tokens must be in"),
        ({"method": "ngram", "num_tokens": "4"}, TypeError, "num_tokens must be an integer"),
        ({"method": "ngram", "num_tokens": True}, TypeError, "num_tokens must be an integer"),
        ({"method": "ngram", "k": 4}, ValueError, "unknown key"),
        ({"method": "ngram", "model": "x"}, ValueError, "takes no 'model'"),
        ({"method": "mtp"}, ValueError, "needs 'model'"),
        ({"method": "mtp", "model": 3}, TypeError, "must be a checkpoint"),
        (4, TypeError, "speculative must be"),
    ],
)
def test_bad_options_are_refused(value, error, match):
    with pytest.raises(error, match=match):
        speculative_config(value)


def test_options_parse():
    assert speculative_config(None) is None
    config = speculative_config("ngram")
    assert (config.method, config.num_tokens) == ("ngram", 4)
    assert isinstance(config.drafter, NgramDrafter)
    again = speculative_config(config)  # an engine of its own gets its own indexes
    assert isinstance(again, SpeculativeConfig) and again.drafter is not config.drafter
    oracle = Oracle([])
    assert speculative_config({"method": "mtp", "model": oracle, "num_tokens": 2}).drafter is oracle
    assert parse_cli("ngram", 3) == {"method": "ngram", "num_tokens": 3}
    assert parse_cli("mtp:org/drafter", None) == {"method": "mtp", "model": "org/drafter"}
    assert parse_cli(None, None) is None
    with pytest.raises(ValueError, match="goes with --speculative"):
        parse_cli(None, 3)


def test_a_checkpoint_source_goes_to_the_drafter_loader(monkeypatch):
    calls = []
    monkeypatch.setattr(
        speculative, "load_drafter", lambda source, target: calls.append((source, target)) or Oracle([])
    )
    config = speculative_config({"method": "mtp", "model": "some/drafter"}, target="target model")
    assert calls == [("some/drafter", "target model")] and isinstance(config.drafter, Oracle)


def test_engine_checks_the_cache_rollback(gen_checkpoints):
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)
    cache = model.make_cache(2, 32, max_rollback=2)
    with pytest.raises(ValueError, match="max_rollback"):
        Engine(model, cache=cache, speculative={"method": "ngram", "num_tokens": 4})
    engine = Engine(model, max_batch_size=1, max_len=32, speculative={"method": "ngram", "num_tokens": 5})
    assert engine.cache.max_rollback >= 5


@pytest.mark.parametrize("subcommand", ["generate", "chat", "serve"])
def test_cli_flags_reach_the_llm(subcommand, monkeypatch, capsys):
    """--speculative and --num-speculative-tokens become LLM(speculative=...); bad values fail with
    argparse's message before anything loads."""
    from torchgemma.cli import main

    seen = []

    def fake_llm(*args, **kwargs):
        seen.append(kwargs.get("speculative", "missing"))
        raise RuntimeError("stop here")

    monkeypatch.setattr("torchgemma.llm.LLM", fake_llm)
    monkeypatch.setattr("torchgemma.cli.chat.check_chat_template", lambda args: None)  # reads the source
    tail = ["prompt"] if subcommand == "generate" else []
    flag_sets = (
        ["--speculative", "ngram", "--num-speculative-tokens", "3"],
        ["--speculative", "mtp:org/d"],
        [],
    )
    for flags in flag_sets:
        main([subcommand, "--model", "never-loaded", *flags, *tail])
    assert seen == [{"method": "ngram", "num_tokens": 3}, {"method": "mtp", "model": "org/d"}, None]
    capsys.readouterr()
    for flags in (["--speculative", "beam"], ["--speculative", "mtp"], ["--num-speculative-tokens", "0"]):
        with pytest.raises(SystemExit):
            main([subcommand, "--model", "never-loaded", *flags, *tail])
        assert "speculative" in capsys.readouterr().err


class EvenTokens:
    """A ``TokenConstraint`` allowing even token ids only."""

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        return torch.arange(vocab_size) % 2 == 0

    def advance(self, token_id: int) -> None:
        assert token_id % 2 == 0


def test_a_constrained_request_does_not_draft(gen_checkpoints):
    """A constrained request beside one that drafts: it is never drafted for, and both get the
    tokens they get without speculation."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32, quantize="int8")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    outs = []
    for spec in (None, {"method": "ngram", "num_tokens": 3}):
        engine = Engine(model, max_batch_size=2, max_len=64, speculative=spec)
        engine.add_request("free", prompt, max_new_tokens=24, **GREEDY)
        engine.add_request("even", prompt, max_new_tokens=24, constraint=EvenTokens(), **GREEDY)
        asked = []
        if spec is not None:
            propose = engine.speculation.drafter.propose

            def spy(requests, cache, propose=propose, asked=asked):
                asked.extend(r.slot for r in requests)
                return propose(requests, cache)

            engine.speculation.drafter.propose = spy
        out: dict = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).append(o.token_id)
        outs.append(out)
    assert outs[0] == outs[1]
    assert all(t % 2 == 0 for t in outs[1]["even"])
    assert asked and set(asked) == {0}  # slot 0: "free"; "even" (slot 1) never asked for drafts
    assert engine.speculative_stats.drafted_tokens > 0
