"""Parallel sampling (OpenAI's ``n``): one prefill, then its cache forked into ``n`` sequences.

A request added with ``fork_of=leader`` (``Engine.add_request``) is a *follower*: it has its
leader's prompt, and never prefills it. The leader and its followers are admitted together (a slot
each, or none of them waits behind the others' slots); the followers wait while the leader
prefills; when the leader's last prompt chunk has run, its cache slot is copied into each
follower's slot (``fork_slot``) and every one of them picks its first token from the leader's
last-position logits, each with its own sampling settings and generator. From there on they are
ordinary decoding requests.

A follower therefore produces exactly what it would produce alone: its cache holds the same keys
and values its own prefill would have written (the leader's prefill is computed as any request's
is, whatever shares its forward pass), and its tokens come from the same logits. Only the prompt's
compute is shared: ``n`` sequences cost one prefill, not ``n`` (a prefix cache, where there is one,
reuses whole ``prefill_chunk`` blocks only, so it would recompute each prompt's last partial chunk
per sequence).

If the leader leaves before the fork (aborted, or its prefill failed), its first follower takes its
place (queued where it was, or prefilling in its own slot) and leads the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from ..cache import FullLayerCache, KVCache
from .requests import Request


def enqueue(engine, request: Request, leader_id: Hashable | None) -> None:
    """Queue ``request`` on ``engine`` (an ``Engine``), or with ``leader_id``, make it a follower of
    that queued request (see the module docstring)."""
    if leader_id is None:
        engine._waiting.append(request)
        return
    leader = engine.requests.get(leader_id)
    if leader is None or leader.slot is not None or leader.leader is not None:
        raise ValueError(
            f"request {request.request_id!r}: fork_of={leader_id!r} must name a request still waiting "
            "for a slot that is not itself a follower (add the leader, then its followers, before a step)"
        )
    if request.prompt != leader.prompt:
        raise ValueError(f"request {request.request_id!r}: a follower has its leader's prompt")
    if request.embedded is not None:
        raise ValueError(f"request {request.request_id!r}: a follower takes no embedded prompt")
    if len(leader.followers) + 2 > engine.max_batch_size:
        raise ValueError(
            f"request {request.request_id!r}: {len(leader.followers) + 2} sequences of one prompt need as "
            f"many slots; the engine has {engine.max_batch_size}"
        )
    request.leader = leader
    leader.followers.append(request)


def admit_forks(engine, free: list[int]) -> list[Request]:
    """Take waiting requests, first come first served, while there are slots for each one and its
    followers: each gets a free slot (taken from ``free``); the leaders, which prefill, are returned."""
    leaders = []
    waiting: deque[Request] = engine._waiting
    while waiting and len(free) > len(waiting[0].followers):
        request = waiting.popleft()
        for member in (request, *request.followers):
            member.slot = free.pop(0)
            engine.cache.free(member.slot)
            engine._running[member.slot] = member
        leaders.append(request)
    return leaders


def spread_forks(cache: KVCache, members: list[Request], choices: list) -> tuple[list[Request], list]:
    """After a prefill forward: the requests whose prompt it completed and what picks each one's
    first token, with every such leader's followers forked from it added, sharing its choice."""
    if not any(member.followers for member in members):
        return members, choices
    out_members, out_choices = [], []
    for member, choice in zip(members, choices):
        out_members.append(member)
        out_choices.append(choice)
        for follower in member.followers:
            fork_slot(cache, member.slot, follower.slot)
            follower.prefilled = len(follower.prompt)
            follower.cached = member.cached
            follower.leader = None
            follower.media = None
            out_members.append(follower)
            out_choices.append(choice)
        member.followers = []
    return out_members, out_choices


def leave_fork(request: Request, waiting: deque[Request]) -> None:
    """Take ``request`` out of its fork group, and out of ``waiting`` if it was queued there: a
    follower leaves its leader; a leader that leaves before the fork hands its place (in the queue,
    or its followers' slots, where its first follower now prefills) to its first follower."""
    leader = request.leader
    if leader is not None:
        leader.followers.remove(request)
        request.leader = None
        return
    heir = None
    if request.followers:
        heir, *rest = request.followers
        heir.leader, heir.followers = None, rest
        for follower in rest:
            follower.leader = heir
        request.followers = []
    if request.slot is None:
        index = waiting.index(request)
        if heir is None:
            del waiting[index]
        else:
            waiting[index] = heir


def fork_slot(cache: KVCache, source: int, target: int) -> None:
    """Make slot ``target`` hold what slot ``source`` holds: its keys and values in every layer (the
    positions a full layer holds; a sliding layer's whole ring) and its length."""
    length = cache.lengths[source]
    cache.reserve(length)
    for layer in cache.layers:
        if layer is None:
            continue
        if isinstance(layer, FullLayerCache):
            layer.keys[target, :, :length] = layer.keys[source, :, :length]
            layer.values[target, :, :length] = layer.values[source, :, :length]
        else:
            layer.keys[target] = layer.keys[source]
            layer.values[target] = layer.values[source]
    cache.lengths[target] = length
    # How far the target may roll back: as far as the source may (the ring holds the same keys).
    cache._high_water[target] = cache._high_water[source]
