"""Tokens to text while decoding: incremental detokenization and stop strings matched on the text.

`TextStream` decodes only the tokens since its last checkpoint (plus one token of context, so a SentencePiece
token's leading space survives), never the whole output again: a step costs O(new tokens), not O(output length).
It holds back what a later token could still change (an incomplete UTF-8 sequence, trailing whitespace that a
space-cleaning tokenizer removes before punctuation), so the streamed deltas always join to exactly
`tokenizer.decode(all ids)`; `finish` sends what was held back.

`StopStrings` finds stop strings in the text as it grows (a stop word can appear in the text even when its token
sequence does not, e.g. "\\n" inside a "\\n\\n" token), looking only at the new text and the few characters before.
`TextStream.push(ids, stops)` matches them before anything of the push is sent, so the text ends right after the
stop string even when it ends inside a token or more tokens followed it in the same step.

Every stop rule lives here: `stop_token_end` (the decoder's token-level `stop_words`), `StopStrings` (the served
model's text stop words: the text ends after the match, tensorrtllm_backend's rule) and `StopText` (the OpenAI
frontend's `stop` over streamed deltas: the text ends before the match, OpenAI's rule).
"""

from __future__ import annotations

from functools import cache

CHECKPOINT_EVERY = 32  # tokens decoded per window before the window start moves up (keeps each decode short)
CONTEXT_TOKENS = 8  # tokens kept in the window behind a moved checkpoint


class TextStream:
    """Text deltas for token chunks as they are accepted; the deltas join to `tokenizer.decode(ids)`."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.start = 0  # window start: the text of ids[:start] is final and was sent (`settled`)
        self.settled = ""
        self.pending = ""  # text sent beyond `settled`, from the window
        self.latest = ""  # all text decoded so far, held-back characters included (what stop strings search)
        self.decodes = 0  # tokens decoded in all (what a step costs; tests check it stays linear)
        self.stopped = False  # a stop string ended the text (`push` with stops): nothing more is sent

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self.settled + self.pending

    def _decode(self, ids: list[int]) -> str:
        self.decodes += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _window(self, start: int, end: int | None = None) -> str | None:
        """Text of ids[start:end] as it reads after ids[:start] (one token of context), or None if that token's
        own text is rewritten by what follows (then only a full decode can say)."""
        ids = self.ids[start:end]
        if start == 0:
            return self._decode(ids)
        base, text = self._decode(self.ids[start - 1:start]), self._decode(self.ids[start - 1:end])
        return text[len(base):] if text.startswith(base) else None

    def push(self, new_ids: list[int], stops: StopStrings | None = None) -> str:
        """Append accepted tokens; return the text that is now certain (may be empty). With `stops`, a stop string
        in the new text ends the text right after it: `stopped` is set, the returned text ends with the stop string
        and `ids` keeps only the tokens up to the one that completes it (the rest were never part of the answer)."""
        searched = len(self.latest.rstrip("\ufffd"))  # a placeholder's character may complete (and match) now
        kept = len(self.ids)
        self.ids.extend(new_ids)
        tail = self._tail()
        if tail is None:
            return ""
        self.latest = self.settled + tail
        end = None if stops is None else stops.find(self.latest, searched)
        if end is not None:
            self._keep_until(kept, stops, searched)
            self.stopped = True
            return self.finish(end)
        certain = tail.rstrip("\ufffd")  # an incomplete UTF-8 sequence decodes to U+FFFD until its last byte
        certain = certain[:len(certain.rstrip())]  # trailing whitespace: a following "." may remove it
        if not certain.startswith(self.pending) or len(certain) <= len(self.pending):
            return ""
        delta, self.pending = certain[len(self.pending):], certain
        if len(self.ids) - self.start > CHECKPOINT_EVERY:
            self._checkpoint()
        return delta

    def _tail(self, end: int | None = None) -> str | None:
        """The text of ids[start:end] after `settled`, None if it no longer continues what was settled."""
        tail = self._window(self.start, end)
        if tail is None:  # rare: re-anchor on a full decode
            full = self._decode(self.ids[:end])
            if not full.startswith(self.settled):
                return None
            tail = full[len(self.settled):]
        return tail

    def _keep_until(self, kept: int, stops: StopStrings, searched: int) -> None:
        """Drop the pushed tokens after the first one whose text completes the stop string (decodes only then)."""
        for end in range(kept + 1, len(self.ids)):
            tail = self._tail(end)
            if tail is not None and stops.find(self.settled + tail, searched) is not None:
                del self.ids[end:]
                return

    def _checkpoint(self) -> None:
        """Move the window start up to CONTEXT_TOKENS behind the end, if the text before it is what was sent."""
        at = len(self.ids) - CONTEXT_TOKENS
        head = self._window(self.start, at)
        if head is not None and self.pending.startswith(head) and not head.endswith((" ", "\n", "\ufffd")):
            self.settled += head
            self.pending = self.pending[len(head):]
            self.start = at

    def finish(self, end: int | None = None) -> str:
        """The rest of the text once no token will follow (after it, `text == tokenizer.decode(ids)`), or up to
        `end` of `latest` when a stop string ends there."""
        full = self._decode(self.ids) if end is None else self.latest[:end]
        sent = self.text
        if not full.startswith(sent):  # cannot happen with held-back whitespace; never send text twice
            return ""
        self.settled, self.pending = full, ""
        return full[len(sent):]


class StopStrings:
    """Stop strings over a growing text: `find(text, new_from)` -> end of the earliest match in the new part."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]

    def find(self, text: str, new_from: int) -> int | None:
        """The smallest end index of a stop string that ends at or after `new_from` (the match is kept: the text is
        cut after it), or None."""
        # from new_from - len(s): a match ending exactly at new_from is new when the text before it changed (a
        # tokenizer's clean-up joined "ab " and "." into "ab."); one that did not change would have stopped
        ends = [i + len(s) for s in self.stops if (i := text.find(s, max(0, new_from - len(s)))) >= 0]
        return min(ends) if ends else None


