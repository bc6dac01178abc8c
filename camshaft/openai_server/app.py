"""The FastAPI app: `create_app(llm, model_name)`. The caller owns the LLM (and closes it)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from camshaft.errors import CamshaftError, CapacityError, EngineError
from camshaft.openai_server import errors
from camshaft.openai_server.api_key import ApiKey
from camshaft.openai_server.body_limit import BodyLimit, max_body_bytes
from camshaft.openai_server.chat_protocol import DetokenizeRequest, TokenizeRequest
from camshaft.openai_server.errors import APIError, from_exception, route_path
from camshaft.openai_server.generation import Generation
from camshaft.openai_server.metrics import CONTENT_TYPE, Metrics
from camshaft.openai_server.protocol import DEFAULT_COMPLETION_TOKENS, ChatCompletionRequest, CompletionRequest
from camshaft.openai_server.request_ids import RequestIds
from camshaft.openai_server.responses import ChatShape, CompletionShape
from camshaft.openai_server.streaming import EventStream, events, unless_disconnected
from camshaft.openai_server.tool_calls import PARSERS as TOOL_CALL_PARSERS
from camshaft.openai_server.tools import tool_choice
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.version import __version__

TOKENIZE_CONTEXTS = 4  # /tokenize counts up to this many contexts' tokens

LOG = logging.getLogger("camshaft.openai_server")

_Shape = CompletionShape | ChatShape


def create_app(llm: LLM, model_name: str, api_key: str | None = None, tool_call_parser: str | None = None,
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """api_key: every route but /health, /metrics and /version asks for it as a bearer token (None: none).
    tool_call_parser: how tool calls are read from text the model chose to write (tool_calls.PARSERS; None:
    tool_choice "auto" is refused). allowed_origins: the web page origins browsers may call it from (CORS; "*": any).
    """
    if tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        raise CamshaftError(f"unknown tool call parser {tool_call_parser!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    app = FastAPI(title="camshaft OpenAI-compatible API")
    metrics = Metrics(llm)
    errors.install(app, metrics)
    max_seq_len, max_n = llm.config.max_seq_len, llm.config.max_batch_size
    sampling_defaults = llm.engine.manifest.model.sampling_defaults
    routes = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models"}

    def refused(path: str, status: int) -> None:
        metrics.http(path if path in routes else "other", status)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes(max_seq_len, max_n, llm.executor.max_queue),
                       refused=refused)
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key, refused=refused)  # before a body is read
    if allowed_origins:  # before the key: a browser's preflight carries none
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIds)  # added last: runs first (every refusal carries the id)
    app.state.llm, app.state.metrics, app.state.cutting = llm, metrics, threading.Event()  # cutting: set by serve

    created = int(time.time())

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "camshaft", "root": model_name,
                "parent": None, "max_model_len": max_seq_len}

    def check_model(model: str | None) -> None:
        if model and model != model_name:  # absent or "": the served model (vLLM's)
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r} "
                           "(see /v1/models)", param="model", code="model_not_found")

    def check(body: CompletionRequest | ChatCompletionRequest, log_id: str) -> None:
        check_model(body.model)
        body.check_supported()
        options = body.stream_options.model_extra if body.stream_options else None
        ignored = sorted(body.model_extra or ()) + [f"stream_options.{name}" for name in sorted(options or ())]
        if ignored:  # fields camshaft has no use for (user, store, ...), or a typo: said, as vLLM does
            LOG.warning("%s: fields present in the request but ignored: %s", log_id, ", ".join(ignored))
        if body.n > max_n:
            raise APIError(400, f"n must be at most {max_n} (this server's batch size), got {body.n}", param="n")

    async def prompt_ids(max_tokens: int | None = None, **prompt: Any) -> list[int]:
        """The prompt's ids, refused in vLLM's words (which clients match to trim) when the context cannot hold it
        and max_tokens more."""
        what = "messages" if "messages" in prompt else "prompt"

        def too_long(detail: str) -> APIError:
            return APIError(400, f"This model's maximum context length is {max_seq_len} tokens. However, {detail}",
                            param=what, code="context_length_exceeded")

        try:
            ids = await asyncio.to_thread(llm.encode, **prompt)  # a long prompt must not stall the open streams
        except CapacityError as exc:  # far too long: refused after tokenizing a prefix
            raise too_long(f"your request has more input tokens ({exc}).") from None
        except EngineError as exc:  # the engine's chat template does not parse: the server's files, not the request
            raise from_exception(exc) from None
        if len(ids) >= max_seq_len:
            raise too_long(f"your request has {len(ids)} input tokens. Please reduce the length of the {what} (the "
                           "output needs room too).")
        if max_tokens is not None and len(ids) + max_tokens > max_seq_len:
            raise too_long(f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the {what}, {max_tokens} in "
                           f"the completion). Please reduce the length of the {what} or completion.")
        return ids

    async def respond(request: Request, stream: bool, stream_usage: str | None, prompts: list[list[int]],
                      params: SamplingParams, shape: _Shape, arrival: float, priority: int = 0) -> Response:
        if params.guided_decoding is None:
            generation = Generation(llm, prompts, params, metrics, arrival, priority, shape.shows_output,
                                    log_id=shape.id, cutting=app.state.cutting)
        else:  # compiling a grammar takes a while: not on the loop every stream shares
            generation = await asyncio.to_thread(Generation, llm, prompts, params, metrics, arrival, priority,
                                                 shape.shows_output, asyncio.get_running_loop(), shape.id,
                                                 app.state.cutting)
        request.state.generating = True  # its end is Generation's to log
        with_logprobs = params.logprobs is not None
        if stream:
            metrics.http(route_path(request), 200)
            return EventStream(events(generation, shape, with_logprobs, stream_usage))
        try:
            results = await unless_disconnected(request, generation.results())
        except Exception as exc:  # answered as an APIError: an unhandled one would also close the connection
            raise from_exception(exc) from exc  # (the batch loop logged a failed step's traceback)
        finally:
            generation.abort()
        metrics.http(route_path(request), 200 if results is not None else 499)
        if results is None:
            return Response(status_code=499)  # nobody is listening
        completion_tokens = sum(len(r.token_ids) for r in results) if shape.shows_output else 0

        def response() -> JSONResponse:  # n outputs with their log-probs: seconds of work, off the shared loop
            choices = [shape.choice(i, r, with_logprobs) for i, r in enumerate(results)]
            return JSONResponse(shape.response(choices, generation.prompt_tokens, completion_tokens))

        return await asyncio.to_thread(response)

    @app.get("/health")
    async def health(request: Request) -> dict:
        if not llm.alive:
            raise APIError(503, "the batch loop has stopped; restart the server", type="server_error")
        metrics.http(route_path(request), 200)  # as its 503s are: a failure ratio needs both
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        metrics.http(route_path(request), 200)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")  # a served name may hold slashes (org/model)
    async def model(model: str, request: Request) -> dict:
        if model != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        metrics.http(route_path(request), 200)
        return model_card()

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        metrics.http(route_path(request), 200)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        check_model(body.model)
        body.check_supported()
        prompt = {"prompt": body.prompt} if body.prompt is not None else \
            {"messages": [m.template_dict() for m in body.messages or []], "tools": body.prompt_tools(),
             **body.chat_keywords()}
        most = TOKENIZE_CONTEXTS * max_seq_len  # ~480 bytes a token while tokenized (BENCHMARKS.md)
        try:
            ids = await asyncio.to_thread(llm.encode, **prompt, for_generation=False, most_counted=most)
        except CapacityError:
            what = "prompt" if body.prompt is not None else "messages"
            raise APIError(400, f"/tokenize counts at most {most} tokens ({TOKENIZE_CONTEXTS} times this model's "
                           f"maximum context length, {max_seq_len}); the {what} holds more: send it in parts",
                           param=what) from None
        metrics.http(route_path(request), 200)
        return {"count": len(ids), "max_model_len": max_seq_len, "tokens": ids,
                **({"token_strs": llm.tokenizer.convert_ids_to_tokens(ids)} if body.return_token_strs else {})}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        check_model(body.model)
        vocab = llm.engine.manifest.model.vocab_size
        wrong = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if wrong is not None:
            raise APIError(400, f"token id {wrong} is outside this model's vocabulary [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(llm.tokenizer.decode, body.tokens)
        metrics.http(route_path(request), 200)
        return {"prompt": text}

    @app.get("/version")
    async def version(request: Request) -> dict:
        metrics.http(route_path(request), 200)
        return {"version": __version__}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        with body.fields_named():
            return await complete(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        with body.fields_named():
            return await complete_chat(body, request)

    async def complete(body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        log_id = request.state.response_id
        check(body, log_id)
        outputs, limit = body.n * len(body.prompts()), llm.executor.max_queue
        if limit is not None and outputs > max_n + limit:  # never fits, however long the client waits: not 503
            raise APIError(400, f"{outputs} outputs (prompts x n) can never be in flight at once: this server holds "
                           f"{max_n + limit} (batch {max_n} + queue {limit}); send fewer prompts per request",
                           param="prompt")
        max_tokens = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
        prompts = [await prompt_ids(prompt=p, max_tokens=max_tokens) for p in body.prompts()]
        # echo with max_tokens 0: one token, dropped
        params = body.sampling_params(max_tokens or 1, body.logprobs, sampling_defaults)
        if body.echo and body.logprobs is not None:
            params = replace(params, prompt_logprobs=body.logprobs)
        texts = [p if isinstance(p, str) else llm.tokenizer.decode(p, skip_special_tokens=params.skip_special_tokens)
                 for p in body.prompts()] if body.echo else None  # echo: the prompts as sent
        shape = CompletionShape(model_name, llm.tokenizer, prompts, params.n, params.skip_special_tokens,
                                echo="prompt" if max_tokens == 0 else "prompt+output" if body.echo else None,
                                prompt_texts=texts, response_id=log_id)
        return await respond(request, body.stream, body.stream_usage, prompts, params, shape, arrival, body.priority)

    async def complete_chat(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        log_id = request.state.response_id
        check(body, log_id)
        tools = tool_choice(body.tools, body.tool_choice, body.parallel_tool_calls, tool_call_parser)
        params = body.sampling_params(body.requested_max_tokens(), body.logprobs_count(),  # None: all that is left
                                      sampling_defaults)
        guided = await asyncio.to_thread(tools.guided) if tools is not None else None  # a schema of many tools:
        # off the loop every stream shares
        if guided is not None:
            if params.guided_decoding is not None:
                raise APIError(400, f"tool_choice {body.tool_choice!r:.60} holds the output to its tools' schemas; "
                               "leave out response_format and the guided_* fields", param="tool_choice")
            params = replace(params, guided_decoding=guided)
        if tools is not None and tools.kind == "auto" and "skip_special_tokens" not in body.model_fields_set:
            params = replace(params, skip_special_tokens=False)  # some models' <tool_call> tags are special tokens
        messages = [m.template_dict() for m in body.messages]
        ids = await prompt_ids(max_tokens=body.requested_max_tokens(), messages=messages,
                               tools=tools.prompt_tools if tools is not None else None, **body.chat_keywords())
        shape = ChatShape(model_name, llm.tokenizer, tools, echo=body.echoed(messages), response_id=log_id)
        return await respond(request, body.stream, body.stream_usage, [ids], params, shape, arrival, body.priority)

    return app
