"""The engine loop: schedule -> launch -> post-process, with step N+1 launched before N is read."""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from threading import Event, Thread
from typing import Any

import torch
from transformers import PreTrainedModel

from batchgen.engine.block_manager import BlockManager, blocks_for
from batchgen.engine.call_inputs import (
    CallIds,
    CallParams,
    as_prompts,
    call_params,
    check_one_call,
    with_params,
)
from batchgen.engine.config import EngineConfig, check_prefill_budget
from batchgen.engine.detokenize import output_text
from batchgen.engine.device import resolve_device, resolve_dtype, token_budget
from batchgen.engine.fingerprint import eos_fingerprint, model_fingerprint, tokenizer_fingerprint
from batchgen.engine.grammar import Grammars, InFlight, fill_threads, grammar_spec
from batchgen.engine.graphs import step_target
from batchgen.engine.model_loader import (
    WeightsVersion,
    activation_bytes_per_token,
    adopt_model,
    check_rope,
    eos_token_ids,
    kv_block_size,
    kv_cache_dtype,
    load_model,
    model_sampling_defaults,
    model_shape,
    set_cpu_threads,
    weights_version,
)
from batchgen.engine.model_path import check_max_model_len, prompt_over_context
from batchgen.engine.output_check import OutputCheck, output_problem
from batchgen.engine.prefix_cache import CacheStats
from batchgen.engine.preload import Preload
from batchgen.engine.probe import check_model
from batchgen.engine.prompt_text import check_one_bos, check_unicode
from batchgen.engine.quant.convert import check_adopted
from batchgen.engine.request import (
    NOT_READY,
    Prompt,
    Request,
    RequestOutput,
    Status,
    TokenLogprobs,
    VocabChecked,
    int64_ids,
    not_ids_reason,
    outside_vocab,
    stop_id_problem,
)
from batchgen.engine.runner import ModelRunner, plan_num_blocks, spare_bytes
from batchgen.engine.sampling_params import SamplingParams
from batchgen.engine.scheduler import Batch, Scheduler
from batchgen.engine.step_profiler import StepProfiler
from batchgen.engine.stop_strings import StopWatcher
from batchgen.engine.tokenizer_loader import load_tokenizer
from batchgen.engine.transfer import StepOutput, wait_tokens
from batchgen.errors import BatchgenError
from batchgen.home import triton_cache_dir

PromptLike = str | list[int] | Prompt


_END = object()
VERDICT_WAIT_S = 0.05  # how long an idle engine waits for the stop watcher's next answer
# a loop iteration takes at most max_num_seqs // PULL_SHARE new prompts from its source: the
# first step does not wait for every prompt's checks (~30 us each), later ones top the queue up
PULL_SHARE = 4
PULL_MIN = 16


