"""The reply grammar (torchgemma.replies): arguments, whole replies, streams split every way, stop strings."""

from __future__ import annotations

import random
import re

import pytest

from torchgemma.replies import (
    SPECIAL_TOKENS,
    ArgumentSyntaxError,
    Delta,
    ReplyStream,
    StopStrings,
    ToolCall,
    forced_call_prefix,
    parse_arguments,
    parse_reply,
    template_tool_call,
)

Q = '<|"|>'  # Gemma's string delimiter
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


# --- Arguments -----------------------------------------------------------------------------------


def test_arguments_empty_object():
    assert parse_arguments("{}") == {}


def test_arguments_nested_objects_and_arrays():
    text = f"{{a:[{{b:{{c:[1,2]}}}},{{d:[]}}],e:{{}},f:[[{Q}x{Q}],[]]}}"
    assert parse_arguments(text) == {"a": [{"b": {"c": [1, 2]}}, {"d": []}], "e": {}, "f": [["x"], []]}


def test_arguments_numbers_keep_their_json_type():
    parsed = parse_arguments("{i:42,z:0,f:3.5,n:-7,e:1e-05,E:-2.5E+3,big:12345678901234567890}")
    assert parsed == {
        "i": 42,
        "z": 0,
        "f": 3.5,
        "n": -7,
        "e": 1e-05,
        "E": -2500.0,
        "big": 12345678901234567890,
    }
    assert [type(parsed[k]) for k in ("i", "z", "f", "n", "e", "E")] == [int, int, float, int, float, float]


def test_arguments_literals():
    assert parse_arguments("{t:true,f:false,n:null,l:[true,null]}") == {
        "t": True,
        "f": False,
        "n": None,
        "l": [True, None],
    }


def test_arguments_strings_hold_anything_but_the_delimiter():
    text = f'{{s:{Q}a{{b}},c:d "q" [x]\nline 2\n  ü 東京 🙂{Q},empty:{Q}{Q}}}'
    assert parse_arguments(text) == {"s": 'a{b},c:d "q" [x]\nline 2\n  ü 東京 🙂', "empty": ""}


def test_arguments_quoted_keys():
    assert parse_arguments(f"{{{Q}my key{Q}:1,{Q}a:b{Q}:{Q}c{Q}}}") == {"my key": 1, "a:b": "c"}


def test_arguments_bare_words_become_strings():
    text = "{path:a.txt,mode:w,url:http://x.y/z?q=1,msg:hello world,zip:0123,huge:1e999,word:True}"
    assert parse_arguments(text) == {
        "path": "a.txt",
        "mode": "w",
        "url": "http://x.y/z?q=1",
        "msg": "hello world",
        "zip": "0123",  # not a JSON number: leading zero
        "huge": "1e999",  # would be Infinity, which JSON cannot carry
        "word": "True",
    }


def test_arguments_tolerate_whitespace_and_trailing_commas():
    text = f"{{ a : 1 ,\n  b :\t[ 1 , 2 , ] ,  c : {Q}x{Q} , }}"
    assert parse_arguments(text) == {"a": 1, "b": [1, 2], "c": "x"}


def test_arguments_json_quoted_strings():
    assert parse_arguments('{"city": "Paris, France", q:"say \\"hi\\""}') == {
        "city": "Paris, France",
        "q": 'say "hi"',
    }


def test_arguments_duplicate_key_last_wins():
    assert parse_arguments("{a:1,a:2}") == {"a": 2}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a:1",
        "[1]",
        "{a:1",
        "{a:1}}",
        "{a:{b:1}",
        "{a:[1,2}",
        "{a:}",
        "{:1}",
        "{a}",
        "{a:1,,b:2}",
        f"{{a:{Q}x}}",
        f"{{a:{Q}x{Q}y}}",
        "{a:" + "[" * 200 + "]" * 200 + "}",
    ],
)
def test_arguments_syntax_errors(text):
    with pytest.raises(ArgumentSyntaxError):
        parse_arguments(text)


