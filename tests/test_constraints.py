"""The JSON-object constraint: its byte recognizer against Python's json, and the engine's redraws."""

from __future__ import annotations

import json
import random

import pytest
import torch

import torchgemma
from torchgemma import Engine
from torchgemma.generation.constraints import MAX_WHITESPACE, JSONObject, JSONPrefix


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] * 2 if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-(10**6), 10**6)
    if kind == "float":
        return rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-8, 8)
    if kind == "str":
        return "".join(rng.choice('ab "\\/\n\t\u00e9\u4e2d}{,:') for _ in range(rng.randint(0, 6)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def accepts(text: str) -> bool:
    return JSONPrefix().feed_all(text.encode())


def test_every_prefix_of_json_objects_is_accepted():
    rng = random.Random(0)
    for _ in range(300):
        document = {f"key{i}": random_value(rng) for i in range(rng.randint(0, 4))}
        text = json.dumps(document, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        prefix = JSONPrefix()
        for i, byte in enumerate(text.encode()):
            assert prefix.feed(byte), (text, i)
            assert prefix.complete == (i == len(text.encode()) - 1)
        assert prefix.feed_all(b" \n")  # trailing whitespace is fine


@pytest.mark.parametrize(
    "text",
    [
        "[1]",  # the top level must be an object
        '"x"',
        '{"a":01}',  # leading zero
        '{"a":1,}',  # trailing comma
        '{"a" 1}',  # missing colon
        "{a:1}",  # unquoted key
        '{"a":tru}',
        '{"a":truex}',
        '{"a":-}',
        '{"a":1.}',
        '{"a":1e}',
        '{"a":.5}',
        '{"a":"\x01"}',  # control characters must be escaped
        '{"a":"\\x"}',  # unknown escape
        '{"a":"\\u12g4"}',
        '{"a":[1}',  # mismatched close
        '{"a":1}}',
        '{"a":1} x',  # anything after the object
        "{" + " " * (MAX_WHITESPACE + 1),  # endless padding
    ],
)
def test_invalid_text_is_refused(text):
    assert not accepts(text)


def test_constraint_over_a_vocabulary():
    vocabulary = [b"{", b'"a"', b":", b" 1", b"}", None, b"x", b"1}"]
    stop = 5
    constraint = JSONObject(vocabulary, stop_ids=[stop])
    assert not constraint.allows(stop) and not constraint.allows(6) and not constraint.allows(1)
    for token in (0, 1, 2):
        assert constraint.allows(token)
        constraint.advance(token)
    assert constraint.allows(3) and constraint.allows(7) and not constraint.allows(4)
    constraint.advance(7)
    assert constraint.complete and constraint.allows(stop) and not constraint.allows(0)
    with pytest.raises(ValueError, match="does not continue"):
        constraint.advance(0)


def test_engine_redraws_until_the_constraint_allows(gen_checkpoints):
    """A constraint that allows only a fixed sequence of ids forces exactly that output, greedy or
    sampled, and the last step's stop token only once it is allowed."""
    model = torchgemma.load(gen_checkpoints["31b"], dtype=torch.float32)

    class Script:
        def __init__(self, ids, stop):
            self.ids, self.stop, self.at = ids, stop, 0

        @property
        def complete(self):
            return self.at == len(self.ids)

        def allows(self, token):
            return token == self.stop if self.complete else token == self.ids[self.at]

        def advance(self, token):
            self.at += token != self.stop

    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=4)):
        engine = Engine(model, max_batch_size=1, max_len=40)
        engine.add_request(
            "r",
            [5, 6, 7],
            max_new_tokens=10,
            stop_token_ids=[1],
            constraint=Script([42, 43, 44], 1),
            sampling=engine.generation_config.sampling(**sampling),
        )
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [output.token_id for output in engine.step()]
        assert tokens == [42, 43, 44, 1]


def test_allowed_tokens_are_exactly_what_allows_accepts():
    """JSONObject.allowed_tokens (a walk of the sorted vocabulary, remembered per recognizer state)
    equals asking ``allows`` about every id, stop ids included, before and after the object closes."""
    vocabulary = [b"{", b'"a"', b":", b" 1", b"}", None, b"x", b"1}", b" ", b'"', b"ab", b'a"', b"{}", b"}}"]
    stop = 5
    for text_ids in ([], [0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 7], [0, 9], [0, 9, 10]):
        for _ in range(2):  # the second time from what the first walk remembered
            constraint = JSONObject(vocabulary, stop_ids=[stop])
            for token in text_ids:
                constraint.advance(token)
            expected = [t for t in range(len(vocabulary)) if constraint.allows(t)]
            assert sorted(constraint.allowed_tokens(10**6)) == expected, text_ids
