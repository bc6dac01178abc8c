"""Offline and streaming generation with in-flight batching: `LLM(engine_dir).generate(prompts, params)`."""

from __future__ import annotations

import functools
import itertools
import os
import queue
import sys
import weakref
from collections.abc import Sequence
from dataclasses import astuple
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from camshaft.errors import RequestError
from camshaft.manifest import read_manifest
from camshaft.runtime.block_manager import BlockCounters
from camshaft.runtime.chat_template import ChatOptions, load_chat_template
from camshaft.runtime.engine import Engine
from camshaft.runtime.executor import Executor
from camshaft.runtime.guided import Guides
from camshaft.runtime.kv_cache import memory_spec
from camshaft.runtime.llm_options import (
    check_llm_options,
    check_priority,
    check_runtime_options,
    params_list,
    priorities,
    prompt_list,
)
from camshaft.runtime.llm_streams import ServingAPI
from camshaft.runtime.outputs import GenerationResult, IterationStats, Load, PromptOutput, RequestOutput
from camshaft.runtime.prompt_lookup import PromptLookup, as_prompt_lookup
from camshaft.runtime.prompts import Prompt, PromptEncoder, prompt_said_as_messages
from camshaft.runtime.request import Request, new_requests
from camshaft.runtime.sampling_params import SamplingParams, model_defaults
from camshaft.runtime.scheduler_config import SchedulerConfig


class _Progress(tqdm):
    monitor_interval = 0  # tqdm's monitor thread would outlive the LLM (tqdm stops it only at exit)


