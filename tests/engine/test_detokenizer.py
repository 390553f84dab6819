"""Incremental detokenization: whole UTF-8 characters only, stop strings cut and never leaked."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer, make_decode_fn


@pytest.fixture(scope="module")
def tokenizer(bundled_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_dir)


def _stream(tokenizer, prompt: str, output: str, stop: tuple[str, ...] = ()):
    """Feeds ``output``'s tokens one at a time; returns the detokenizer and each step's visible text."""
    prompt_ids = tokenizer.encode(prompt)
    output_ids = tokenizer.encode(output)
    detok = IncrementalDetokenizer(make_decode_fn(tokenizer), prompt_ids, stop)
    seen, stopped = [], False
    for t in output_ids:
        stopped = detok.update([t])
        seen.append(detok.visible_text(stopped))
        if stopped:
            break
    return detok, seen, stopped


def test_chinese_and_emoji_come_out_whole(tokenizer) -> None:
    """Characters split across byte-level tokens are held back until complete, never U+FFFD."""
    text = "你好世界 🎉🚀 ok 日本語 👩‍👩‍👧"
    detok, seen, _ = _stream(tokenizer, "Say:", text)
    assert len(tokenizer.encode(text)) > len(text.replace(" ", ""))  # really split across tokens
    assert detok.text == text
    assert all("\ufffd" not in s for s in seen)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # streamed text only grows


def test_matches_full_decode_on_ascii(tokenizer) -> None:
    """Incremental text equals decoding the whole output, leading space included."""
    text = " The quick brown fox, jumps over 13 lazy dogs.\nNew line!"
    detok, _, _ = _stream(tokenizer, "Once upon a time", text)
    assert detok.text == tokenizer.decode(tokenizer.encode(text))


def test_stop_string_across_tokens_is_cut_and_not_leaked(tokenizer) -> None:
    """A stop string spanning several tokens ends the text right before it; no part of it is ever shown."""
    stop = "STOP_HERE"
    detok, seen, stopped = _stream(tokenizer, "x", "Hello there STOP_HERE and more", (stop,))
    assert stopped and detok.text == "Hello there "
    assert all("STOP" not in s and not s.endswith("S") for s in seen)


def test_held_back_tail_is_released_when_it_stops_matching(tokenizer) -> None:
    """Text that looked like the start of a stop string is shown once the match fails."""
    detok, seen, stopped = _stream(tokenizer, "x", "a<EN and then", ("<END>",))
    assert not stopped
    assert "<EN" in seen[-1] and detok.visible_text(False) == detok.text


def _holding(text: str, stop: tuple[str, ...]) -> IncrementalDetokenizer:
    """A detokenizer whose text is ``text`` (one token per character), stop strings not searched."""
    detok = IncrementalDetokenizer(lambda ids: "".join(map(chr, ids)), [], stop)
    detok.update([ord(c) for c in text], check_stop=False)
    return detok


def test_visible_text_withholds_partial_stop_prefix() -> None:
    """Only the longest suffix that is a proper prefix of a stop string is withheld."""
    stop = ("abcab", "zz")
    assert _holding("xxabca", stop).visible_text(False) == "xx"  # "abca" could begin "abcab"
    assert _holding("qabcb", stop).visible_text(False) == "qabcb"  # no suffix begins a stop string
    assert _holding("qcab", stop).visible_text(False) == "qc"
    detok = _holding("qz", stop)
    assert detok.visible_text(False) == "q"
    assert detok.visible_text(True) == "qz"


def test_taken_pieces_add_up_to_the_visible_text(tokenizer) -> None:
    """What ``take`` hands out, step by step, is the visible text: nothing repeated, nothing withheld at the end."""
    detok = IncrementalDetokenizer(make_decode_fn(tokenizer), tokenizer.encode("x"), ("<END>",))
    taken = []
    text = " 你好 a<EN" + " and then" * 20  # longer than what a stop string needs: the start is settled
    for t in tokenizer.encode(text + " <END> more"):
        stopped = detok.update([t])
        taken.append(detok.take(stopped))
        assert "".join(taken) == detok.visible_text(stopped)
        if stopped:
            break
    assert stopped and "".join(taken) == detok.text == text + " "


def test_stop_found_only_after_check_enabled(tokenizer) -> None:
    """With check_stop False (before min_tokens) a stop string is kept in the text."""
    prompt_ids = tokenizer.encode("x")
    out = tokenizer.encode(" END then")
    detok = IncrementalDetokenizer(make_decode_fn(tokenizer), prompt_ids, ("END",))
    for t in out:
        assert not detok.update([t], check_stop=False)
    assert "END" in detok.text
