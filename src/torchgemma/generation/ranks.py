"""The engine across the ranks of a tensor-parallel model: rank 0 schedules, every rank steps.

Rank 0 runs the scheduler, and whatever feeds it (tokenizer, HTTP), on a ``LeaderEngine``; every
other rank runs ``follow`` on an ``Engine`` built alike over its own share of the model. Each call
that changes the engine (``add_request``, ``abort_request``, ``step``) is broadcast from rank 0 before
it runs there, and each follower makes the same call on its engine: the ranks admit the same
requests into the same slots and run the same forward passes, each rank's KV cache holding its own
heads. The logits every rank sees are the same bits (the LM head's columns are all-gathered), so
each rank chooses the same tokens: a request without a seed gets one drawn on rank 0, so that its
sampling generator is the same on every rank.

A constrained request (``constraint=``: a grammar, JSON schema, regex) is the exception: its
matcher's state (llguidance's, over the tokenizer) does not travel, and the followers need no
tokenizer. Rank 0 alone holds the constraint and masks the full vocabulary's gathered logits with
it; each token it chooses for the request (or its failure) is broadcast, and the followers take it
(``LeaderChooses`` stands in for the constraint there). Media (images, audio, video) travel as the
processor made them and every rank embeds them with its own whole copy of the towers (see the
README's "Many devices").

The calls travel as Python objects over a gloo group of their own (CPU, also beside NCCL) with a
long timeout: followers wait there while the server is idle.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from .engine import Engine

# How long a follower waits for rank 0's next call (an idle server sends none).
IDLE_TIMEOUT = timedelta(days=30)


def command_group() -> dist.ProcessGroup:
    """The group the engine's calls travel in; every rank must create it at the same point."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


class LeaderEngine:
    """Rank 0's ``Engine``: its calls broadcast to the followers, then run. Anything else is the
    engine's own (``max_batch_size``, ``has_unfinished_requests``, ...)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.group = command_group()
        choose = engine._choose

        def leading(request, logits):  # a constrained request's choice, sent to the followers
            if request.constraint is None:
                return choose(request, logits)
            try:
                token, logprobs = choose(request, logits)
            except Exception as error:
                self._send((None, f"{type(error).__name__}: {error}"))
                raise
            self._send((token, request.finish_reason))
            return token, logprobs

        engine._choose = leading

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def _send(self, call: tuple) -> None:
        dist.broadcast_object_list([call], src=dist.get_global_rank(self.group, 0), group=self.group)

    def add_request(self, request_id, input_ids, **options) -> None:
        sampling = options.get("sampling") or self.engine.generation_config.sampling()
        if sampling.seed is None:  # the same generator on every rank
            sampling = replace(sampling, seed=int(torch.randint(2**62, ())))
        options["sampling"] = sampling
        input_ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        # Here first: a request that rank 0 refuses is never sent (the followers' checks are the
        # same, less the constraint's, which rank 0 alone holds).
        self.engine.add_request(request_id, input_ids, **options)
        if options.get("constraint") is not None:
            options["constraint"] = LeaderChooses()
        self._send(("add_request", (request_id, input_ids), options))

    def abort_request(self, request_id) -> None:
        self._send(("abort_request", (request_id,), {}))
        self.engine.abort_request(request_id)

    def step(self):
        self._send(("step", (), {}))
        return self.engine.step()

    def close(self) -> None:
        """Let the followers return."""
        self._send(("stop", (), {}))


class LeaderChooses:
    """A follower's stand-in for a constrained request's constraint: rank 0 chooses the request's
    tokens and sends them (``follow``)."""

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        raise RuntimeError("a constrained request's tokens are chosen on rank 0 (generation/ranks.py)")

    def advance(self, token_id: int) -> None:
        pass


def follow(engine: Engine) -> None:
    """A follower rank's loop: the leader's calls made on ``engine`` until it closes. A call that
    fails here failed on rank 0 too (the same checks on the same inputs), which reports it."""
    group = command_group()
    choose = engine._choose

    def following(request, logits):  # a constrained request's token, as rank 0 chose it
        if request.constraint is None:
            return choose(request, logits)
        chosen = [None]
        dist.broadcast_object_list(chosen, src=dist.get_global_rank(group, 0), group=group)
        token, reason = chosen[0]
        if token is None:
            raise ValueError(f"on rank 0: {reason}")
        request.finish_reason = reason
        return token, None  # (log-probabilities are reported by rank 0)

    engine._choose = following
    while True:
        call = [None]
        dist.broadcast_object_list(call, src=dist.get_global_rank(group, 0), group=group)
        name, args, options = call[0]
        if name == "stop":
            return
        # (The leader reports the same error to its caller.)
        with contextlib.suppress(Exception):
            getattr(engine, name)(*args, **options)
