"""`camshaft bench serve`: the same requests through several serving endpoints (camshaft's OpenAI server, its Triton
deployment over HTTP generate_stream or gRPC streaming, or an in-process LLM), with Poisson arrivals; TTFT, TPOT,
ITL and end-to-end percentiles, throughput and goodput per target, JSON results and latency-vs-throughput plots."""