class Engine:
    """A continuous-batching engine over one Hugging Face decoder-only model.

    `model` is a local model folder, a hub id, "default" (the embedded tiny model) or a loaded
    PreTrainedModel (then pass its tokenizer, or token-id prompts only). `preload`: the
    folder's weights being read ahead onto the device (preload.py; the engine process starts
    one while it imports).
    """

    def __init__(
        self,
        model: str | Path | PreTrainedModel = "default",
        config: EngineConfig | None = None,
        tokenizer: Any = None,
        *,
        preload: Preload | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        clock = _PhaseClock()
        adopted = isinstance(model, PreTrainedModel)
        if adopted:  # the caller's model: used as it is, given back unchanged by close()
            self.device, self.dtype = adopt_model(model, self.config)
        else:
            self.device = resolve_device(self.config)
            self.dtype = resolve_dtype(self.config, self.device)
        if self.device.type == "cuda":
            _warm_triton_meanwhile()
        if adopted:
            check_adopted(model, self.config.quantization, self.device)
            self.model = model
        else:
            if self.device.type == "cpu":
                set_cpu_threads(self.config)
            self.model = load_model(
                model, self.device, self.dtype, self.config.quantization, preload
            )
            if tokenizer is None:
                tokenizer = load_tokenizer(model)
        if self.device.type == "cuda":  # compiled kernels kept with batchgen's other caches
            os.environ.setdefault("TRITON_CACHE_DIR", str(triton_cache_dir()))
        self.tokenizer = tokenizer
        clock.mark("load")
        self.eos_token_ids = eos_token_ids(self.model, tokenizer)
        # the model's recommended sampling, for calls (and jobs) that set none of it
        self.generation_defaults = model_sampling_defaults(self.model, self.config)
        # what decides outputs besides the settings (checked when a job resumes)
        self._fingerprint = model_fingerprint(self.model, tokenizer, self.eos_token_ids, adopted)
        self.shape = model_shape(self.model)
        clock.mark("shape")
        limit = self.shape.max_position_embeddings
        check_max_model_len(self.config.max_model_len, limit)
        self.max_model_len = self.config.max_model_len or limit
        check_rope(self.model, self.max_model_len)
        self.kv_dtype = kv_cache_dtype(self.config, self.dtype, self.device)
        block_size = kv_block_size(self.config, self.kv_dtype, self.device)
        self.config = dataclasses.replace(self.config, block_size=block_size)
        self.num_blocks = plan_num_blocks(
            self.config, self.shape, self.kv_dtype, self.device, self.max_model_len
        )
        spare = spare_bytes(self.config, self.shape, self.kv_dtype, self.device, self.num_blocks)
        budget = token_budget(
            self.config, self.device, spare, activation_bytes_per_token(self.model, self.dtype)
        )
        if self.config.max_num_batched_tokens is None and not self.config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)  # unset: a whole sequence fits, as vLLM
        self.config = dataclasses.replace(self.config, max_num_batched_tokens=budget)
        check_prefill_budget(self.config, self.max_model_len)
        self.runner = ModelRunner(
            self.model,
            self.shape,
            self.config,
            self.device,
            self.kv_dtype,
            self.num_blocks,
            self.max_model_len,
            adopted=adopted,
        )
        clock.mark("kv_cache_and_graphs")
        self.blocks = BlockManager(
            self.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.blocks,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.config.enable_chunked_prefill,
        )
        graphs = self.runner.graphs
        if graphs is not None and graphs.tokens:  # steps stop at sizes with graphs
            self.scheduler.step_target = functools.partial(step_target, tuple(graphs.tokens))
        self._owns_model = not adopted
        # a caller's model may change between calls (a training loop): its prompt blocks
        # cached before are dropped when its weights, buffers or adapters did (None: not
        # checked: the engine's own model, which nothing else changes)
        self._weights: WeightsVersion | None = None
        self._in_flight: tuple[Batch, StepOutput] | None = None
        self._live: dict[str, int] = {}  # request id -> samples still running
        self._generating = False  # a generate call is open (its first result asked, not ended)
        # generate calls begun: a seed derived for a request without a seed key is keyed by
        # its id and its call, so each call draws new samples (as a vLLM LLM's calls do), the
        # first as in a fresh engine
        self._calls = 0
        self.stops = StopWatcher(tokenizer)  # stop strings are matched off this thread
        self._held: set[Request] = set()  # ended, waiting for the stop watcher's verdict
        self.profiler: StepProfiler | None = None  # told of every step (batchgen/profile)
        self.grammars: Grammars | None = None  # made when a structured output first comes
        self._compiling: list[tuple[list[Request], Future]] = []  # samples waiting for a grammar
        if self.config.check_model:
            try:
                check_model(self)  # a model batchgen would run wrongly is refused here
            except BaseException:
                self.close()  # the KV cache and graphs go now, not when the error is dropped
                raise
            self.blocks.clear_cache()  # the probe's prompts are not the caller's
            self.scheduler.cache_stats = CacheStats()
            clock.mark("model_check")
        if adopted:  # versions as the caller's first call finds them (the probe's are gone)
            self._weights = weights_version(self.model)
        self.startup_s = clock.phases  # phase -> seconds, in order (summary.json shows them)
        # Python's full collections walk every tracked object, the model's, torch's and
        # transformers' included: one took 0.27 s (378k objects) in a 2,048-row CPU job, all
        # threads stopped meanwhile. What start-up made lives as long as the engine, so it is
        # moved out of the collector's sight (as vLLM and SGLang do); close() gives it back.
        gc.freeze()

    # -- public API -------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptLike | Iterable[PromptLike],
        params: CallParams = None,
        *,
        decode: bool = True,
        stop: Event | None = None,
        check_outputs: bool = True,
    ) -> Iterator[RequestOutput]:
        """Yield each request's result as it finishes (not in input order).

        prompts: one prompt (a text, a flat list of token ids, a Prompt) or an iterable of
        them (as_prompts). params: one SamplingParams for every prompt, or a list of them, one
        per prompt of a list (with_params).

        decode: give each result its text. A structured output that ended because its grammar
        was complete is decoded and checked against its spec either way (output_problem; an
        error result if it does not match); check_outputs=False leaves that to a caller that
        decodes off this thread (such results keep `check` set: the job's writer does it).

        Prompts are pulled from the iterable only as the engine has room, so a caller can
        stream any number of them. A source that has nothing ready yet yields NOT_READY: the
        engine goes on with what it runs and asks again after the step (when it runs nothing,
        at once: such a source should wait a little before answering NOT_READY again).
        A bad prompt yields an error result; the rest go on.
        Once `stop` is set, the step in flight is finished and its results yielded; requests
        still running are dropped (their prompts yield nothing).
        """
        check_one_call(self._generating)
        self._drop_stale_prefixes()  # and the caller's generation_config as it is now
        source = with_params(as_prompts(prompts), call_params(params, self.generation_defaults))
        if self.runner is not None:
            self.runner.watch_modes()  # a caller's model may be in train mode now
        position = 0  # default ids count the prompts, not the NOT_READY answers
        ids = CallIds()  # each id once in the call
        exhausted = False
        failure: BaseException | None = None
        self._generating = True
        self._calls += 1
        try:
            while True:
                pulls = max(PULL_MIN, self.config.max_num_seqs // PULL_SHARE)
                while not exhausted and self._num_waiting() < self.config.max_num_seqs and pulls:
                    pulls -= 1
                    item = next(source, _END)
                    if item is _END:
                        exhausted = True
                        break
                    prompt, prompt_params = item
                    if prompt is NOT_READY:
                        break
                    rejected = self.add_request(prompt, prompt_params, str(position), ids)
                    position += 1
                    if rejected is not None:
                        yield rejected
                if not self.has_unfinished():
                    if exhausted:
                        return
                    if self.profiler is not None:
                        self.profiler.empty()
                    continue  # nothing to run: ask the source again (it may wait meanwhile)
                stopping = stop is not None and stop.is_set()
                for out in self.drain() if stopping else self.step():
                    yield self._with_text(out, decode, check_outputs)
                if stopping:
                    return
        except GeneratorExit:  # the caller stopped reading: no error of its own
            raise
        except BaseException as exc:
            failure = exc
            raise
        finally:
            try:
                self._end_call(failure)
            finally:
                self._generating = False

    def _end_call(self, failure: BaseException | None) -> None:
        """Drop what a generate call left unfinished (`failure`: the error ending it)."""
        if not self._abort_all_after(failure) or self._weights is None:
            return
        if weights_version(self.model) != self._weights:
            self.blocks.clear_cache()  # changed while it ran: the next call checks how

    def _abort_all_after(self, failure: BaseException | None) -> bool:
        """abort_all; when an error (`failure`) is on its way to the caller already, a second
        one here is noted on it, not raised over it. -> whether abort_all succeeded."""
        try:
            self.abort_all()
        except Exception as exc:
            if failure is None:
                raise
            note = f"dropping the unfinished requests then failed too: {exc!r}"
            if note not in getattr(failure, "__notes__", ()):
                failure.add_note(note)
            return False
        return True

    @property
    def fingerprint(self) -> dict[str, str]:
        """What decides outputs besides the settings (model_fingerprint); for a caller's
        model and tokenizer, those as they are now (a job resumes only on the same): the chat
        template a job renders its prompts with is the tokenizer's at the job's start."""
        self._drop_stale_prefixes()
        return {
            **self._fingerprint,
            **tokenizer_fingerprint(self.tokenizer),
            **eos_fingerprint(self.eos_token_ids),
        }

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block, so later prompts compute their KV again: for a
        model changed in a way generate cannot see (through `.data`), whose fingerprint (a
        checkpoint resumes only on the same) is then taken again. Blocks that running
        requests hold stay theirs, uncached."""
        self.blocks.clear_cache()
        if self._weights is not None:
            self._fingerprint = model_fingerprint(
                self.model, self.tokenizer, self.eos_token_ids, adopted=True
            )

    def _drop_stale_prefixes(self) -> None:
        """For a caller's model: its generation_config as it is now (its end-of-sequence ids
        and recommended sampling, read at each call as Hugging Face's generate reads them),
        and the cached prompt blocks forgotten if the model changed since they were computed
        (its weights' versions or addresses, its non-persistent buffers, its adapters' state
        or its modules differ)."""
        if self._weights is None or self.runner is None:
            return
        self._read_generation_config()
        now = weights_version(self.model)
        if now == self._weights:
            return
        self._check_fast_paths(now)
        self._weights = now
        self.reset_prefix_cache()

    def _read_generation_config(self) -> None:
        eos = eos_token_ids(self.model, self.tokenizer)
        if eos != self.eos_token_ids:
            self.eos_token_ids = eos
            if self.grammars is not None:  # its grammars end on the old ids
                self.grammars.close()
                self.grammars = None
        self.generation_defaults = model_sampling_defaults(self.model, self.config)

    def _check_fast_paths(self, now: WeightsVersion) -> None:
        """BatchgenError for a change that CUDA graphs or fused layers would not see: they
        read the tensors they were made with, and graphs replay the adapter layers' forward
        as it was when they were captured (with the adapters active then)."""
        graphs = self.runner.graphs is not None
        fused = self.runner.fusion is not None
        if now.addresses() != self._weights.addresses() and (graphs or fused):
            raise BatchgenError(
                "the model's weights were replaced by new tensors (or layers were added) since "
                "this engine started, and its CUDA graphs or fused layers read the old ones: "
                "update them in place (copy_, load_state_dict) or create a new engine"
            )
        if now.vocab_size != self._weights.vocab_size:
            raise BatchgenError(
                f"the model's vocabulary was resized ({self._weights.vocab_size} -> "
                f"{now.vocab_size} tokens: resize_token_embeddings) since this engine started, "
                "which sized its sampling for the old one: create a new engine"
            )
        if now.modules != self._weights.modules and (graphs or fused):
            raise BatchgenError(
                "the model's modules were replaced or their settings changed (an activation, "
                "a norm's eps, a wrapped layer) since this engine started, and its CUDA graphs "
                "or fused layers run them as they were: create a new engine"
            )
        if now.adapters != self._weights.adapters and graphs:
            raise BatchgenError(
                "the model's adapters were switched, enabled, disabled, merged or rescaled "
                "since this engine captured its CUDA graphs, which replay them as they were: "
                "create a new engine after such a change, or set cuda_graphs=False"
            )

    def add_request(
        self,
        prompt: PromptLike,
        params: SamplingParams,
        default_id: str,
        ids: CallIds | None = None,
    ) -> RequestOutput | None:
        """Queue one prompt; -> an error result instead if it cannot run (or, with a call's
        ids, if an earlier prompt of the call has its id)."""
        self._check_open()
        if not isinstance(prompt, Prompt):
            prompt = Prompt(prompt)
        given = prompt.request_id is not None
        request_id = str(prompt.request_id) if given else default_id
        taken = None if ids is None else ids.claim(request_id, given)
        if taken is not None:
            return RequestOutput(request_id, [], [], "error", f"request {request_id}: {taken}")
        try:
            ids, params, seed, max_tokens = self._check_request(request_id, prompt, params)
        except ValueError as exc:
            return RequestOutput(request_id, [], [], "error", f"request {request_id}: {exc}")
        n = params.n
        self._live[request_id] = n
        args = (request_id, ids, params, seed, max_tokens, self.eos_token_ids)
        samples = [  # each sample its own Request: they share the prompt, never any state
            Request(*args, sample_index=i, num_samples=n, rng_key=_mix(seed, i)) for i in range(n)
        ]
        spec = grammar_spec(params)
        if spec is None:
            self.scheduler.add_samples(samples[0], samples[1:])
            return None
        future = self._grammars().submit(spec)  # compiled in a thread, once per spec
        if future.done():
            return self._settle(samples, future)
        self._compiling.append((samples, future))
        return None

    def check_sampling(self, params: SamplingParams) -> None:
        """What a request's params must meet on this model, checked once for a job's
        [sampling] (one error, not one per row): stop_token_ids inside the vocabulary, and its
        structured output compiled now, a lane per fill thread (cached for its requests).
        ValueError saying what is wrong."""
        self._check_stop_ids(params)
        spec = grammar_spec(params)
        if spec is not None:
            self._grammars().prepare(spec)

    def _check_stop_ids(self, params: SamplingParams) -> None:
        vocab = self.shape.vocab_size
        bad = outside_vocab(params.stop_token_ids, vocab) if params.stop_token_ids else None
        if bad is not None:
            raise ValueError(stop_id_problem(bad, vocab))

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            busy, idle = fill_threads(self.config.cpu_threads)
            self.grammars = Grammars(
                self.tokenizer,
                self.shape.vocab_size,
                self.eos_token_ids,
                self.config.max_num_seqs,
                self.device,
                threads=idle,
                busy_threads=busy,
            )
        return self.grammars

    def _admit_compiled(self, wait: float) -> list[RequestOutput]:
        """Samples whose grammar is compiled enter the scheduler (each with its own matcher);
        a grammar that cannot be compiled ends its request as an error. Waits up to `wait` s."""
        if wait > 0:
            wait_futures([f for _, f in self._compiling], wait, return_when=FIRST_COMPLETED)
        errors, still = [], []
        for samples, future in self._compiling:
            if not future.done():
                still.append((samples, future))
            elif (error := self._settle(samples, future)) is not None:
                errors.append(error)
        self._compiling = still
        return errors

    def _settle(self, samples: list[Request], future: Future) -> RequestOutput | None:
        """A compiled grammar's samples go to the scheduler; a failed one's request ends."""
        request_id, problem = samples[0].request_id, future.exception()
        if problem is not None:
            del self._live[request_id]
            return RequestOutput(request_id, [], [], "error", f"request {request_id}: {problem}")
        for sample in samples:
            sample.grammar = self.grammars.matcher(future.result())
        self.scheduler.add_samples(samples[0], samples[1:])
        return None

    def _num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._compiling)

    def _check_open(self) -> None:
        if self.runner is None:
            raise RuntimeError("this engine is closed: create a new one")

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_work()
            or self._in_flight is not None
            or bool(self._held)
            or bool(self._compiling)
        )

    @property
    def cache_stats(self) -> CacheStats:
        """Prompt tokens admitted so far, and how many of them the prefix cache served."""
        return self.scheduler.cache_stats

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> launch -> post-process (step N-1's when overlapped)."""
        profiler = self.profiler
        if profiler is not None:
            profiler.schedule_begin()
        finished = []
        if self._compiling:  # structured-output samples whose grammar may have compiled
            quiet = not self.scheduler.has_work() and self._in_flight is None and not self._held
            finished = self._admit_compiled(VERDICT_WAIT_S if quiet else 0.0)
        batch = self.scheduler.schedule()
        if profiler is not None and batch.chunks:
            profiler.scheduled(batch)
        elif profiler is not None:
            profiler.empty()
        try:
            launched, done = self._launch(batch)
        except BaseException:
            self.blocks.clear_cache()  # blocks cached for this step may never be written
            raise
        if not self.config.overlap:
            previous = launched
        else:
            previous, self._in_flight = self._in_flight, launched
        idle = previous is None and launched is None and not done
        if idle and self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress with nothing in flight")
        finished += done + (self._postprocess(*previous) if previous is not None else [])
        return finished + self._apply_verdicts(VERDICT_WAIT_S if idle else 0.0)

    def _launch(self, batch: Batch) -> tuple[tuple[Batch, StepOutput] | None, list[RequestOutput]]:
        """-> the launched step (None for an empty batch), and the results of the step that was
        in flight when this one holds structured outputs.

        Such a step's token bitmask needs every earlier token of its samples. So its fill
        starts on the fill thread (which waits for the in-flight step's tokens itself), the
        forward is queued meanwhile, the step in flight is post-processed, and then the
        sampler is queued with the mask once the fill is done. Steps without structured
        outputs launch in one go.
        """
        if not batch.chunks:
            return None, []
        if self.grammars is None:  # no structured output yet: nothing per row to look at
            return (batch, self.runner.launch(batch)), []
        rows = [c.request for c in batch.chunks if c.samples]
        if all(r.grammar is None for r in rows):
            return (batch, self.runner.launch(batch)), []
        previous = self._in_flight
        in_flight = None
        if previous is not None:
            in_flight = InFlight([c.request for c in previous[0].chunks if c.samples], previous[1])
        eager = any(c.num_tokens > 1 for c in batch.chunks)  # prefill chunks: no decode graph
        job = self.grammars.start(rows, in_flight, busy=eager)
        try:
            begun = self.runner.begin(batch)
            self._in_flight = None
            done = self._postprocess(*previous) if previous is not None else []
            mask = self.grammars.finish(job, begun.logits.shape[0])
        except BaseException:
            self.grammars.abandon(job)  # no fill thread left running on a failed step
            raise
        return (batch, self.runner.sample(begun, mask)), done

    def close(self) -> None:
        """Drop queued work, give a caller's model back unchanged, and release the device
        memory now: the KV cache, graphs and buffers, and the model this engine loaded."""
        if self.runner is None:
            return
        try:  # in a `finally` or `with` that an error leaves, that error reaches the caller
            self._abort_all_after(sys.exception())
        finally:
            self._free_resources()

    def _free_resources(self) -> None:
        """close() after its requests are dropped."""
        self.stops.close()
        if self.grammars is not None:
            self.grammars.close()
            self.grammars = None
        self.runner.close()
        self.runner = None
        if self._owns_model:
            self.model = None
        gc.unfreeze()  # what start-up froze can be collected again
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:  # per-stream cuBLAS workspaces (graph capture made one)
                clear()
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def drain(self) -> list[RequestOutput]:
        """Post-process the step in flight, launching nothing new."""
        previous, self._in_flight = self._in_flight, None
        finished = self._postprocess(*previous) if previous is not None else []
        finished += self._apply_verdicts(0.0)
        while self._held:  # ended samples: only the watcher's verdict is missing
            finished += self._apply_verdicts(VERDICT_WAIT_S)
        return finished

    def abort_all(self) -> None:
        """Drop every queued and running request (a caller stopped consuming results)."""
        if self._in_flight is not None:
            wait_tokens(self._in_flight[1])
            if self.profiler is not None:
                self.profiler.drop_in_flight()
            for chunk in self._in_flight[0].chunks:
                chunk.request.num_pending -= chunk.samples
            self._in_flight = None
        while self.scheduler.has_work():  # finishing a request may release its other samples
            for request in list(self.scheduler.running) + list(self.scheduler.waiting):
                if request.params.stop:
                    self.stops.feed(request, (), final=True)  # the watcher forgets it
                self.scheduler.finish(request, "error")
        self._held.clear()
        self._compiling.clear()
        self._live.clear()
        self.blocks.check_released()

    # -- internals ---------------------------------------------------------------------------

    def _postprocess(self, batch: Batch, out: StepOutput) -> list[RequestOutput]:
        profiler = self.profiler
        if profiler is not None:
            profiler.post_begin()
        tokens = wait_tokens(out)
        if profiler is not None:
            profiler.post_ready()
        now = time.perf_counter()
        finished = []
        sampled = [c.request for c in batch.chunks if c.samples]
        done = Status.FINISHED
        for row, (request, token) in enumerate(zip(sampled, tokens, strict=True)):
            request.num_pending -= 1
            if request.status is done:
                continue  # ended at the previous step; this token was launched before we knew
            outputs = request.output_token_ids
            outputs.append(token)
            params = request.params
            if params.logprobs is not None:
                request.logprobs.append(
                    _token_logprobs(out.logprobs_host[row], token, params.logprobs)
                )
            if len(outputs) == 1:
                request.first_token_time = now
            reason = request.stop_reason(token)
            if params.stop:  # the watcher has the last word on how it ends
                self.stops.feed(request, (token,), final=reason is not None)
                if reason is not None:
                    self.scheduler.finish(request, reason)
                    self._held.add(request)
            elif reason is not None:
                finished.append(self._finish(request, reason))
        if profiler is not None:
            profiler.post_end()
        return finished

    def _apply_verdicts(self, wait: float) -> list[RequestOutput]:
        """Finish the samples the stop watcher matched; release the held ones it cleared."""
        if not self._held and wait > 0:
            wait = 0.0  # nothing ended waits for an answer
        finished = []
        for verdict in self.stops.verdicts(wait):
            request = verdict.request
            held = request in self._held
            if not held and request.status is Status.FINISHED:
                continue  # aborted meanwhile
            if verdict.text is not None:  # matched: what followed the match is dropped
                del request.output_token_ids[verdict.num_tokens :]
                del request.logprobs[verdict.num_tokens :]
                request.text = verdict.text
                if not held:
                    self.stops.feed(request, (), final=True)  # the watcher forgets it
                    self.scheduler.finish(request, "stop")
                request.finish_reason = "stop"
            self._held.discard(request)
            finished.append(self._output(request))
        return finished

    def _finish(self, request: Request, reason: str) -> RequestOutput:
        self.scheduler.finish(request, reason)
        return self._output(request)

    def _output(self, request: Request) -> RequestOutput:
        """The result of a sample that ended (the scheduler finished it)."""
        self._live[request.request_id] -= 1
        last = not self._live[request.request_id]
        if last:
            del self._live[request.request_id]
        outputs, state = request.output_token_ids, request.grammar
        check = None
        if state is not None and state.spec is not None and request.finish_reason == "stop":
            # a grammar allows the end-of-sequence token only once it is complete
            complete = bool(outputs) and outputs[-1] in self.eos_token_ids
            check = OutputCheck(state.spec, complete, state.failure)
        return RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            outputs,
            request.finish_reason,
            text=request.text,
            first_token_time=request.first_token_time,
            sample_index=request.sample_index,
            num_samples=request.num_samples,
            logprobs=request.logprobs if request.params.logprobs is not None else None,
            last=last,
            check=check,
            stop_token_hidden=(
                request.finish_reason == "stop"
                and request.text is None  # a stop string's match is cut by the watcher
                and bool(outputs)
                and outputs[-1] in request.ending_ids
                and not request.params.include_stop_str_in_output
            ),
        )

    def _check_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> tuple[list[int], SamplingParams, int, int]:
        """-> (prompt ids, the request's params, its seed, its token limit); ValueError."""
        if request_id in self._live:
            raise ValueError(f"id {request_id!r} is already running: ids must be unique")
        if isinstance(prompt.sampling, SamplingParams):
            params = prompt.sampling
        elif prompt.sampling:
            params = params.replace(**prompt.sampling)
        ids = self._prompt_ids(prompt.prompt)
        over = prompt_over_context(len(ids), self.max_model_len)
        if over is not None:
            raise ValueError(over)
        max_tokens = min(len(ids) + params.max_new_tokens, self.max_model_len)
        needed = blocks_for(max_tokens, self.config.block_size)
        if needed > self.num_blocks:
            raise ValueError(
                f"needs {needed} KV blocks but the cache has {self.num_blocks}: "
                "lower max_new_tokens or give the KV cache more memory"
            )
        self._check_stop_ids(params)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass stop_token_ids instead")
        if params.structured and self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer: pass one")
        if prompt.seed_key is not None:  # a job's row id: the same text in any run
            key = str(prompt.seed_key)
        else:
            key = request_id if self._calls <= 1 else f"{request_id}#{self._calls}"
        seed = params.seed if params.seed is not None else self._derived_seed(key)
        return ids, params, seed, max_tokens

    def _prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("text prompt but the engine has no tokenizer: pass token ids")
            check_unicode(prompt)
            return self._text_ids(prompt)
        vocab = self.shape.vocab_size
        if type(prompt) is VocabChecked and prompt.vocab == vocab and prompt:
            return list(prompt)  # found inside this vocabulary already (remote/protocol.py)
        ids = int64_ids(prompt)  # checked in C: a long prompt costs microseconds, not a millisecond
        if ids is None:
            raise ValueError(not_ids_reason(prompt))
        if not ids:
            raise ValueError("prompt is empty")
        checked = ids.tolist()  # min/max over a list's ints: about twice as fast as an array's
        bad = outside_vocab(checked, vocab)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return checked

    def _text_ids(self, text: str) -> list[int]:
        """A text prompt's ids, each inside the model's vocabulary (a tokenizer larger than the
        model's embedding would index past it); ValueError."""
        ids = list(self.tokenizer(text).input_ids)
        if not ids:
            raise ValueError("prompt is empty: its text has no tokens")
        check_one_bos(self.tokenizer, text, ids, "pass token ids")
        vocab = self.shape.vocab_size
        bad = outside_vocab(ids, vocab)
        if bad is not None:
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {vocab}): the tokenizer gives ids "
                "the model does not have; pass the model's own tokenizer"
            )
        return ids

    def _derived_seed(self, key: str) -> int:
        digest = hashlib.blake2b(
            f"{self.config.seed}:{key}".encode("utf-8", "surrogatepass"), digest_size=8
        )
        return int.from_bytes(digest.digest(), "little") >> 1

    def _with_text(self, out: RequestOutput, decode: bool, check: bool) -> RequestOutput:
        """out with its text when decode is set; checked against its grammar's spec when
        check is set and it is a complete structured output (then an error if it does not
        match, and `check` cleared once done)."""
        if self.tokenizer is None or out.finish_reason == "error":
            return out
        check = check and out.check is not None
        if not check and (not decode or out.text is not None):
            return out
        text = out.text
        if text is None:
            text = output_text(self.tokenizer, out.prompt_token_ids, out.text_token_ids)
        if not check:
            return out._replace(text=text)
        problem = output_problem(out.check, text)
        if problem is not None:
            error = f"request {out.request_id}: {problem}"
            return out._replace(text=None, finish_reason="error", error=error, check=None)
        return out._replace(text=text if decode else out.text, check=None)


class _PhaseClock:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self._last, 3)
        self._last = now


def _warm_triton_meanwhile() -> None:
    """Triton's per-process key, computed on a thread while the model loads (the first
    kernel launch comes after the load and the shape probe). The engine server computed it
    while it imported: then this finds it kept."""
    from batchgen.engine.first_use import warm_triton

    Thread(target=warm_triton, name="batchgen-triton-key", daemon=True).start()


def _mix(seed: int, sample_index: int) -> int:
    """The sampler's per-sample key: seed and sample index hashed to 63 bits."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _token_logprobs(row: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """row: [1 + 2K] float32 from the sampler's pack (K >= k); an alternative with id -1 (a
    token the row's structured output forbids) is left out."""
    width = (row.shape[0] - 1) // 2
    pairs = zip(row[1 + width : 1 + width + k].tolist(), row[1 : 1 + k].tolist(), strict=True)
    kept = [(int(i), v) for i, v in pairs if i >= 0]
    return TokenLogprobs(token, float(row[0]), [i for i, _ in kept], [v for _, v in kept])
