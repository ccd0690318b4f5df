"""Stop strings, matched on the detokenized text (also when they span tokens) by a thread of
their own, so that the engine thread never decodes text.

The engine feeds each stop-string request's new tokens after every step and carries on; the
watcher reports the first match as (sample, tokens up to the one that completed it, the text
cut there). The engine finishes a matched request at its next step, and holds back one that
ended otherwise (eos, length) until the watcher has checked every token of it. The result is
the one a check after every token would give: only when the engine learns of it is late. A
stop or end-of-sequence token that ends a sample with its text left out is not checked: its
text is not the output's, so it completes no stop string.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from batchgen.engine.detokenize import output_text
from batchgen.engine.request import Request
from batchgen.token_bytes import token_bytes_of

BYTES_PER_CHAR = 4  # a byte-level token may hold a single byte of a UTF-8 character


class Verdict(NamedTuple):
    """The watcher's answer for one sample: matched at `num_tokens` tokens (text cut there),
    or (final only) no match in all `num_tokens` tokens (text None)."""

    request: Request
    num_tokens: int
    text: str | None


def match_stop_strings(
    tokens: list[int],
    stop: tuple[str, ...],
    include: bool,
    min_tokens: int,
    tokenizer: Any,
    prompt: Sequence[int] = (),
) -> str | None:
    """After tokens[-1] was appended: the output text cut at the first stop string, or None.
    The text is read after the prompt's last tokens (detokenize.output_text). With
    min_tokens, a match must end in text after that of the first min_tokens tokens (one that
    begins in it counts), as in vLLM: the same tokens that eos and stop tokens are banned for.

    Only the tail that the newest token can have completed a match in is decoded each time;
    the full text is decoded once, when a match is found.
    """
    if not stop or len(tokens) <= min_tokens:
        return None
    longest = max(len(s) for s in stop)
    start = _tail_start(tokens, BYTES_PER_CHAR * longest + 2, tokenizer)
    if start == 0:  # the output's start: its first token's space is the prompt's context's
        tail = output_text(tokenizer, prompt, tokens)
    else:  # a match ends in the newest tokens, far past what a decode may cut at the start
        tail = tokenizer.decode(tokens[start:], skip_special_tokens=True)
    if not any(s in tail for s in stop):
        return None
    text = output_text(tokenizer, prompt, tokens)
    # A match must end in text after the first min_tokens tokens' (as in vLLM): one completed
    # by them does not count, one that begins in their text and ends later does.
    floor = 0
    if min_tokens:
        head = output_text(tokenizer, prompt, tokens[:min_tokens])
        # a partial character at their end is not text yet (the text holds it whole)
        floor = len(head) if text.startswith(head) else len(head.rstrip("\ufffd"))
    found = [(text.find(s, max(0, floor - len(s) + 1)), s) for s in stop]
    found = [(position, s) for position, s in found if position >= 0]
    if not found:
        return None
    position, first = min(found)
    return text[: position + len(first) if include else position]


def _tail_start(tokens: list[int], needed: int, tokenizer: Any) -> int:
    """Where the last `needed` tokens that add text begin (0 if there are fewer): special
    tokens add none (they are skipped), so any among them widen the tail by as many."""
    silent = token_bytes_of(tokenizer).special
    end = len(tokens)
    start = max(0, end - needed)
    while start > 0:
        window = tokens[start:end]
        if silent.isdisjoint(window):
            break
        end, start = start, max(0, start - sum(map(silent.__contains__, window)))
    return start


def _hidden_end(request: Request, token: int) -> bool:
    """Whether `token`, the last of an ended sample, is a stop or end-of-sequence token whose
    text the output leaves out (so it cannot complete a stop string, as in vLLM)."""
    return token in request.ending_ids and not request.params.include_stop_str_in_output


class StopWatcher:
    """One thread matching stop strings for the engine. Only the engine thread calls feed,
    verdicts and forget; the thread owns the token copies it checks."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._inbox: queue.SimpleQueue[tuple[Request, tuple[int, ...], bool] | None]
        self._inbox = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[Verdict] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:  # a copy (datasets hashes callers) starts idle
        return {"tokenizer": self.tokenizer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["tokenizer"])

    def feed(self, request: Request, tokens: tuple[int, ...], final: bool) -> None:
        """Check `tokens`, the sample's newest ones; final: no more will follow (it ended),
        so answer with a verdict even when nothing matches."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="batchgen-stop", daemon=True)
            self._thread.start()
        self._inbox.put((request, tokens, final))

    def verdicts(self, wait: float = 0.0) -> list[Verdict]:
        """The answers so far (waiting up to `wait` seconds for the first one)."""
        if self._thread is None:
            return []  # nothing was ever fed
        out = []
        try:
            out.append(self._outbox.get(timeout=wait) if wait > 0 else self._outbox.get_nowait())
            while True:
                out.append(self._outbox.get_nowait())
        except queue.Empty:
            return out

    def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        seen: dict[Request, list[int]] = {}  # a sample being checked -> its tokens so far
        done: set[Request] = set()  # matched, not final yet: later tokens are ignored
        while (item := self._inbox.get()) is not None:
            request, tokens, final = item
            key = request  # compared by identity (Request has eq=False)
            if key in done:
                if final:
                    done.discard(key)
                continue
            ids = seen.setdefault(key, [])
            params = request.params
            for index, token in enumerate(tokens):
                ids.append(token)
                if final and index == len(tokens) - 1 and _hidden_end(request, token):
                    continue  # its text is left out: a stop token's end, not a stop string's
                text = match_stop_strings(
                    ids,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.min_new_tokens,
                    self.tokenizer,
                    request.prompt_token_ids,
                )
                if text is not None:
                    self._outbox.put(Verdict(request, len(ids), text))
                    del seen[key]
                    if not final:
                        done.add(key)
                    break
            else:
                if final:
                    self._outbox.put(Verdict(request, len(seen.pop(key)), None))