class LLM(ServingAPI):
    """Many requests on one engine with in-flight batching: `generate` for offline batches (results in input order),
    `stream` / `submit` for servers. Safe to call from many threads and from asyncio at once; `close()` (or `with`)
    ends the batch loop. Bad input raises RequestError before anything runs."""

    def __init__(self, engine_dir: str | Path, *, policy: str = "guaranteed_no_evict",
                 max_batch_size: int | None = None, max_num_tokens: int | None = None,
                 kv_cache_memory: int | float | str | None = None, threads: int | None = None,
                 max_queue: int | None = None, spin_wait: bool = True, huge_pages: bool = True,
                 kv_reservation: str = "paged", prompt_lookup: PromptLookup | int | None = None,
                 chat_template: str | Path | None = None) -> None:
        """max_batch_size, max_num_tokens: at most the engine's (the default). kv_cache_memory: the KV pool's budget
        (kv_cache.memory_spec): bytes, also with a unit ("512MiB", "2GB"), or a fraction of the memory available once
        the weights are loaded (a number between 0 and 1, 1.0 for all of it); None: room for max_batch_size
        full-length sequences. max_queue: sequences (a request of n outputs counts n) allowed to wait beyond a full
        batch before submit raises ServerBusyError (servers; generate() queues all its prompts whatever it is);
        spin_wait=False stops idle onnxruntime threads spinning (servers that mostly wait); huge_pages: the weights
        on transparent huge pages (Linux; see runtime/backends/huge_pages.py); kv_reservation "contiguous" reserves
        max_seq_len tokens of KV blocks per request, as a cache without paging would (for comparisons). prompt_lookup
        (a PromptLookup, or its num_tokens): decodes also feed drafts from their own text, checked in the same step
        (runtime/prompt_lookup.py): the same outputs, faster where text repeats and the batch is small.
        chat_template: a Jinja chat template (a file, or the text) in place of the engine tokenizer's."""
        check_runtime_options(threads, spin_wait, huge_pages)
        manifest = read_manifest(Path(engine_dir))
        limits = manifest.limits
        batch, tokens = astuple(check_llm_options(
            limits, policy=policy, kv_reservation=kv_reservation, max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens, max_queue=max_queue))
        lookup = as_prompt_lookup(prompt_lookup)
        template = None if chat_template is None else load_chat_template(chat_template)
        # bytes, or a fraction the engine resolves once its weights are loaded
        self.kv_cache_memory = memory_spec(kv_cache_memory)
        self.engine = engine = Engine(engine_dir, max_sequences=batch, kv_cache_memory=self.kv_cache_memory,
                                      threads=threads, spin_wait=spin_wait, huge_pages=huge_pages, manifest=manifest)
        self.config = SchedulerConfig(
            num_blocks=engine.pool.num_blocks, block_size=engine.block_size, max_batch_size=batch,
            max_num_tokens=tokens, max_seq_len=limits.max_seq_len, policy=policy, kv_reservation=kv_reservation,
            prompt_lookup=lookup, sliding_window=manifest.model.attention_window, long_rope=engine.long_rope)
        self.tokenizer = engine.tokenizer
        if template is not None:
            self.tokenizer.chat_template = template
        self.prompts = PromptEncoder(self.tokenizer, limits.max_seq_len, manifest.model.vocab_size)
        self._guides = Guides(self.tokenizer, manifest.model.vocab_size, engine.eos_token_ids)
        self.executor = Executor(engine, self.config, max_queue=max_queue)
        # what one request may hold of the pool (a contiguous reservation takes max_seq_len whatever it asks for; a
        # request that releases what its sliding window passed holds its window, where the pool holds that)
        windowed = self.config.releases_blocks and self.config.window_blocks <= engine.pool.capacity
        self._kv_tokens = engine.token_budget if kv_reservation == "paged" and not windowed else None
        self._ids = itertools.count()
        # closed when dropped without close(), and at interpreter exit: the loop thread would otherwise keep the
        # engine alive, or still be inside onnxruntime as the process ends
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _shutdown, self.executor, engine, self._pid)

    @property
    def stats(self) -> list[IterationStats]:
        """Per-iteration stats of the batch loop's latest steps (Executor's stats_window), oldest first;
        executor.steps_done counts them all."""
        return self.executor.snapshot_stats()

    @property
    def kv_cache(self) -> BlockCounters:
        """Blocks total/used/free/cached, prefix reuse hits and evictions (a snapshot)."""
        return self.executor.scheduler.blocks.counters()

    @property
    def alive(self) -> bool:
        """The batch loop runs and takes requests: False once closed, or after the loop itself failed (a health
        check's answer; create a new LLM then)."""
        return self.executor.alive

    def load(self) -> Load:
        """Running and waiting requests, KV blocks in use, prefix-cache hits (a snapshot)."""
        return self.executor.load()

    def close(self) -> None:
        again = not self._finalizer.alive
        self._finalizer()
        self.executor.join()  # a second close, on another thread, returns once the first has stopped the loop too
        if again and os.getpid() == self._pid:  # the first one interrupted (Ctrl-C) while it waited for the loop
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: Prompt | None = None, messages: list[dict[str, Any]] | None = None, *,
               tools: list[dict[str, Any]] | None = None, for_generation: bool = True,
               chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, most_counted: int | None = None) -> list[int]:
        """Prompt token ids of a prompt (text or ids) or of chat messages (the tokenizer's chat template, with the
        chat keywords of chat()) — vLLM's tokenizing, not its pooling `encode`. for_generation True refuses an empty
        prompt and stops tokenizing text far longer than the engine takes (generation checks the exact length);
        False (counting tokens): an empty prompt is tokenized, and text up to `most_counted` tokens (None: however
        long; past it a CapacityError, after tokenizing a prefix)."""
        chat = ChatOptions(tools, chat_template_kwargs, add_generation_prompt, continue_final_message)
        return self.prompts.encode(prompt, messages, chat=chat, for_generation=for_generation,
                                   most_counted=most_counted)

    def _requests(self, prompt: Prompt, params: SamplingParams, priority: int = 0) -> list[Request]:
        priority = check_priority(priority)
        ids = self.prompts.encode(prompt)
        params = params.for_prompt(len(ids), self.config.max_seq_len, self._kv_tokens)
        return new_requests(str(next(self._ids)), ids, params, self.tokenizer, self.engine.eos_token_ids,
                            self.engine.manifest.model.vocab_size, priority, self._guides)

    def get_default_sampling_params(self) -> SamplingParams:
        return self._default_params

    @functools.cached_property
    def _default_params(self) -> SamplingParams:  # frozen: one for every request that leaves its params out
        return model_defaults(self.engine.manifest.model)

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's accessor; also `llm.tokenizer`)."""
        return self.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | None = None, priority: int | Sequence[int] | None = None) -> list[PromptOutput]:
        """Generate for every prompt with in-flight batching; results come back in input order. A prompt is text,
        token ids or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}. `sampling_params`: one for all or one per
        prompt. `priority`: one for all or one per prompt, lower first (vLLM's meaning); None: all equal, first
        come, first served. `use_tqdm`: a progress bar on stderr (None: when stderr is a terminal)."""
        prompts = prompt_list(prompts)
        return self._generate(prompts, [_text_of(p) for p in prompts], sampling_params, use_tqdm, priority)

    def _generate(self, prompts: list, texts: list[str | None], sampling_params, use_tqdm: bool | None,
                  priority: int | Sequence[int] | None, what: str = "prompt") -> list[PromptOutput]:
        self.executor.check_may_wait("generate()")
        params = params_list(sampling_params, len(prompts), self.get_default_sampling_params())
        each = priorities(priority, len(prompts))
        groups = []
        for i, (prompt, sp, pr) in enumerate(zip(prompts, params, each, strict=True)):
            try:
                groups.append(self._requests(prompt, sp, pr))
                for request in groups[-1]:  # one that can never fit, before any other runs
                    self.executor.scheduler.check(request)
            except RequestError as exc:  # which of several was refused
                raise _numbered(exc, what, i, len(prompts)) from None
        done: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        where = {r.request_id: (i, j) for i, group in enumerate(groups) for j, r in enumerate(group)}
        submitted = []
        enabled = sys.stderr is not None and sys.stderr.isatty() if use_tqdm is None else use_tqdm
        try:
            for group in groups:
                submitted.extend(r.request_id for r in group)  # first: an interrupt between the two leaks nothing
                self.executor.submit(group, [_finals(done)] * len(group), bounded=False)
            results: list[list[GenerationResult | None]] = [[None] * len(g) for g in groups]
            bar = _Progress(total=len(where), desc="generate", unit="req") if enabled else None
            try:
                for _ in range(len(where)):
                    output = done.get()
                    i, j = where[output.request_id]
                    if output.error is not None:  # the batch returns whole or raises: the others are cancelled
                        raise _numbered(output.error, what, i, len(prompts))
                    results[i][j] = output.result
                    if bar is not None:
                        bar.update(1)
            finally:
                if bar is not None:
                    bar.close()
        except BaseException:
            for request_id in submitted:
                self.executor.abort(request_id)
            raise
        return [PromptOutput(g[0].prompt_ids, list(r), g[0].prompt_id, text)
                for g, r, text in zip(groups, results, texts, strict=True)]

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool | None = None, priority: int | Sequence[int] | None = None,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[PromptOutput]:
        """generate() for one conversation (a list of {"role", "content"} messages) or a list of them, each through
        the tokenizer's chat template with the assistant's turn opened (or, with continue_final_message and
        add_generation_prompt False, the last message left open for the model to go on with); `tools`: the
        functions the model may call; `chat_template_kwargs`: more variables the template reads (e.g. Qwen3's
        enable_thinking)."""
        if not isinstance(messages, (list, tuple)):
            raise RequestError(f"messages must be a list of {{'role', 'content'}} dicts or a list of such lists, got "
                               f"{messages!r:.80}", field="messages")
        chat = ChatOptions(tools, chat_template_kwargs, add_generation_prompt, continue_final_message)
        conversations = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        rendered = []
        with prompt_said_as_messages(True):
            for i, conversation in enumerate(conversations):
                try:
                    rendered.append(self.prompts.chat_prompt(list(conversation), chat))
                except RequestError as exc:
                    raise _numbered(exc, "conversation", i, len(conversations)) from None
            return self._generate([ids for _, ids in rendered], [text for text, _ in rendered], sampling_params,
                                  use_tqdm, priority, what="conversation")


def _numbered(exc: BaseException, what: str, i: int, count: int) -> BaseException:
    """A request's error (RequestError) of item i of several, saying which (one alone needs no number); other
    errors (an engine step's, shared by every request in it) as they are."""
    if count > 1 and isinstance(exc, RequestError):
        return type(exc)(f"{what} {i}: {exc}", field=exc.field)
    return exc


def _text_of(prompt: Prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None


def _finals(done: queue.SimpleQueue):
    return lambda output: done.put(output) if output.finished else None


def _shutdown(executor: Executor, engine: Engine, pid: int) -> None:
    if os.getpid() != pid:  # a forked child's copy: destroying the parent's ONNX Runtime session there hangs
        return
    executor.close()
    engine.close()