def test_argument_syntax_error_is_a_value_error():
    assert issubclass(ArgumentSyntaxError, ValueError)


def test_tool_call_arguments_json_keeps_unicode():
    call = ToolCall("call_x", "f", {"city": "東京", "n": [1, None]})
    assert call.arguments_json() == '{"city": "東京", "n": [1, null]}'


# --- Whole replies and streams ------------------------------------------------------------------

WEATHER = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"

# (id, text, tools, reasoning, content, [(name, arguments)])
CASES = [
    ("plain", "Hello, world!\n\nHow are you?", True, None, "Hello, world!\n\nHow are you?", []),
    (
        "angle brackets",
        "Use <b>x</b> if a < b or c <| d.",
        True,
        None,
        "Use <b>x</b> if a < b or c <| d.",
        [],
    ),
    (
        "thinking then answer",
        "<|channel>thought\nLet me think.\n  Step 2.\n<channel|>\n\nThe answer is 4.<turn|>",
        True,
        "Let me think.\n  Step 2.",
        "The answer is 4.",
        [],
    ),
    (
        "unterminated thinking",
        "<|channel>thought\nStill thinking about",
        True,
        "Still thinking about",
        "",
        [],
    ),
    ("unterminated label", "<|channel>thoug", True, "", "", []),
    ("empty thinking block", "<|channel>thought\n<channel|>Hi", True, "", "Hi", []),
    (
        "thinking, call, thinking, answer",
        f"<|channel>thought\nI need the weather.<channel|>{WEATHER}"
        "<|channel>thought\nIt is sunny.<channel|>It is sunny in Paris.<turn|>",
        True,
        "I need the weather.\n\nIt is sunny.",
        "It is sunny in Paris.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "two calls",
        f"{WEATHER}<|tool_call>call:get_time{{zone:{Q}CET{Q},utc:false}}<tool_call|><|tool_response>",
        True,
        None,
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "utc": False})],
    ),
    (
        "nested arguments",
        f"<|tool_call>call:plan{{steps:[{{name:{Q}a{Q},deps:[]}},{{name:{Q}b{Q},opts:{{x:1,y:[2.5,-3]}}}}],"
        "meta:{}}<tool_call|>",
        True,
        None,
        "",
        [
            (
                "plan",
                {
                    "steps": [{"name": "a", "deps": []}, {"name": "b", "opts": {"x": 1, "y": [2.5, -3]}}],
                    "meta": {},
                },
            )
        ],
    ),
    (
        "numbers and literals",
        "<|tool_call>call:calc{a:-12,b:0.25,c:6.02e23,d:true,e:false,f:null}<tool_call|>",
        True,
        None,
        "",
        [("calc", {"a": -12, "b": 0.25, "c": 6.02e23, "d": True, "e": False, "f": None})],
    ),
    (
        "multi-line string with braces, commas and quotes",
        f'<|tool_call>call:write_file{{path:{Q}a.py{Q},text:{Q}def f(x):\n    return {{"k": [x, 1]}}\n# ü 東京{Q}}}'
        "<tool_call|>",
        True,
        None,
        "",
        [("write_file", {"path": "a.py", "text": 'def f(x):\n    return {"k": [x, 1]}\n# ü 東京'})],
    ),
    (
        "quoted keys, bare words, spaces",
        f"<|tool_call>call:files.write{{ {Q}file name{Q}: a.txt , mode: w,n: 3 }}<tool_call|>",
        True,
        None,
        "",
        [("files.write", {"file name": "a.txt", "mode": "w", "n": 3})],
    ),
    (
        "bare call after channel end (hyphenated name)",
        f"<|channel>thought\nSearch it.<channel|>call:searxng-search{{query:{Q}gemma 4{Q}}}",
        True,
        "Search it.",
        "",
        [("searxng-search", {"query": "gemma 4"})],
    ),
    (
        "bare call at the start, braces inside its string",
        f"\n call:files.read{{path:{Q}/tmp/}}{{[.txt{Q}}}<tool_call|> Reading it.",
        True,
        None,
        "Reading it.",
        [("files.read", {"path": "/tmp/}{[.txt"})],
    ),
    (
        "bare call after a call",
        f"{WEATHER}call:get_time{{}}",
        True,
        None,
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    ("call in the middle of text", "Try call:foo{a:1} now.", True, None, "Try call:foo{a:1} now.", []),
    (
        "call after answer text",
        "<|channel>thought\nx<channel|>Sure: call:foo{a:1}",
        True,
        "x",
        "Sure: call:foo{a:1}",
        [],
    ),
    ("not a call name", "call:foo bar", True, None, "call:foo bar", []),
    ("bare call that does not parse", "call:f{a b} then", True, None, "call:f{a b} then", []),
    ("unbalanced bare call", "<channel|>call:f{a:{b:1}", True, None, "call:f{a:{b:1}", []),
    (
        "bare call cut by a special",
        f"call:f{{a:{Q}x{Q}<|channel>thought\ny<channel|>z",
        True,
        "y",
        'call:f{a:"x"z',
        [],
    ),
    (
        "unbalanced wrapped call",
        f"Before <|tool_call>call:f{{a:{{b:{Q}x{Q}}}<tool_call|> after",
        True,
        None,
        'Before call:f{a:{b:"x"} after',
        [],
    ),
    ("wrapped call without call:", "<|tool_call>f{a:1}<tool_call|>", True, None, "f{a:1}", []),
    ("unterminated call that parses", "<|tool_call>call:f{a:1}", True, None, "", [("f", {"a": 1})]),
    ("unterminated call at a stop", "<|tool_call>call:f{a:1}<eos>x", True, None, "", [("f", {"a": 1})]),
    ("unterminated call that does not parse", f"<|tool_call>call:f{{a:{Q}x", True, None, 'call:f{a:"x', []),
    (
        "call ended by the next call",
        "<|tool_call>call:a{x:1}<|tool_call>call:b{}<tool_call|>",
        True,
        None,
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    (
        "call ended by a channel block",
        "<|tool_call>call:f{a:1}<|channel>thought\nhm<channel|>ok",
        True,
        "hm",
        "ok",
        [("f", {"a": 1})],
    ),
    (
        "call inside unterminated thinking",
        f"<|channel>thought\nLet me check {WEATHER} the sky",
        True,
        "Let me check  the sky",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "text around a call",
        f"Sure. {WEATHER} Done.",
        True,
        None,
        "Sure.  Done.",
        [("get_weather", {"city": "Paris"})],
    ),
    ("stop at turn end", "Answer.<turn|>\n<|turn>user\nmore", True, None, "Answer.", []),
    ("stop at eos", "Answer.<eos><pad><pad>", True, None, "Answer.", []),
    (
        "stop at tool response",
        f"{WEATHER}<|tool_response>response:x",
        True,
        None,
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "stray specials",
        f"<bos>Hello {Q}world{Q}<pad> <|think|>done<tool|><|tool><tool_response|><|turn><channel|><tool_call|>!",
        True,
        None,
        'Hello "world" done!',
        [],
    ),
    (
        "nested channel start is stray",
        "<|channel>thought\na<|channel>b<channel|>c",
        True,
        "ab",
        "c",
        [],
    ),
    (
        "whitespace around blocks",
        "  \n<|channel>thought\n  A  \n\n<channel|>  \n<|channel>thought\n<channel|>"
        "<|channel>thought\nB\n<channel|>\n Answer \n\n more \n",
        True,
        "A\n\nB",
        "Answer \n\n more",
        [],
    ),
    (
        "tools off",
        f"<|channel>thought\nx<channel|>call:f{{a:1}} {WEATHER}",
        False,
        "x",
        'call:f{a:1} call:get_weather{city:"Paris"}',
        [],
    ),
]
CASE_IDS = [case[0] for case in CASES]


def _calls(tool_calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, call.arguments) for call in tool_calls]


