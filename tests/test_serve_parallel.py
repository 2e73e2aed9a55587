"""`torchgemma serve --tensor-parallel-size N` builds the engine one process builds: the same flags
reach it (speculative decoding, which it once dropped, included). In one process, without torchrun:
`serve.run` runs twice up to `create_app`, once as one process and once as rank 0 of N=2 (the
process group and the rank-0 wrapper stood in for), and the two engines are compared setting by
setting. That the ranks then run in step is tests/test_distributed_media.py's (slow, torchrun)."""

from __future__ import annotations

import pytest

from torchgemma.cli import build_parser, common, serve
from torchgemma.generation import ranks
from torchgemma.serving import app as serving_app

pytestmark = pytest.mark.usefixtures("one_thread")
CREATE_APP = serving_app.create_app


class Reached(Exception):
    """Stops `serve.run` at `create_app`, before uvicorn, logging and signal handlers."""


class RankZero:
    """Stands in for `LeaderEngine` (whose broadcasts need a process group): the engine as built,
    its attributes read through."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def settings(engine) -> dict:
    """What the server's flags shape in an engine."""
    cache, store, speculation = engine.cache, engine.prefix_cache, engine.speculation
    return {
        "max_batch_size": engine.max_batch_size,
        "max_len": engine.max_len,
        "prefill_chunk": engine.prefill_chunk,
        "prefix_cache_bytes": None if store is None else store.max_bytes,
        "speculation": None
        if speculation is None
        else (speculation.method, speculation.num_tokens, type(speculation.drafter).__name__),
        "max_rollback": cache.max_rollback,
        "ring": cache.ring,
        "batch_invariant": engine.batch_invariant,
        "generation_config": engine.generation_config,
    }


def served_engine(monkeypatch, argv: list[str]):
    """`serve.run` on ``argv`` up to `create_app`: the engine its app would serve and create_app's
    keywords."""
    reached = {}

    def create_app(llm, **options):
        app = CREATE_APP(llm, **options)
        reached.update(options, app=app)
        raise Reached

    monkeypatch.setattr(serving_app, "create_app", create_app)
    # The ranks' process group is not there: load as one process, and wrap as rank 0 would.
    monkeypatch.setattr(common, "parallel_options", lambda args: {})
    monkeypatch.setattr(ranks, "LeaderEngine", RankZero)
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(Reached):
        serve.run(args)
    state = reached["app"].state.server
    state.close()
    engine = state.runner.engine
    return engine.engine if isinstance(engine, RankZero) else engine, reached


@pytest.mark.parametrize(
    "flags",
    [
        ["--speculative", "ngram", "--num-speculative-tokens", "3"],
        ["--prefill-chunk", "64", "--prefix-cache-gb", "0.25", "--max-batch-size", "3"],
    ],
    ids=["speculative", "batch-and-caches"],
)
def test_ranks_build_the_engine_one_process_builds(monkeypatch, llm_checkpoint, flags):
    """The engine of `serve --tensor-parallel-size 2 FLAGS` (rank 0's, and each follower's: one
    builder) has every setting of `serve FLAGS`' engine; both differ from the defaults where the
    flags say (so that a flag dropped on both paths fails too)."""
    common_flags = ["--model", str(llm_checkpoint), "--threads", "1", "--max-len", "96", *flags]
    one, _ = served_engine(monkeypatch, common_flags)
    two, options = served_engine(monkeypatch, [*common_flags, "--tensor-parallel-size", "2"])
    assert isinstance(options["engine"], RankZero)  # the ranks' engine, not one create_app built
    assert settings(two) == settings(one)
    assert one.max_len == 96
    if "--speculative" in flags:
        assert settings(one)["speculation"] == ("ngram", 3, "NgramDrafter")
        assert two.speculation.drafter is not one.speculation.drafter  # each engine its own indexes
    else:
        assert (one.prefill_chunk, one.max_batch_size, one.speculation) == (64, 3, None)
        assert one.prefix_cache.max_bytes == 2**28


def test_the_engine_flags_are_listed_once():
    """Every keyword of `server_engine` but the model comes from `serve.engine_settings`, which
    both paths pass: a new engine setting cannot reach one path only."""
    import inspect

    from torchgemma.serving.state import server_engine

    args = build_parser().parse_args(["serve", "--model", "m"])
    keywords = [name for name in inspect.signature(server_engine).parameters if name != "llm"]
    assert sorted(serve.engine_settings(args)) == sorted(keywords)
