"""Storms of concurrent gRPC streams against camshaft behind the real tritonserver, to find crashes and hangs that
the test suite's load is too small to hit (docs/triton.md, "Why not BLS").

Each storm opens CLIENTS streams at once and waits for all of them; after it, the executor must be idle with an
empty KV pool. A stream with no final response within 60 s, or an executor that does not drain within 30 s, ends the
run as a stall. At the end the server is stopped: the exit code, the stop time and any shared memory its stubs left
behind are reported.

    .venv/bin/python scripts/stress_triton.py --work-dir out/stress --storms 40 --clients 80 --mode text-cancel
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests
import tritonclient.grpc as grpcclient

from camshaft.triton_repo.deploy import deploy_repository
from camshaft.triton_repo.server import TritonServer

MODES = {  # model, cancel after this many responses (None: run to the end), max tokens
    "text-cancel": ("ensemble", 2, 4000), "text-full": ("ensemble", None, 200),
    "token-cancel": ("tensorrt_llm", 2, 4000), "token-full": ("tensorrt_llm", None, 200),
}


def inputs(model: str, max_tokens: int) -> list:
    if model == "ensemble":
        values = {"text_input": np.array([[b"a"]], dtype=np.object_), "max_tokens": np.array([[max_tokens]], np.int32),
                  "end_id": np.array([[-1]], np.int32), "stream": np.array([[True]])}
    else:
        values = {"input_ids": np.array([[5, 6]], np.int32), "input_lengths": np.array([[2]], np.int32),
                  "request_output_len": np.array([[max_tokens]], np.int32), "end_id": np.array([[-1]], np.int32),
                  "streaming": np.array([[True]])}
    types = {np.dtype(np.object_): "BYTES", np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL"}
    out = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), types[array.dtype])
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def stream(url: str, model: str, cancel_after: int | None, max_tokens: int) -> str:
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, inputs(model, max_tokens), enable_empty_final_response=True)
        received = 0
        while True:
            try:
                result, error = responses.get(timeout=60)
            except queue.Empty:
                return "stall"
            if error is not None:
                return f"error: {error}"
            received += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "ok"
            if cancel_after is not None and received >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return "ok"
    finally:
        client.stop_stream()
        client.close()


def idle(server: TritonServer, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = requests.get(server.endpoints.metrics_url, timeout=10).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("camshaft_")}
        if values["camshaft_num_requests_running"] + values["camshaft_num_requests_waiting"] == 0 and \
                values["camshaft_kv_cache_blocks_used"] == 0:
            return True
        time.sleep(0.1)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("out/stress"))
    parser.add_argument("--engine", type=Path, help="engine to serve (default: a tiny random Llama, built here)")
    parser.add_argument("--storms", type=int, default=40)
    parser.add_argument("--clients", type=int, default=80)
    parser.add_argument("--mode", choices=[*MODES, "mixed"], default="text-cancel",
                        help="mixed: text-cancel and token-cancel clients alternating")
    args = parser.parse_args()
    engine = args.engine or tiny_engine(args.work_dir)
    repo = deploy_repository(engine, args.work_dir / "repo", llm_options={"max_queue": 2 * args.clients})
    server = TritonServer(repo, log_file=args.work_dir / "tritonserver.log").start()
    modes = ["text-cancel", "token-cancel"] if args.mode == "mixed" else [args.mode]
    failed = None
    try:
        with ThreadPoolExecutor(args.clients) as pool:
            for storm in range(args.storms):
                start = time.monotonic()
                outcomes = list(pool.map(lambda i: stream(server.endpoints.grpc, *MODES[modes[i % len(modes)]]),
                                         range(args.clients)))
                bad = [o for o in outcomes if o != "ok"] + ([] if idle(server) else ["executor not idle"])
                print(f"storm {storm + 1}/{args.storms}: {time.monotonic() - start:.1f} s, "
                      f"{len(bad)} bad {sorted(set(bad))[:3]}", flush=True)
                if bad:
                    failed = storm + 1
                    break
    finally:
        start = time.monotonic()
        code = server.stop()
        print(f"server stopped with code {code} in {time.monotonic() - start:.1f} s; shared memory left behind: "
              f"{server.leaked_shm or 'none'}; log: {server.log_file}")
    print(f"{args.mode}: {'stalled in storm ' + str(failed) if failed else f'{args.storms} storms clean'}")
    return 1 if failed or code != 0 or server.leaked_shm else 0


def tiny_engine(work: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    from tiny_models import make_tiny_model

    engine = work / "engine"
    if not (engine / "manifest.json").is_file():
        model = make_tiny_model("llama", work / "hf", max_position_embeddings=4096)
        build_engine(BuildConfig(model, engine, max_seq_len=4096, max_num_tokens=128, max_batch_size=16))
    return engine


if __name__ == "__main__":
    sys.exit(main())
