"""What crosses the pipes between a job's process and its engine's, as length-prefixed pickles.

To the engine (the server's stdin):
- ("load", model, config, quiet, step_hook, cpus) once (cpus: the cores to keep to once
  loaded, empty for all); answered ("ready", facts) or an error.
- per generate call, numbered n from 1: ("generate", n, params, decode, check_outputs,
  profile) (profile: None, or (path, run) to record the call's steps there), then
  ("prompts", n, rows) as prompts become ready, and ("end", n) once there are no more or
  ("stop", n) to stop after the step in flight. A row is (request id, the prompt, packed,
  sampling, seed key, vocab): packed is whether the prompt is token ids as int64 bytes (a
  list or tuple the engine takes as ids); anything else travels as it is, for the engine to
  take or refuse as it does in-process. vocab is the engine's vocabulary size when the job's
  process found every id inside it (the engine's thread then skips that check), else None.
- between calls: ("sampling", params) and ("clear_cache",), answered ("ok",) or an error;
  ("close",).

From the engine (a copy of the server's stdout; what it prints goes to stderr):
- ("outputs", n, results, prompts taken, cache stats) after a step that finished
  requests or took prompts; a result whose prompt ids are the ones sent comes back with
  prompt_token_ids None (the job's side puts them back).
- ("done", n, cache stats, step report, profile) when the call ends, after its last outputs
  (profile: None, or ("ok", the records' file) or ("error", why they were not written)).
- ("error", kind, message): kind "batchgen" or "value" (the user's to fix; the server goes
  on), else "internal" (the server has printed its traceback and exits), a message it could
  not read too.
"""

from __future__ import annotations

import pickle
import struct
import threading
import weakref
from array import array
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # the job's side imports this before torch (request.py imports it)
    from batchgen.engine.request import Prompt

PICKLE = pickle.HIGHEST_PROTOCOL
FRAME = struct.Struct("<Q")  # the byte length of the pickle that follows
# (request id, the prompt: its ids as int64 bytes when packed, else as given; packed;
# sampling; seed key; the vocabulary size the ids were found inside or None)
Row = tuple[str, Any, bool, Any, Any, int | None]
# one lock per pipe: a send blocked on one full pipe never holds back another pipe's
_SENDING: weakref.WeakKeyDictionary[IO[bytes], threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS = threading.Lock()  # guards _SENDING


def send(pipe: IO[bytes], message: tuple) -> None:
    """One message, whole: the frames of two threads sending at once do not interleave."""
    data = pickle.dumps(message, PICKLE)
    with _LOCKS:
        sending = _SENDING.setdefault(pipe, threading.Lock())
    with sending:
        pipe.write(FRAME.pack(len(data)))
        pipe.write(data)
        pipe.flush()


def receive(pipe: IO[bytes]) -> tuple:
    """The next message; EOFError when the other side has closed the pipe."""
    head = pipe.read(FRAME.size)
    if len(head) < FRAME.size:
        raise EOFError
    (size,) = FRAME.unpack(head)
    data = pipe.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def pack_prompt(prompt: Any, default_id: str, vocab: int | None) -> tuple[Row, list[int] | None]:
    """-> (the row to send, the prompt's ids when they travel as bytes, else None). Only what
    the engine takes as token ids is packed (int64_ids: no bools); ids all inside [0, vocab)
    are marked so (the engine's thread then skips that check). The engine finds anything
    else wrong with a prompt itself. Sampling overrides travel as a plain dict and a seed key
    as the text it stands for, so no type only this process can import reaches the engine's."""
    from batchgen.engine.request import Prompt, int64_ids, outside_vocab

    if not isinstance(prompt, Prompt):
        prompt = Prompt(prompt)
    request_id = default_id if prompt.request_id is None else str(prompt.request_id)
    body, ids, checked = prompt.prompt, None, None
    packed = int64_ids(body)
    if packed is not None:
        body, ids = packed.tobytes(), packed.tolist()
        if ids and vocab is not None and outside_vocab(ids, vocab) is None:
            checked = vocab
    sampling, seed_key = prompt.sampling, prompt.seed_key
    if isinstance(sampling, Mapping):
        sampling = dict(sampling)
    if seed_key is not None:
        seed_key = str(seed_key)  # what the engine keys a derived seed by
    return (request_id, body, packed is not None, sampling, seed_key, checked), ids


def unpack_prompt(row: Row) -> tuple[Prompt, bool]:
    """A sent row -> (its Prompt, whether its ids travelled as bytes)."""
    from batchgen.engine.request import Prompt, VocabChecked

    request_id, body, packed, sampling, seed_key, checked = row
    if packed:
        ids = array("q")
        ids.frombytes(body)
        body = ids.tolist() if checked is None else VocabChecked(ids.tolist(), checked)
    return Prompt(body, request_id, sampling, seed_key), packed
