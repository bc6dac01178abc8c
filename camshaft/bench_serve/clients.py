"""One streaming client per backend. Each sends one request, stamps the time of every text chunk, and leaves what it
saw in a Record; it never raises for a failed request (the record keeps the error)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

from camshaft.bench_serve.workload import ServeRequest
from camshaft.errors import RequestError

BACKENDS = ("openai", "triton-generate", "triton-grpc", "llm")
HTTP_BACKENDS = ("openai", "triton-generate")
# an OpenAI target's key: camshaft serve's own variable first (a shell may hold a real OpenAI key too), then OpenAI's
API_KEY_VARIABLES = ("CAMSHAFT_API_KEY", "OPENAI_API_KEY")
START_TIMEOUT_S = 30.0  # a target's readiness check; a server that accepts and never answers is named, not waited on
READ_TIMEOUT_S = 600.0  # the longest wait for a request's next piece of output (a loaded server queues)


@dataclass(frozen=True)
class Target:
    name: str
    url: str  # http://host:port (openai, triton-generate), host:port (triton-grpc), engine directory (llm)
    backend: str
    model: str | None = None
    threads: int | None = None  # an llm target's engine threads (bench serve --threads)

    @classmethod
    def parse(cls, spec: str) -> Target:
        """NAME=URL,backend=openai|triton-generate|triton-grpc|llm[,model=NAME]"""
        name, sep, rest = spec.partition("=")
        url, *options = rest.split(",")
        fields = dict(option.partition("=")[::2] for option in options)
        unknown = set(fields) - {"backend", "model"}
        if not sep or not name or not url or unknown or fields.get("backend") not in BACKENDS:
            raise RequestError(f"cannot read --target {spec!r}; use NAME=URL,backend={{{','.join(BACKENDS)}}}"
                               "[,model=NAME], e.g. camshaft=http://127.0.0.1:8000,backend=openai")
        if fields["backend"] == "llm" and "model" in fields:
            raise RequestError(f"--target {spec!r}: model= names a server's model; an llm target runs the engine "
                               "directory it is given: drop model=")
        url = url.rstrip("/")
        if fields["backend"] == "openai":
            url = url.removesuffix("/v1")  # the base URL OpenAI clients take; the paths below add it
        return cls(name, url, fields["backend"], fields.get("model") or None)


@dataclass
class Record:
    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    output_tokens: int | None = None  # as the server reported it, when it does
    error: str | None = None
    finished: bool = False  # the stream's end was seen ([DONE], Triton's final response), not just a closed stream

    def chunk(self, text: str, *, tokens: int = 0) -> None:
        """A piece of output arrived: text, or tokens whose text is still held back or empty."""
        if text or tokens:
            self.chunk_times.append(time.perf_counter())
            self.text += text

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times) and self.finished

    @property
    def tokens(self) -> int:
        """Output tokens: the server's count, else (`count_output_tokens`) the tokenizer's count of the text, else the
        output events (one token each)."""
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)

    @property
    def failure(self) -> str:
        return self.error or ("no output" if not self.chunk_times else "the stream ended before its end marker")


class OpenAIClient:
    """POST /v1/completions with stream=true; the length is forced with min_tokens and ignore_eos. A server started
    with an API key gets the one in $CAMSHAFT_API_KEY (or $OPENAI_API_KEY) as a bearer token."""

    def __init__(self, target: Target, http) -> None:
        self.target, self.http, self.model = target, http, target.model
        self.max_model_len: int | None = None
        self.key_from = next((v for v in API_KEY_VARIABLES if os.environ.get(v)), None)
        self.headers = {"Authorization": f"Bearer {os.environ[self.key_from]}"} if self.key_from else {}

    async def start(self) -> None:
        response = await self.http.get(f"{self.target.url}/v1/models", headers=self.headers, timeout=START_TIMEOUT_S)
        if response.status_code == 401:
            where = f"{self.target.name} ({self.target.url})"
            raise RequestError(f"target {where} refused the API key from ${self.key_from}; set it to the key the "
                               "server was started with" if self.key_from else
                               f"target {where} wants an API key: set CAMSHAFT_API_KEY (or OPENAI_API_KEY) to the "
                               "one the server was started with")
        if self.model is None:  # a target naming its model needs no /v1/models (a gateway may not serve it)
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        if response.status_code == 200:  # vLLM's and camshaft's say the context they take
            served = [m for m in response.json().get("data", []) if m.get("id") == self.model]
            self.max_model_len = served[0].get("max_model_len") if served else None

    async def __call__(self, request: ServeRequest, record: Record) -> None:
        body = {"model": self.model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
                "min_tokens": request.max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
                # what the other targets run: none of the model's recommended sampling (a server may apply it);
                # greedy ignores top_k and min_p, which servers spell differently (vLLM < 0.9 refuses top_k 0)
                "top_p": 1.0, "repetition_penalty": 1.0}
        async with self.http.stream("POST", f"{self.target.url}/v1/completions", json=body,
                                    headers=self.headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    record.finished = True
                    break
                event = json.loads(data)
                if "error" in event:  # the server failed the request after the stream started
                    error = event["error"]  # OpenAI's {"message": ...}; TGI's a string
                    record.error = str(error.get("message", error) if isinstance(error, dict) else error)
                    return
                if event.get("usage"):
                    record.output_tokens = event["usage"]["completion_tokens"]
                    record.prompt_tokens = record.prompt_tokens or event["usage"].get("prompt_tokens", 0)
                for choice in event.get("choices", []):  # an event with choices is output, its text empty or not
                    record.chunk(choice.get("text") or "", tokens=1)

    async def close(self) -> None:
        pass


class TritonGenerateClient:
    """POST /v2/models/<model>/generate_stream (server-sent events)."""

    def __init__(self, target: Target, http) -> None:
        self.target, self.http, self.model = target, http, target.model or "ensemble"

    async def start(self) -> None:
        response = await self.http.get(f"{self.target.url}/v2/models/{self.model}/ready", timeout=START_TIMEOUT_S)
        if response.status_code != 200:
            raise RequestError(f"Triton model {self.model!r} at {self.target.url} is not ready")

    async def __call__(self, request: ServeRequest, record: Record) -> None:
        body = {"text_input": request.prompt, "max_tokens": request.max_tokens, "min_tokens": request.max_tokens,
                "temperature": 0.0, "stream": True, "exclude_input_in_output": True, "return_num_output_tokens": True}
        url = f"{self.target.url}/v2/models/{self.model}/generate_stream"
        async with self.http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        record.error = str(event["error"])
                        return
                    count = event.get("num_output_tokens")
                    if count is not None:  # the count, not max_tokens, on the final event
                        record.output_tokens = int(count)
                    # the final event ends the request even when its tokens decode to no text
                    record.chunk(event.get("text_output", ""), tokens=int(count or 0))
            record.finished = True  # Triton closes the event stream after the final response

    async def close(self) -> None:
        pass


class LLMClient:
    """An in-process LLM on the same engine: the baseline without a server in between."""

    def __init__(self, target: Target, _http) -> None:
        from camshaft.runtime.llm import LLM

        self.llm = LLM(target.url, spin_wait=False, threads=target.threads)

    async def start(self) -> None:
        pass

    async def __call__(self, request: ServeRequest, record: Record) -> None:
        from camshaft.runtime.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=request.max_tokens, min_tokens=request.max_tokens, ignore_eos=True)
        tokens = 0
        async for _, output in self.llm.stream_outputs(request.prompt, params):
            tokens += len(output.token_ids)
            record.chunk(output.delta, tokens=len(output.token_ids))
        record.output_tokens, record.finished = tokens, True

    async def close(self) -> None:
        await asyncio.to_thread(self.llm.close)


def make_client(target: Target, http):
    from camshaft.bench_serve.triton_grpc import TritonGrpcClient

    return {"openai": OpenAIClient, "triton-generate": TritonGenerateClient, "triton-grpc": TritonGrpcClient,
            "llm": LLMClient}[target.backend](target, http)
