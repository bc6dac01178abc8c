"""Triton gRPC bidirectional streaming client, with inputs shaped from the model's own config."""

from __future__ import annotations

import asyncio

import numpy as np

from camshaft.bench_serve.clients import READ_TIMEOUT_S, START_TIMEOUT_S
from camshaft.bench_serve.workload import ServeRequest
from camshaft.errors import RequestError, needs_extra

CLOSE_TIMEOUT_S = 10.0  # for the server to close an answered stream

_NUMPY = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_BOOL": np.bool_,
          "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64}


class TritonGrpcClient:
    def __init__(self, target, _http) -> None:
        try:
            import tritonclient.grpc.aio as grpcclient
        except ImportError:
            raise RequestError(needs_extra("bench serve's triton-grpc target (tritonclient)", "serve")) from None

        self.grpc = grpcclient
        self.target, self.model = target, target.model or "ensemble"
        self.client = grpcclient.InferenceServerClient(target.url.removeprefix("grpc://"))
        self.inputs: dict[str, tuple[str, list[int]]] = {}

    async def start(self) -> None:
        from tritonclient.utils import InferenceServerException

        try:
            config = (await self.client.get_model_config(self.model, as_json=True,
                                                         client_timeout=START_TIMEOUT_S))["config"]
        except InferenceServerException as exc:
            if "NOT_FOUND" not in str(exc.status()):  # the server is there; the model is not
                raise
            raise RequestError(f"Triton at {self.target.url} serves no model {self.model!r}; set model= to one it "
                               "serves (camshaft deploy's text model: ensemble, or its --name)") from None
        batched = int(config.get("max_batch_size", 0)) > 0
        for spec in config["input"]:
            dims = [1 if int(d) < 0 else int(d) for d in spec.get("dims", [])]
            self.inputs[spec["name"]] = (spec["data_type"], ([1] if batched else []) + dims)
        if "text_input" not in self.inputs:
            raise RequestError(f"Triton model {self.model!r} has no text_input; point model= at a text-level model")

    def _tensor(self, name: str, value):
        data_type, shape = self.inputs[name]
        array = np.full(shape, value, dtype=_NUMPY[data_type])
        tensor = self.grpc.InferInput(name, shape, data_type.removeprefix("TYPE_").replace("STRING", "BYTES"))
        tensor.set_data_from_numpy(array)
        return tensor

    async def __call__(self, request: ServeRequest, record) -> None:
        values = {"text_input": request.prompt.encode(), "max_tokens": request.max_tokens,
                  "min_tokens": request.max_tokens, "temperature": 0.0, "stream": True,
                  "exclude_input_in_output": True, "return_num_output_tokens": True}
        inputs = [self._tensor(name, value) for name, value in values.items() if name in self.inputs]
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": inputs}
            await done.wait()  # keep the stream open until the final response arrived

        stream = self.client.stream_infer(requests())
        responses = stream.__aiter__()
        try:
            await self._read(responses, record)
            done.set()  # the requests end: the stream closes from both ends
            if record.finished:  # not cancelled once answered: Triton 2.51 then keeps the model loaded at stop
                await asyncio.wait_for(_rest(responses), CLOSE_TIMEOUT_S)
                return
        except TimeoutError:
            pass
        except BaseException:
            done.set()
            stream.cancel()
            raise
        stream.cancel()

    async def _read(self, responses, record) -> None:
        """The responses until the final one (record.finished), an error or a silence of READ_TIMEOUT_S."""
        while True:
            try:
                result, error = await asyncio.wait_for(anext(responses), READ_TIMEOUT_S)
            except StopAsyncIteration:
                break
            except TimeoutError:
                record.error = f"no response for {READ_TIMEOUT_S:.0f} s"
                break
            if error is not None:
                record.error = str(error)
                break
            out = result.as_numpy("text_output")
            text = "" if out is None else b"".join(out.reshape(-1)).decode("utf-8", errors="replace")
            count = result.as_numpy("num_output_tokens")
            tokens = 0 if count is None else int(count.reshape(-1)[0])
            if count is not None:  # the count, not max_tokens, where the model reports it (final response)
                record.output_tokens = tokens
            # the final response ends the request even when its tokens decode to no text
            record.chunk(text, tokens=tokens)
            if result.get_response().parameters["triton_final_response"].bool_param:
                record.finished = True
                break

    async def close(self) -> None:
        await self.client.close()


async def _rest(responses) -> None:
    """Whatever the stream still yields (nothing, after the final response) until the server closes it."""
    async for _ in responses:
        pass
