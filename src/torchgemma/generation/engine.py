"""The engine: many requests, each its own sequence in a slot of one cache, stepped together.

    engine = Engine(model, max_batch_size=8, max_len=4096)
    engine.add_request("a", prompt_ids, sampling=SamplingParams(temperature=0.7, seed=1), max_new_tokens=64)
    while engine.has_unfinished_requests():
        for output in engine.step():  # StepOutput: request_id, token_id, finished, finish_reason, ...
            ...

The names follow vLLM's ``LLMEngine``. Each ``step()``:

1. admits waiting requests into free slots (first come, first served; the rest keep waiting);
2. runs one prefill chunk (at most ``prefill_chunk`` tokens) of every request still reading its
   prompt, chunks of one length in one forward pass; a request whose prompt is now complete
   samples its first token;
3. runs one decode step over every request that already had a token, all in one forward pass;
4. frees the slots of finished requests (usable by the next step's admissions).

With a ``prefix_cache`` (``prefix_cache.py``), an admitted request first takes the keys and values
of its prompt's longest stored beginning into its slot and prefills only the rest; every whole
prefill chunk of a prompt is stored as it is computed, and its last chunk as the prompt's end, with
the state that chose its first token: the same prompt again runs no prefill at all.

A request's failure is its own: an exception while choosing its token (its sampling settings, its
constraint, non-finite logits from the model) ends that request alone with ``finish_reason
"error"``; only a failed forward pass fails the requests that shared it.

A request gets what it would get alone: its prefill chunks do not depend on the others, its rows in
the batched decode are computed row by row where the arithmetic could differ (attention spans), a
forward over several requests runs request by request where this machine's matrix products would
round a row differently in a larger call (``invariance.py``), and sampling uses its own parameters,
history and generator. On the CPU in bf16 that holds to the bit with both attention backends, on
AVX2 and (emulated) AVX-512 dispatch alike (tests/test_engine.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

import torch

from ..cache import KVCache
from ..model import Gemma
from ..model.inputs import MediaInputs
from ..model.multimodal import vision_block_ids
from ..quantization.transform import dequantizes_per_pass
from .config import GenerationConfig
from .constraints import Grammar, constrained_token, fill_masks
from .fork import admit_forks, enqueue, leave_fork, spread_forks
from .invariance import RowProbe
from .prefix_cache import PrefixCache, load_chain, media_start
from .requests import EmbeddedPrompt, Request, StepOutput, TokenLogprobs, token_logprobs
from .sampling import SamplingParams, next_token
from .speculative import SpeculativeStats, speculative_config
from .verify import speculative_decode

# 256: the prefix cache reuses prompts at multiples of the chunk, and a pass of 256 rows is as fast per
# row as one of 512 (prefix_cache.py), except where quantized products dequantize their weights once
# per pass (float activations: --activations float, CPUs without AVX-512 VNNI, GPUs): there 512
# (default_prefill_chunk).
DEFAULT_PREFILL_CHUNK = 256
DEQUANTIZING_PREFILL_CHUNK = 512


def default_prefill_chunk(model) -> int:
    """``prefill_chunk=None``: 256 tokens, or 512 for a model whose quantized products dequantize
    their weights once per pass (a 2560 x 10240 Q4 product with float activations, 1 thread: 1.28 ms
    per row in passes of 256 rows, 0.92 in passes of 512; with int16 activations 0.298 and 0.294)."""
    return DEQUANTIZING_PREFILL_CHUNK if dequantizes_per_pass(model) else DEFAULT_PREFILL_CHUNK


DEFAULT_MAX_NEW_TOKENS = 256
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs

# A request's multimodal inputs, as transformers' Gemma 4 processor names them (MediaInputs' fields).
MEDIA_INPUTS = tuple(f.name for f in fields(MediaInputs))


class Engine:
    """Continuous batching over the slots of one KV cache (see the module docstring).

    ``max_batch_size`` requests run at once, each up to ``max_len`` tokens (prompt and reply).
    ``step()`` returns a ``StepOutput`` per request it advanced (or that failed in it).
    ``generation_config`` (ours, or a ``generation_config.json`` dict) supplies the sampling
    defaults and stop ids of requests that leave them unset. ``cache`` reuses a cache made by
    ``model.make_cache`` (its slots and length then set the limits). The cache is allocated
    whole at the start (``preallocate=True``, what a server wants: no allocation while serving) or
    grows with the requests (``preallocate=False``, what one-off generation wants). If
    ``torchgemma.compile`` was applied to the model, decode steps run its compiled static-shape
    step, which needs the cache whole (it is then allocated whole at the first decode step).
    ``batch_invariant`` (None: on in bf16/fp16 on the CPU): see the module docstring.
    ``prefix_cache``: a ``PrefixCache`` to reuse prompts' beginnings from and store them in (one
    model's, shared by engines of that model; None: none); results are those without it.
    ``speculative``: speculative decoding (``speculative.py``, ``verify.py``): None, ``"ngram"`` or
    ``{"method": ..., "num_tokens": k, "model": ...}``; ``speculative_stats`` counts its drafts.
    """

    def __init__(
        self,
        model: Gemma,
        max_batch_size: int = 8,
        max_len: int = 4096,
        *,
        prefill_chunk: int | None = None,
        max_rollback: int = 0,
        generation_config: GenerationConfig | Mapping[str, Any] | None = None,
        cache: KVCache | None = None,
        preallocate: bool = True,
        greedy_head: bool = True,
        batch_invariant: bool | None = None,
        prefix_cache: PrefixCache | None = None,
        speculative: Any = None,
    ):
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(model)
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.model = model
        # A prefix cache stores each prefill chunk after its forward: the sliding rings must still
        # hold all of it then (they hold W + max_rollback positions otherwise).
        min_ring = 0 if prefix_cache is None else prefill_chunk
        # Speculative decoding (speculative.py): rejected drafts are taken back from the cache.
        self.speculation = speculative_config(speculative, model)
        self.speculative_stats = SpeculativeStats()
        if self.speculation is not None:
            max_rollback = max(max_rollback, self.speculation.num_tokens)
            min_ring = max(min_ring, self.speculation.min_ring(max_rollback))
        if cache is None:
            cache = KVCache(
                model.config.text,
                max_batch_size,
                max_len,
                max_rollback=max_rollback,
                dtype=model.dtype,
                device=model.device,
                preallocate=preallocate,
                min_ring=min_ring,
            )
        else:
            if cache.ring < min(min_ring, cache.max_len):
                raise ValueError(
                    f"the cache's sliding layers hold {cache.ring} positions, fewer than prefill_chunk "
                    f"({prefill_chunk}): a prefix cache stores whole chunks; make it with "
                    f"KVCache(..., min_ring={prefill_chunk})"
                )
            if self.speculation is not None and cache.max_rollback < self.speculation.num_tokens:
                raise ValueError(
                    f"speculative decoding of {self.speculation.num_tokens} tokens takes back up to that "
                    f"many: the cache was made with max_rollback={cache.max_rollback}"
                )
            cache.reset()
        self.cache = cache
        self.max_batch_size = cache.num_slots
        self.max_len = cache.max_len
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            if prefill_chunk % prefix_cache.block_size:
                raise ValueError(
                    f"prefill_chunk ({prefill_chunk}) must be a multiple of the prefix cache's "
                    f"block_size ({prefix_cache.block_size}): prefixes are reused at chunk starts"
                )
            prefix_cache.attach(model)
        if isinstance(generation_config, GenerationConfig):
            self.generation_config = generation_config
        else:
            self.generation_config = GenerationConfig.from_dict(generation_config or {}, model.config.text)
        self.requests: dict[Hashable, Request] = {}  # unfinished, by id
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}  # slot -> request
        self._compiled = getattr(model, "compiled_decode", None)
        if self._compiled is not None and self.speculation is not None:
            raise ValueError(
                "speculative decoding does not run with a compiled decode step (torchgemma.compile)"
            )
        # Plain greedy requests (no penalty, constraint or log-probabilities) take their token from
        # the head's argmax alone, which a quantized head finds without computing every logit
        # exactly (TextModel.greedy): the same token, ~30% less of the head's time on the CPU.
        self.greedy_head = greedy_head
        # On by default on the CPU in bf16/fp16, where tokens depend on it; float32 batches differ
        # from alone by rounding only. GPUs leave it to the caller: cuBLAS picks kernels by row
        # count, and running requests apart there would give up batching.
        if batch_invariant is None:
            batch_invariant = model.device.type == "cpu" and model.dtype in (torch.bfloat16, torch.float16)
        self.batch_invariant = batch_invariant
        self._row_probe: RowProbe | None = None
        if batch_invariant and preallocate and self.max_batch_size > 1 and self._compiled is None:
            # A server probes as it starts rather than stall its first batch (~2 s for a 262k head).
            self._row_probe = RowProbe.run(model.language_model, self.max_batch_size, model.dtype)

    # ── the contract ─────────────────────────────────────────────────────────────────────────

    def add_request(
        self,
        request_id: Hashable,
        input_ids: Sequence[int] | torch.Tensor,
        *,
        sampling: SamplingParams | None = None,
        media: MediaInputs | None = None,
        max_new_tokens: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        logprobs: int | None = None,
        constraint: Any = None,
        embedded: EmbeddedPrompt | None = None,
        fork_of: Hashable | None = None,
    ) -> None:
        """Queue a request; it joins the running batch at the next ``step()`` with a free slot.

        ``sampling`` for this request alone (None: the engine's generation config,
        ``generation_config.sampling()``); its ``seed`` gives the request its own generator.
        ``stop_token_ids=None`` means the config's eos ids. ``max_new_tokens`` (None: the config's,
        else 256) is cut to what ``max_len`` and the model's context leave after the prompt.
        ``media`` as the processor makes them, with ``mm_token_type_ids`` of shape (L,) or (1, L)
        for this prompt; or ``embedded``, the prompt already embedded. ``logprobs=n``: each of the
        request's step outputs carries the token's log-probability and the ``n`` most likely
        tokens' (log-softmax of the model's float32 logits, before any sampling filter).
        ``constraint``: a ``constraints.Grammar`` (the request gets its own state of it) or a
        ``TokenConstraint``: only the tokens it allows are drawn from (see generation/constraints.py).
        ``fork_of``: a queued request with this prompt whose prefill this one shares (``fork.py``:
        parallel sampling).
        """
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already queued or running")
        if media is not None and embedded is not None:
            raise ValueError(f"request {request_id!r}: give media or an embedded prompt, not both")
        media = media if media else None
        types = None if media is None else media.mm_token_type_ids
        if types is not None:
            media = replace(media, mm_token_type_ids=types.reshape(1, -1))
        prompt = _token_list(input_ids, self.model.config.text.vocab_size)
        if types is not None and types.numel() != len(prompt):
            raise ValueError(f"request {request_id!r}: {types.numel()} mm_token_type_ids, {len(prompt)} ids")
        context = self.model.config.text.max_position_embeddings
        room = min(self.max_len, context) - len(prompt)
        if room <= 0:
            raise ValueError(
                f"request {request_id!r}: a prompt of {len(prompt)} tokens leaves no room to generate "
                f"(max_len {self.max_len}, model context {context})"
            )
        config = self.generation_config
        if max_new_tokens is None:
            max_new_tokens = config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        if max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"request {request_id!r}: logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}"
            )
        params = config.sampling() if sampling is None else sampling
        vocab = self.model.config.text.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise ValueError(
                f"request {request_id!r}: logit_bias names token {params.logit_bias[-1][0]}, outside the "
                f"vocabulary [0, {vocab})"
            )
        stops = config.eos_token_ids if stop_token_ids is None else tuple(int(t) for t in stop_token_ids)
        seed = params.seed
        if isinstance(constraint, Grammar):
            constraint = constraint.start(stops)
        request = Request(
            request_id=request_id,
            prompt=prompt,
            params=params,
            max_new_tokens=min(max_new_tokens, room),
            stop_token_ids=frozenset(stops),
            generator=None if seed is None else torch.Generator(device=self.model.device).manual_seed(seed),
            media=media,
            embedded=embedded,
            logprobs=logprobs,
            constraint=constraint,
        )
        enqueue(self, request, fork_of)
        self.requests[request_id] = request

    def step(self) -> list[StepOutput]:
        """Advance every running request by at most one token: one ``StepOutput`` per request."""
        self._admit()
        outputs: list[StepOutput] = []
        decoding = sorted((r for r in self._running.values() if r.decoding), key=lambda r: r.slot)
        with torch.inference_mode():
            groups, failed = self._prefill_groups()
            outputs += failed
            for group in groups:
                # What depends on one request's inputs (media embedding) ran alone in
                # _prefill_groups; a shared text forward only fails for reasons that are nobody's
                # input, and may have overwritten ring columns, so its members fail (they cannot
                # simply retry), and only they.
                try:
                    members, choices = self._prefill(group)
                except Exception as error:  # noqa: BLE001 - reported per request
                    outputs += [self._fail(request, error) for request in group]
                    continue
                outputs += [self._emit_or_fail(request, choice) for request, choice in zip(members, choices)]
            if decoding and self.speculation is not None:  # drafts verified in the pass (verify.py)
                return outputs + speculative_decode(self, decoding)
            if decoding:
                # The decode forward is shared: if it fails (nobody's input), its members fail.
                try:
                    choices = self._decode(decoding)
                except Exception as error:  # noqa: BLE001 - reported per request
                    return outputs + [self._fail(request, error) for request in decoding]
                outputs += [self._emit_or_fail(request, choice) for request, choice in zip(decoding, choices)]
        return outputs

    def abort_request(self, request_id: Hashable) -> None:
        """Drop a request, waiting or running; its slot is free for the next step."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.slot is None:
            leave_fork(request, self._waiting)
        else:
            self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    # ── requests ─────────────────────────────────────────────────────────────────────────────

    def _admit(self) -> None:
        free = [s for s in range(self.max_batch_size) if s not in self._running]
        for request in admit_forks(self, free):
            if self.prefix_cache is not None and request.embedded is None:
                self._reuse(request)

    def _reuse(self, request: Request) -> None:
        """Load the longest stored beginning of the request's prompt into its slot (at a chunk
        start, before its first media token, leaving a token to prefill); store from there on. A
        prompt stored to its end (an identical earlier prompt) is taken whole, with the state that
        chooses its first token (``Request.final``)."""
        model, store, chunk = self.model, self.prefix_cache, self.prefill_chunk
        # Chains start from the signature of how their chunks are computed (see prefix_cache.py).
        blocks = self._vision_blocks(request)
        root = store.root((model.dtype, model.attention, chunk, self.batch_invariant, blocks))
        request.store_limit = media_start(model, request.prompt, request.media)
        # (The last chunk starts at `limit` in a run without the store too: (length - 1) // chunk.)
        limit = min(request.store_limit, len(request.prompt) - 1) // chunk * chunk
        whole = request.store_limit == len(request.prompt)
        chain = store.match(root, request.prompt, limit, chunk, whole)
        if chain and chain[-1].final is not None:
            request.final, request.prefix = chain[-1].final, None  # nothing left to prefill or store
        else:
            request.prefix = chain[-1].id if chain else root
        request.prefilled = request.cached = load_chain(self.cache, request.slot, chain, model.config.text)

    def _store_chunk(self, request: Request, start: int, end: int, final: torch.Tensor) -> None:
        """Store a prefill chunk just computed, if it is a whole chunk of the request's prompt;
        the prompt's last chunk (whole or not) also as its end, with ``final``, the final-normed
        hidden state of its last position."""
        chunk, parent, prompt = self.prefill_chunk, request.prefix, request.prompt
        last = end == len(prompt)
        if (
            parent is None
            or start % chunk
            or end > request.store_limit
            or (end - start != chunk and not last)
        ):
            request.prefix = None  # off the chunk grid, or at its media: nothing further is stored
            return
        slot = request.slot

        def read(a, b):
            return self.cache.read(slot, a, b)

        if end - start == chunk:
            request.prefix = self.prefix_cache.store(parent, prompt[start:end], start, read)
        if last:
            self.prefix_cache.store_end(parent, prompt[start:end], start, read, final)

    def _release(self, request: Request) -> None:
        leave_fork(request, self._waiting)
        del self._running[request.slot]
        self.cache.free(request.slot)
        request.embedded = None
        request.media = None
        request.prefix = None
        request.final = None

    def _emit_or_fail(self, request: Request, choice: torch.Tensor | int) -> StepOutput:
        """``_emit``, or if choosing this request's token raised, its failure alone."""
        try:
            return self._emit(request, choice)
        except Exception as error:  # noqa: BLE001 - this request's own sampling: it alone fails
            return self._fail(request, error)

    def _emit(self, request: Request, choice: torch.Tensor | int) -> StepOutput:
        """Pick the request's next token from its logits (1, V), or take the one already chosen
        (a plain greedy request's), and record it."""
        if isinstance(choice, int):
            return self._record(request, choice, None)
        return self._record(request, *self._choose(request, choice))

    def _choose(self, request: Request, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """The request's next token from its logits (1, V), and its log-probabilities if asked."""
        logprobs = None
        request.check_finite(logits)
        history, generated = request.penalty_inputs(logits.device)
        if request.constraint is not None:
            token, ended = constrained_token(
                request.constraint, logits, request.params, request.generator, history, generated
            )
            if ended:  # the end token of a constraint given no stop ids
                request.finish_reason = "stop"
        else:
            token = int(
                next_token(
                    logits,
                    request.params,
                    generator=request.generator,
                    history=history,
                    generated=generated,
                )[0]
            )
        if request.logprobs is not None:
            logprobs = token_logprobs(logits[0], token, request.logprobs)
        return token, logprobs

    def _record(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> StepOutput:
        """Append a chosen token to the request's output; finish the request if it ends there."""
        request.output.append(token)
        if request.finish_reason is not None or token in request.stop_token_ids:
            request.finish_reason = "stop"
        elif len(request.output) >= request.max_new_tokens:
            request.finish_reason = "length"
        finished = request.finish_reason is not None
        if finished:
            self._release(request)
            del self.requests[request.request_id]
        cached = request.cached if len(request.output) == 1 else 0
        return StepOutput(request.request_id, token, finished, request.finish_reason, logprobs, None, cached)

    # ── forward passes ───────────────────────────────────────────────────────────────────────

    def _prefill_groups(self) -> tuple[list[list[Request]], list[StepOutput]]:
        """The prefilling requests, grouped to share a forward pass: text chunks of one length
        together (no padding), each embedded prompt alone (its embeddings and image blocks); and
        the failures of requests whose media could not be embedded."""
        groups: dict[tuple, list[Request]] = {}
        failed = []
        for request in sorted(self._running.values(), key=lambda r: r.slot):
            if request.decoding or request.leader is not None:  # (a follower waits for its fork)
                continue
            if request.final is not None:  # its whole prompt from the prefix cache: no forward
                groups.setdefault(("final",), []).append(request)
                continue
            if request.embedded is None and request.media is not None:
                try:
                    self._embed_media(request)
                except Exception as error:  # noqa: BLE001 - this request's own inputs: it alone fails
                    failed.append(self._fail(request, error))
                    continue
            start, end = self._next_chunk(request)
            key = ("media", request.slot) if request.embedded is not None else ("text", end - start)
            groups.setdefault(key, []).append(request)
        return list(groups.values()), failed

    def _fail(self, request: Request, error: Exception) -> StepOutput:
        if request.slot is not None and self._running.get(request.slot) is request:
            self._release(request)
        self.requests.pop(request.request_id, None)
        cached = 0 if request.output else request.cached
        return StepOutput(request.request_id, None, True, "error", error=error, cached_tokens=cached)

    def _next_chunk(self, request: Request) -> tuple[int, int]:
        length = len(request.prompt)
        start = request.prefilled
        end = min(length, start + self.prefill_chunk)
        if request.embedded is not None and request.embedded.vision_blocks is not None:
            # An image's tokens attend to each other both ways: never split one across chunks.
            blocks = request.embedded.vision_blocks[0].tolist()
            while end < length and blocks[end] >= 0 and blocks[end] == blocks[end - 1]:
                end += 1
        return start, end

    def _rows_apart(self, rows_alone: list[int]) -> bool:
        """Whether a forward over requests of these row counts must run request by request."""
        if not self.batch_invariant or len(rows_alone) < 2 or self._compiled is not None:
            return False
        if self._row_probe is None:  # once, at the first forward over several requests
            self._row_probe = RowProbe.run(self.model.language_model, self.max_batch_size, self.model.dtype)
        return self._row_probe.split(rows_alone)

    def _prefill(self, group: list[Request]) -> tuple[list[Request], list]:
        """The next chunk of each request of a group in one forward: the requests whose prompt
        that chunk completes, and what picks each one's first token (``_choices``). A group of
        prompts the prefix cache held to their end runs no forward (their stored states)."""
        final = group[0].final is not None
        chunks = [] if final else [self._next_chunk(request) for request in group]
        if self._rows_apart([1] * len(group) if final else [end - start for start, end in chunks]):
            members, choices = [], []
            for request in group:
                done, chosen = self._prefill([request])
                members += done
                choices += chosen
            return members, choices
        if final:
            # Their first tokens from the stored states (one row each, as a decode step's rows).
            normed = torch.stack([request.final for request in group])
            for request in group:
                request.final = None
            return spread_forks(self.cache, group, self._choices(group, normed))
        model, device = self.model, self.model.device
        embedded = group[0].embedded
        if embedded is not None:  # a request with media: alone
            start, end = chunks[0]
            text_ids, embeds = embedded.text_ids[:, start:end], embedded.embeds[:, start:end]
            blocks = embedded.vision_blocks
            blocks = None if blocks is None else blocks[:, start:end]
        else:
            tokens = [request.prompt[start:end] for request, (start, end) in zip(group, chunks)]
            text_ids, embeds, blocks = model.text_ids(torch.tensor(tokens, device=device)), None, None
        normed = model.language_model(
            text_ids,
            cache=self.cache,
            keep_last=1,
            slots=[request.slot for request in group],
            inputs_embeds=embeds,
            vision_blocks=blocks,
            head=False,
        )
        done = []
        for i, (request, (start, end)) in enumerate(zip(group, chunks)):
            request.prefilled = end
            if self.prefix_cache is not None:
                self._store_chunk(request, start, end, normed[i, -1])
            if end == len(request.prompt):
                request.embedded = None
                done.append(i)
        members = [group[i] for i in done]
        return spread_forks(self.cache, members, self._choices(members, normed[done, -1]))

    def _choices(self, requests: list[Request], normed: torch.Tensor) -> list[torch.Tensor | int]:
        """For each request, from its final-normed hidden state (n, H): its greedy token where
        that is all it needs, else its float32 logits (1, V)."""
        lm = self.model.language_model
        plain = [i for i, r in enumerate(requests) if self.greedy_head and r.plain_greedy]
        if plain:
            # The argmax of NaN logits is token 0, forever: a row whose hidden state is not finite
            # takes the logits path instead, where _emit refuses it with the reason (H values per
            # row, not V, for everyone else).
            finite = torch.isfinite(normed[plain]).all(dim=-1).tolist()
            plain = [i for i, ok in zip(plain, finite) if ok]
        rest = [i for i in range(len(requests)) if i not in plain]
        if self.speculation is not None and self.speculation.drafter.needs_hidden:
            for request, hidden in zip(requests, normed):
                request.hidden = hidden  # what an MTP drafter reads next (speculative.py)
        choices: list[torch.Tensor | int] = [0] * len(requests)
        if plain:
            for i, token in zip(plain, lm.greedy(normed[plain]).tolist()):
                choices[i] = token
        if rest:
            logits = lm.logits(normed[rest]).float()
            for j, i in enumerate(rest):
                choices[i] = logits[j : j + 1]
            # The constrained rows' masks, all at once (rows without a constraint compute none).
            fill_masks([requests[i].constraint for i in rest if requests[i].constraint is not None])
        return choices

    def _embed_media(self, request: Request) -> None:
        model = self.model
        media = request.media.as_dict()
        types = media.pop("mm_token_type_ids", None)
        ids = torch.tensor([request.prompt], device=model.device)
        embeds, text_ids = model.embed_multimodal(ids, **media)
        blocks = vision_block_ids(types.to(model.device)) if self._vision_blocks(request) else None
        request.embedded = EmbeddedPrompt(embeds, text_ids, blocks)

    def _vision_blocks(self, request: Request) -> bool:
        """Whether the request's prompt runs with image blocks (bidirectional vision attention)."""
        types = None if request.media is None else request.media.mm_token_type_ids
        return types is not None and self.model.config.text.use_bidirectional_attention == "vision"

    def _decode(self, requests: list[Request]) -> list[torch.Tensor | int]:
        """One token for each decoding request, in one forward pass: what picks each one's token
        (``_choices``)."""
        if self._rows_apart([1] * len(requests)):
            return [choice for request in requests for choice in self._decode([request])]
        device = self.model.device
        slots = [r.slot for r in requests]
        last = [r.output[-1] for r in requests]
        if self._compiled is None:
            tokens = self.model.text_ids(torch.tensor(last, device=device)[:, None])
            normed = self.model.language_model(tokens, cache=self.cache, slots=slots, head=False)
            return self._choices(requests, normed[:, -1])
        # The compiled step runs every slot with static shapes; idle slots change nothing.
        size = self.cache.num_slots
        tokens = torch.zeros(size, 1, dtype=torch.long)
        active = torch.zeros(size, dtype=torch.bool)
        tokens[slots, 0] = torch.tensor(last)
        active[slots] = True
        positions = torch.tensor(self.cache.lengths)
        tokens = self.model.text_ids(tokens.to(device))
        logits = self._compiled(self.cache, tokens, positions.to(device), active.to(device))
        self.cache.advance(slots)
        return [logits[slot : slot + 1] for slot in slots]


def _token_list(input_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(
                f"input_ids must be a list of ints, got a tensor of shape {tuple(input_ids.shape)}"
            )
        input_ids = input_ids.tolist()
    prompt = list(input_ids)
    if not prompt:
        raise ValueError("a request needs at least one prompt token")
    for i, token in enumerate(prompt):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"prompt token {i} is {token!r}: token ids are ints in [0, {vocab_size})")
    return prompt