@pytest.mark.parametrize("name, text, tools, reasoning, content, calls", CASES, ids=CASE_IDS)
def test_parse_reply(name, text, tools, reasoning, content, calls):
    parsed = parse_reply(text, tools=tools)
    assert (parsed.reasoning, parsed.content, _calls(parsed.tool_calls)) == (reasoning, content, calls)
    assert all(CALL_ID.fullmatch(call.id) for call in parsed.tool_calls)
    assert len({call.id for call in parsed.tool_calls}) == len(parsed.tool_calls)


def _random_chunks(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        size = rng.randint(1, 9)
        pieces.append(text[i : i + size])
        i += size
    return pieces


def _splittings(text: str, seed: int) -> list[list[str]]:
    """One character per piece, two pieces split at every position, and seeded random chunks."""
    rng = random.Random(seed)
    two_pieces = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    return [list(text), *two_pieces, *(_random_chunks(text, rng) for _ in range(25))]


def _stream(pieces: list[str], *, tools: bool = True) -> list[Delta]:
    stream = ReplyStream(tools=tools)
    deltas = [delta for piece in pieces for delta in stream.push(piece)]
    return deltas + stream.finish()


@pytest.mark.parametrize("name, text, tools, reasoning, content, calls", CASES, ids=CASE_IDS)
def test_stream_equals_parse_reply_for_every_split(name, text, tools, reasoning, content, calls):
    expected = parse_reply(text, tools=tools)
    for pieces in _splittings(text, seed=len(text)):
        deltas = _stream(pieces, tools=tools)
        texts = {kind: "".join(d.text for d in deltas if d.kind == kind) for kind in ("content", "reasoning")}
        # Exact equality: stronger than equality after .strip().
        assert texts["content"] == expected.content, pieces
        assert texts["reasoning"] == (expected.reasoning or ""), pieces
        tool_deltas = [d for d in deltas if d.kind == "tool_call"]
        assert _calls([d.tool_call for d in tool_deltas]) == calls, pieces
        assert [d.index for d in tool_deltas] == list(range(len(calls)))
        for delta in deltas:
            assert delta.kind in ("content", "reasoning", "tool_call")
            assert (delta.text == "") == (delta.kind == "tool_call")
            assert not any(token in delta.text for token in SPECIAL_TOKENS), (pieces, delta)


def test_stream_holds_back_a_split_quote_delimiter():
    stream = ReplyStream()
    assert stream.push("Hi <|") == [Delta("content", "Hi")]
    assert stream.push('"|>yes') == [Delta("content", ' "yes')]
    assert stream.finish() == []


def test_stream_special_token_split_into_single_characters():
    stream = ReplyStream()
    assert stream.push("<|channel>thought\nA") == [Delta("reasoning", "A")]
    for char in "<channel|>":
        assert stream.push(char) == []
    assert stream.push("B") == [Delta("content", "B")]


def test_stream_emits_a_tool_call_once_complete_when_its_end_arrives():
    stream = ReplyStream()
    assert stream.push(f"<|tool_call>call:get_weather{{city:{Q}Pa") == []
    assert stream.push(f"ris{Q}}}<tool_") == []
    [delta] = stream.push("call|>")
    assert (delta.kind, delta.index, delta.tool_call.name) == ("tool_call", 0, "get_weather")
    assert CALL_ID.fullmatch(delta.tool_call.id)
    assert delta.tool_call.arguments_json() == '{"city": "Paris"}'
    [second] = stream.push("<|tool_call>call:f{}<tool_call|>")
    assert (second.index, second.tool_call.name, second.tool_call.arguments) == (1, "f", {})
    assert second.tool_call.id != delta.tool_call.id
    assert stream.finish() == []


def test_stream_holds_a_possible_bare_call_until_known():
    stream = ReplyStream()
    assert stream.push("<|channel>thought\nx<channel|>ca") == [Delta("reasoning", "x")]
    assert stream.push("ll:f") == []
    [delta] = stream.push("{a:1}")
    assert (delta.kind, delta.tool_call.name, delta.tool_call.arguments) == ("tool_call", "f", {"a": 1})
    assert stream.push(" ok") == [Delta("content", "ok")]

    stream = ReplyStream()
    assert stream.push("c") == []
    assert stream.push("a") == []
    assert stream.push("ts") == [Delta("content", "cats")]


def test_stream_whitespace_rule():
    stream = ReplyStream()
    assert stream.push("  ") == []
    assert stream.push("\n") == []
    assert stream.push("Hi") == [Delta("content", "Hi")]
    assert stream.push(" ") == []
    assert stream.push("there\n") == [Delta("content", " there")]
    assert stream.push("<|channel>thought\n  ") == []
    assert stream.push("why") == [Delta("reasoning", "why")]
    assert stream.push("<channel|><|channel>thought\nagain ") == [Delta("reasoning", "\n\nagain")]
    assert stream.push("<channel|>  end") == [Delta("content", "\n  end")]
    assert stream.finish() == []


def test_stream_unterminated_call_at_finish():
    stream = ReplyStream()
    assert stream.push("<|tool_call>call:f{a:1}") == []
    [delta] = stream.finish()
    assert (delta.kind, delta.tool_call.name, delta.tool_call.arguments) == ("tool_call", "f", {"a": 1})

    stream = ReplyStream()
    assert stream.push(f"<|tool_call>call:f{{a:{Q}x") == []
    assert stream.finish() == [Delta("content", 'call:f{a:"x')]


def test_stream_stops_at_a_stop_marker():
    stream = ReplyStream()
    assert not stream.stopped
    assert stream.push("Answer.<tu") == [Delta("content", "Answer.")]
    assert not stream.stopped
    assert stream.push("rn|>more") == []
    assert stream.stopped
    assert stream.push("ignored") == []
    assert stream.finish() == []


def test_stream_finish_without_stop_flushes_a_partial_special_as_text():
    stream = ReplyStream()
    assert stream.push("a <|cha") == [Delta("content", "a")]
    assert stream.finish() == [Delta("content", " <|cha")]
    assert not stream.stopped


def test_stream_with_tools_off_keeps_call_text_as_content():
    stream = ReplyStream(tools=False)
    deltas = stream.push(f"call:f{{a:{Q}x{Q}}}<tool_call|>") + stream.finish()
    assert deltas == [Delta("content", 'call:f{a:"x"}')]


# --- Stop strings -------------------------------------------------------------------------------


def _cut_reference(text: str, stops: list[str]) -> str:
    """The shortest prefix that ends with a stop string, minus the longest such stop string."""
    for end in range(len(text) + 1):
        matched = [s for s in stops if s and text[:end].endswith(s)]
        if matched:
            return text[: end - max(map(len, matched))]
    return text


def _apply_stops(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    stop = StopStrings(stops)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = stop.push(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(stop.finish())
    return out, stopped


def test_stop_strings_hold_back_a_multi_character_stop_split_across_pieces():
    stop = StopStrings(["<END>"])
    assert stop.push("Hello <") == ("Hello ", False)
    assert stop.push("E") == ("", False)
    assert stop.push("N") == ("", False)
    assert stop.push("D") == ("", False)
    assert stop.push("> tail") == ("", True)
    assert stop.push("more") == ("", True)
    assert stop.finish() == ""


def test_stop_strings_release_a_partial_match_that_fails():
    stop = StopStrings(["STOP"])
    assert stop.push("a ST") == ("a ", False)
    assert stop.push("ILL") == ("STILL", False)
    assert stop.push("x S") == ("x ", False)
    assert stop.finish() == "S"


def test_stop_strings_overlapping_cut_at_the_first_completed():
    # "cd" completes before "abcde" would, so the text ends before "cd", however it is split.
    assert _apply_stops(["xabcdef"], ["abcde", "cd"]) == (["xab"], True)
    assert _apply_stops(list("xabcdef"), ["abcde", "cd"]) == (["x", "", "", "", "ab"], True)
    # Completing at the same character: the longest match is cut.
    assert _apply_stops(["xab!"], ["b", "ab"]) == (["x"], True)


def test_stop_strings_ignore_empty_strings():
    assert _apply_stops(["ab", "c"], [""]) == (["ab", "c", ""], False)
    assert _apply_stops(["ab", "c"], ["", "c"]) == (["ab", ""], True)


@pytest.mark.parametrize(
    "text, stops",
    [
        ("Hello world. The end. Bye", ["The end", "end."]),
        ("aaaaab", ["aab", "aaaa"]),
        ("abababx", ["ababx", "babx"]),
        ("one\n\ntwo\n\nthree", ["\n\n"]),
        ("no stop here", ["xyz", "ereh"]),
        ("ends with a partial sto", ["stop"]),
        ("unicode 東京 🙂 stop", ["🙂 s", "京 🙂"]),
    ],
)
def test_stop_strings_every_split_matches_the_reference(text, stops):
    expected = _cut_reference(text, stops)
    for pieces in _splittings(text, seed=len(text)):
        out, stopped = _apply_stops(pieces, stops)
        assert "".join(out) == expected, pieces
        assert stopped == any(s in text for s in stops), pieces
        assert not any(s in "".join(out) for s in stops)


def test_stop_strings_cases_are_exact():
    assert _cut_reference("Hello world. The end. Bye", ["The end", "end."]) == "Hello world. "
    assert _cut_reference("aaaaab", ["aab", "aaaa"]) == ""
    assert _cut_reference("abababx", ["ababx", "babx"]) == "ab"
    assert _cut_reference("unicode 東京 🙂 stop", ["🙂 s", "京 🙂"]) == "unicode 東"


def test_stream_equals_parse_reply_on_random_texts():
    """Differential check on seeded random mixes of markers, argument syntax and text."""
    fragments = [
        *("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", Q, "<eos>", "<|turn>", "<bos>"),
        *("call:", "call:f{a:1}", "call:g{}", f"{{s:{Q}x,{{y{Q}}}", "get-x.y", "{", "}", "[", "]", ":", ","),
        *("thought\n", "hi", "-2.5e3", "true", " ", "\n", "<", "<|", "c", "ca", "<b>"),
    ]
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 12)))
        tools = rng.random() < 0.8
        expected = parse_reply(text, tools=tools)
        for pieces in (list(text), _random_chunks(text, rng)):
            deltas = _stream(pieces, tools=tools)
            assert "".join(d.text for d in deltas if d.kind == "content") == expected.content, pieces
            assert "".join(d.text for d in deltas if d.kind == "reasoning") == (expected.reasoning or "")
            calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
            assert _calls(calls) == _calls(expected.tool_calls), pieces