def stop_token_end(tail: list[int], new: list[int], stop_words: list[list[int]]) -> int | None:
    """Token-level stop words (the decoder's `stop_words`): the count of `new` tokens up to and including the first
    one that completes a stop sequence (`tail`: the output's last tokens before `new`), or None."""
    for j in range(len(new)):
        seq = tail + new[:j + 1]
        if any(len(seq) >= len(w) and seq[len(seq) - len(w):] == w for w in stop_words):
            return j + 1
    return None


class StopText:
    """OpenAI `stop` over a stream of text deltas: the text ends before the first stop string.

    A delta's tail that could begin a stop string is held back until the next delta settles it, so nothing past a
    stop string is ever sent. `feed` returns the text that is safe to send; `flush` the held-back rest at the end.
    """

    def __init__(self, stops: list[str]):
        self.stops, self.pending, self.stopped = stops, "", False

    def feed(self, delta: str) -> str:
        if not self.stops or self.stopped:
            return "" if self.stopped else delta
        text = self.pending + delta
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self.pending = True, ""
            return text[:min(cuts)]
        hold = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the character a byte-level BPE vocabulary writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """Each token's own bytes (the OpenAI API's logprobs `token` / `bytes`): a byte-level BPE piece mapped back through
    its alphabet (a token may hold part of a UTF-8 character), else the token decoded alone."""

    def __init__(self, tokenizer):
        self.tokenizer, self.known = tokenizer, {}

    def __call__(self, token_id: int) -> bytes:
        found = self.known.get(token_id)
        if found is None:
            piece, table = self.tokenizer.convert_ids_to_tokens(token_id), _byte_decoder()
            if piece and all(c in table for c in piece):
                found = bytes(table[c] for c in piece)
            else:
                found = self.tokenizer.decode([token_id]).encode("utf-8")
            self.known[token_id] = found
        return found
