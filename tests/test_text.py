"""Incremental detokenization and text stop strings (pure, on the real tokenizer and a space-cleaning variant)."""

from __future__ import annotations

import random

import pytest
from spectrt.runtime.decoding.text import StopStrings, TextStream, stop_token_end

pytestmark = pytest.mark.unit  # the fast tier: pure functions on small inputs, no model

SAMPLES = ["Hello , world ! It 's a test . Don't stop : 3.5 % of cafés ( naïve ) – 日本語 ? Yes .",
           "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(3)) ; end",
           "  leading spaces , and trailing   ", "emoji 🎉🎉 and ' quotes ' n't ' ve"]


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "cleanup"])
def tokenizer(request, target_dir):
    from transformers import AutoTokenizer

    # clean_up_tokenization_spaces=True: " ." -> ".", " 's" -> "'s" ... (Llama-3-style tokenizers): decoding a
    # window can differ from decoding the whole text, which naive length-based deltas get wrong
    return AutoTokenizer.from_pretrained(target_dir, clean_up_tokenization_spaces=request.param)


@pytest.mark.parametrize("seed", range(6))
def test_streamed_deltas_join_to_the_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False) * 3
        stream, sent, i = TextStream(tokenizer), "", 0
        while i < len(ids):
            k = rng.randint(1, 5)
            sent += stream.push(ids[i:i + k])
            i += k
            assert tokenizer.decode(ids[:i], skip_special_tokens=True).startswith(sent)  # never text to take back
        sent += stream.finish()
        assert sent == stream.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_decoding_cost_stays_linear_in_the_output(tokenizer):
    """Each push decodes the tokens since the last checkpoint, never the whole output: 2,000 tokens one at a time
    decode far fewer than the ~2 million tokens whole-text re-decoding would."""
    ids = tokenizer.encode(" ".join(SAMPLES) * 20, add_special_tokens=False)[:2000]
    stream = TextStream(tokenizer)
    for t in ids:
        stream.push([t])
    stream.finish()
    assert stream.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert stream.decodes < 60 * len(ids)


def test_stop_strings_find_the_earliest_match_in_new_text():
    stops = StopStrings(["\n", "END", ""])
    assert stops.find("abc", 0) is None
    assert stops.find("ab\ncd\n", 0) == 3
    assert stops.find("abcEN", 3) is None and stops.find("abcEND more", 5) == 6  # a match across two pushes
    assert stops.find("x\nyEND", 3) == 6  # the old newline was already seen: only new matches count
    # a match ending exactly where the new text starts counts: the text before it changed (a tokenizer's clean-up
    # joined "ab " and "." into "ab."), else it would have stopped the stream before
    assert StopStrings(["b."]).find("ab.", 3) == 3 and StopStrings(["b."]).find("ab.x", 4) is None
    assert StopStrings([]).find("anything", 0) is None


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_stop_string_inside_a_token_cuts_the_text_and_the_tokens_after_it(tokenizer):
    """" Par" ends inside " Paris", and two more tokens came in the same push: the text ends right after the stop
    string, nothing past it is ever returned, and only the token that completes it is kept."""
    ids = _tokens(tokenizer, " Paris is big")
    stream = TextStream(tokenizer)
    assert stream.push(ids, StopStrings(["Par"])) == " Par" and stream.stopped
    assert stream.text == " Par" and stream.ids == ids[:1]
    stream = TextStream(tokenizer)
    sent = stream.push(ids[:1], StopStrings(["is b"])) + stream.push(ids[1:], StopStrings(["is b"]))
    assert sent == stream.text == " Paris is b" and stream.ids == ids and stream.stopped


def test_a_stop_string_ending_in_a_character_split_over_pushes_is_found(tokenizer):
    """語 is three byte tokens: until its last one it reads as U+FFFD, which must not count as already searched."""
    ids = _tokens(tokenizer, "日本語 ok")
    stream, sent = TextStream(tokenizer), ""
    for t in ids:
        sent += stream.push([t], StopStrings(["本語"]))
        if stream.stopped:
            break
    assert sent == "日本語" and stream.ids == _tokens(tokenizer, "日本語")


def test_token_stop_words_end_the_output_after_the_first_completed_sequence():
    """The decoder's stop_words: a sequence may begin in the output already sent (`tail`) and complete in this step's
    tokens; the output keeps the completing token and nothing after it; the earliest completion wins."""
    assert stop_token_end([], [5, 6, 7], [[6]]) == 2
    assert stop_token_end([4], [5, 6, 7], [[4, 5]]) == 1  # began in the tail
    assert stop_token_end([], [5, 6, 7, 8], [[7, 8], [5, 6]]) == 2  # the earliest, not the first listed
    assert stop_token_end([9], [5, 6], [[4, 5], [6, 6]]) is None