# --- The other direction: tool-call syntax written for the model ---------------------------------


def test_forced_call_prefix_parses_as_the_start_of_a_call():
    """The prefix that forces a call (tool_choice), pushed before the generated text, reads as one call."""
    assert forced_call_prefix() == "<|tool_call>call:"
    assert forced_call_prefix("get_weather") == "<|tool_call>call:get_weather{"
    for prefix, generated in (
        (forced_call_prefix(), f"get_weather{{city:{Q}Paris{Q}}}<tool_call|>"),
        (forced_call_prefix("get_weather"), f"city:{Q}Paris{Q}}}<tool_call|>"),
    ):
        whole = parse_reply(prefix + generated)
        assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", {"city": "Paris"})]
        stream = ReplyStream()
        deltas = stream.push(prefix) + stream.push(generated) + stream.finish()
        assert [d.tool_call.arguments for d in deltas if d.kind == "tool_call"] == [{"city": "Paris"}]
        assert not [d for d in deltas if d.kind != "tool_call"]


def test_a_parsed_call_goes_back_as_the_template_reads_it():
    text = f"<|tool_call>call:files.read{{path:{Q}a.txt{Q},lines:[1,2]}}<tool_call|>"
    [call] = parse_reply(text).tool_calls
    arguments = {"path": "a.txt", "lines": [1, 2]}
    entry = {"type": "function", "function": {"name": "files.read", "arguments": arguments}}
    assert call.template_entry() == entry == template_tool_call("files.read", arguments)
