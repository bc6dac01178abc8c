"""Session: one request at a time, lowest latency. `Session(engine_dir).generate(prompt)`."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import weakref
from collections.abc import Generator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from camshaft.errors import EngineError, RequestError, ServerClosedError
from camshaft.manifest import read_manifest
from camshaft.runtime.batch_sequence import BatchGraphSequence
from camshaft.runtime.chat_template import ChatOptions, load_chat_template
from camshaft.runtime.engine import Engine
from camshaft.runtime.guided import Guides
from camshaft.runtime.kv_cache import memory_spec, pool_blocks
from camshaft.runtime.llm_options import check_runtime_options, params_list
from camshaft.runtime.outputs import GenerationResult
from camshaft.runtime.prompt_lookup import PromptLookup, as_prompt_lookup, checks_drafts
from camshaft.runtime.prompts import Prompt, PromptEncoder, prompt_said_as_messages
from camshaft.runtime.request import Request, new_requests
from camshaft.runtime.sampling_params import SamplingParams, model_defaults
from camshaft.runtime.sequence import SequenceEngine
from camshaft.runtime.session_drafts import decode_with_drafts

_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


GRAPHS = ("auto", "sequence", "batch")


class Session:
    """`graph`: "auto" runs the engine's sequence graph where it has one (onnxruntime engines built by this
    camshaft: the fastest for one request), else its batch graph; "sequence" or "batch" insists on one.
    `kv_cache_memory` bounds the KV cache of either graph (bytes, "512MiB", or a fraction of available memory:
    kv_cache.memory_spec). `huge_pages`: the weights on transparent huge
    pages (Linux; see runtime/backends/huge_pages.py). `prompt_lookup` (a PromptLookup, or its num_tokens): decode with
    drafts copied from the prompt and output (runtime/prompt_lookup.py): the same output, faster where text repeats."""

    def __init__(self, engine_dir: str | Path, *, threads: int | None = None,
                 kv_cache_memory: int | float | str | None = None, graph: str = "auto", huge_pages: bool = True,
                 prompt_lookup: PromptLookup | int | None = None, chat_template: str | Path | None = None):
        if graph not in GRAPHS:
            raise RequestError(f"graph must be one of {', '.join(GRAPHS)}; got {graph!r}")
        check_runtime_options(threads, huge_pages=huge_pages)
        prompt_lookup = as_prompt_lookup(prompt_lookup)
        template = None if chat_template is None else load_chat_template(chat_template)
        manifest = read_manifest(engine_dir)
        kv_cache_memory = memory_spec(kv_cache_memory)
        sequence = graph == "sequence" or (graph == "auto" and manifest.sequence_graph is not None)
        if prompt_lookup is not None and sequence and not checks_drafts(manifest):
            raise EngineError(f"{engine_dir}: its sequence graph gives logits for one token a step, so it cannot check "
                              "drafts; rebuild the engine with this camshaft for prompt lookup, run it on its batch "
                              "graph (graph=\"batch\"), or without prompt_lookup")
        if sequence:
            self.engine: SequenceEngine | BatchGraphSequence = SequenceEngine(
                engine_dir, threads=threads, manifest=manifest, kv_cache_memory=kv_cache_memory,
                huge_pages=huge_pages)
        else:
            # a budget bounds the pool: one sequence never uses more than a full-length one's
            self.engine = BatchGraphSequence(Engine(engine_dir, max_sequences=1, kv_cache_memory=kv_cache_memory,
                                                    most_blocks=pool_blocks(manifest, 1), threads=threads,
                                                    huge_pages=huge_pages, manifest=manifest))
        self.graph = "sequence" if isinstance(self.engine, SequenceEngine) else "batch"
        self.prompt_lookup = prompt_lookup
        self.draft_tokens = self.accepted_draft_tokens = 0  # prompt lookup's drafts, over this Session's requests
        self.tokenizer = self.engine.tokenizer
        if template is not None:
            self.tokenizer.chat_template = template
        self.prompts = PromptEncoder(self.tokenizer, manifest.limits.max_seq_len, manifest.model.vocab_size)
        self._guides = Guides(self.tokenizer, manifest.model.vocab_size, self.engine.eos_token_ids)
        self._ids = itertools.count()
        self._running = threading.Lock()  # held by the request in progress, between its tokens too
        # held inside the engine: no step runs after a close has taken it (reentrant: a signal handler's close()
        # runs on the thread that is inside the step)
        self._stepping = threading.RLock()
        self._stopped = threading.Event()
        # on close, on garbage collection, and at exit: a step in another thread (a daemon's) must end first, or
        # ONNX Runtime aborts the process as it exits
        self._finalizer = weakref.finalize(self, _shutdown, self._stopped, self._stepping, self._running,
                                           self.engine, os.getpid())

    @property
    def _closed(self) -> bool:
        return self._stopped.is_set()

    def close(self) -> None:
        """Release the engine now (after the step in progress, if any); a request running in another thread ends
        with a ServerClosedError and releases it then."""
        self._finalizer()

    def _release_engine_if_idle(self) -> None:
        _release_if_idle(self._running, self.engine)

    @contextlib.contextmanager
    def _step(self) -> Generator[None, None, None]:
        with self._stepping:
            self._check_open()
            yield

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def manifest(self):
        return self.engine.manifest

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of the loaded engine on transparent huge pages (0: off, or not possible here)."""
        return self.engine.huge_page_bytes

    def encode(self, prompt: Prompt | None = None, messages: list[dict[str, Any]] | None = None, *,
               tools: list[dict[str, Any]] | None = None, for_generation: bool = True,
               chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> list[int]:
        """The prompt's ids as generation feeds them to the engine (PromptEncoder.encode); with messages, the chat
        keywords as vLLM's LLM.chat takes them."""
        chat = ChatOptions(tools, chat_template_kwargs, add_generation_prompt, continue_final_message)
        return self.prompts.encode(prompt, messages, chat=chat, for_generation=for_generation)

    def _params(self, params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
        unknown = set(overrides) - _PARAM_NAMES
        if unknown:
            hint = " (the SamplingParams keyword is sampling_params)" if "params" in unknown else ""
            raise RequestError(f"unknown sampling parameter(s) {sorted(unknown)}{hint}; known: "
                               f"{sorted(_PARAM_NAMES)}")
        params = replace(params_list(params, 1, model_defaults(self.manifest.model))[0], **overrides)
        if params.n > 1:
            raise RequestError(f"a Session gives one output per request (n={params.n}); for several outputs of one "
                               "prompt use camshaft.LLM(engine_dir).generate(prompt, SamplingParams(n=...))")
        if params.prompt_logprobs is not None:
            raise RequestError("a Session computes only the last prompt row's logits; for prompt_logprobs use "
                               "camshaft.LLM(engine_dir).generate(prompt, SamplingParams(prompt_logprobs=...))")
        return params

    def _request(self, ids: list[int], params: SamplingParams) -> Request:
        params = params.for_prompt(len(ids), self.manifest.limits.max_seq_len, self.engine.token_budget)
        return new_requests(str(next(self._ids)), ids, params, self.tokenizer, self.engine.eos_token_ids,
                            self.manifest.model.vocab_size, guides=self._guides)[0]

    def stream(self, prompt: Prompt | None = None, sampling_params: SamplingParams | None = None, *,
               messages: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
               chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, **overrides: Any) -> Generator[str, None, GenerationResult]:
        """Text deltas as they become safe; they concatenate to the generated text, and the generator returns the
        GenerationResult (StopIteration.value). Bad input raises here, before the first delta; timings count from
        the first delta asked for. The chat keywords: as encode() takes them, with messages."""
        ids = self.encode(prompt, messages, tools=tools, chat_template_kwargs=chat_template_kwargs,
                          add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
        with prompt_said_as_messages(messages is not None):
            request = self._request(ids, self._params(sampling_params, overrides))
            self._check_open()  # what _run checks again when the first delta is asked for, said here
            self._check_idle()
            self.engine.check_fits(len(request.prompt_ids) + request.params.max_tokens)
        return self._run(request)

    def generate(self, prompt: Prompt | None = None, sampling_params: SamplingParams | None = None, *,
                 messages: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, **overrides: Any) -> GenerationResult:
        """One request: `sampling_params` and/or SamplingParams fields as keywords (max_tokens=..., which win)."""
        generator = self.stream(prompt, sampling_params, messages=messages, tools=tools,
                                chat_template_kwargs=chat_template_kwargs, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, **overrides)
        with contextlib.closing(generator):  # a stop landing here still ends the request (the Session not busy)
            try:
                while True:
                    next(generator)
            except StopIteration as stop:
                return stop.value

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None, *,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             **overrides: Any) -> GenerationResult:
        """generate() for a conversation; `tools`: the functions the model may call (rendered into the prompt);
        `chat_template_kwargs`: more variables the chat template reads (e.g. Qwen3's enable_thinking);
        `continue_final_message` (with add_generation_prompt False): the model goes on with the last message, e.g.
        an assistant reply begun."""
        if not isinstance(messages, (list, tuple)):
            raise RequestError(f"messages must be a list of {{'role', 'content'}} dicts, got {messages!r:.80}",
                               field="messages")
        if messages and isinstance(messages[0], (list, tuple)):
            raise RequestError("a Session answers one conversation at a time; pass one list of messages, or use "
                               "camshaft.LLM(engine_dir).chat for several at once", field="messages")
        return self.generate(messages=messages, sampling_params=sampling_params, tools=tools,
                             chat_template_kwargs=chat_template_kwargs, add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message, **overrides)

    def _check_idle(self) -> None:
        if self._running.locked():
            raise _busy()

    def _run(self, request: Request) -> Generator[str, None, GenerationResult]:
        if not self._running.acquire(blocking=False):
            raise _busy()
        engine = self.engine
        try:
            request.arrival = time.perf_counter()
            with self._step():
                engine.start(request.max_length, request.longest_pass)
        except BaseException:
            self._running.release()
            if self._closed:  # a close() that found the lock taken left the engine to this request
                self._release_engine_if_idle()
            raise
        request.admitted_at = time.perf_counter()
        try:
            budget = engine.limits.max_num_tokens
            prompt = request.prompt_ids
            logits = None
            engine.screen(request.sampler.plain_greedy)
            while request.num_computed < len(prompt):
                start = request.num_computed
                piece = prompt[start: start + budget]
                with self._step():
                    logits = engine.feed(piece, start, copy=False, last=start + len(piece) == len(prompt))
                request.num_computed += len(piece)
            if self.prompt_lookup is not None:
                return (yield from decode_with_drafts(engine, self.prompt_lookup, request, logits, self._step,
                                                      self._check_open))
            while True:
                delta = request.add_sample(request.sampler.sample(logits))
                if delta:
                    yield delta
                if request.finished:
                    return request.result()
                engine.screen(request.sampler.plain_greedy)  # min_tokens' ban ends: from then on it may
                with self._step():
                    logits = engine.feed([request.output_ids[-1]], request.num_computed, copy=False)
                request.num_computed += 1
        finally:
            self.draft_tokens += request.draft_tokens
            self.accepted_draft_tokens += request.accepted_draft_tokens
            engine.finish()
            self._running.release()
            if self._closed:  # closed while this request ran
                self._release_engine_if_idle()

    def _check_open(self) -> None:
        if self._closed:
            raise ServerClosedError("this Session is closed; create a new Session to generate")


def _shutdown(stopped: threading.Event, stepping: threading.RLock, running: threading.Lock, engine, pid: int) -> None:
    stopped.set()
    if os.getpid() != pid:  # a forked child's copy: the parent's ONNX Runtime session is not its to close
        return
    with stepping:  # the step in progress ends; none starts after
        _release_if_idle(running, engine)  # else the request in progress releases it as it ends


def _release_if_idle(running: threading.Lock, engine) -> None:
    if running.acquire(blocking=False):
        try:
            engine.close()
        finally:
            running.release()


def _busy() -> RequestError:
    return RequestError("a Session runs one request at a time and another is in progress; finish or close its stream "
                        "first, or use camshaft.LLM for concurrent requests")
