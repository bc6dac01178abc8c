"""`camshaft inspect`: what an engine directory holds and whether it runs here, from its manifest alone (its files
checked as the runtime checks them: a missing, swapped or half-written file makes runs_here False, with the reason)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from camshaft.engine_files import CHAT_TEMPLATE, TOKENIZER_DIR
from camshaft.errors import EngineError
from camshaft.graph_meta import sequence_graph_support
from camshaft.manifest import Manifest, read_manifest
from camshaft.runtime.engine import check_model_inputs, check_tokenizer_files, end_ids, load_tokenizer, not_utf8
from camshaft.runtime.kv_cache import bytes_per_block, cache_copies, host_memory, pool_blocks, pool_bytes

TARGET_DEVICES = {"onnxruntime": "CPU", "tensorrt": "datacenter NVIDIA GPU", "tensorrt-rtx": "NVIDIA RTX GPU"}


def runs_here(manifest: Manifest, engine_dir: Path) -> str | None:
    """None if the engine's runtime is installed at the version that built it, its graphs take what the manifest
    says (onnxruntime) and, for TensorRT, a GPU of its architecture is present; else why not."""
    try:
        if manifest.target == "onnxruntime":
            from camshaft.runtime.backends.onnxruntime import check_compatible, check_graph_io

            check_compatible(manifest)
            check_graph_io(engine_dir, manifest)
            check_model_inputs(manifest, engine_dir)
        else:
            from camshaft.runtime.backends.tensorrt import check_compatible as check_tensorrt

            check_tensorrt(manifest)
        check_tokenizer_files(engine_dir, manifest.files)
    except EngineError as exc:
        return str(exc)
    return None


def cpu_threads(manifest: Manifest, threads: int | None) -> int | None:
    """The ONNX Runtime threads an engine runs with when given `threads` (None: the backend's choice); None for a
    TensorRT engine, which computes on the GPU."""
    if manifest.target != "onnxruntime":
        return None
    from camshaft.runtime.backends.onnxruntime import physical_cores

    return threads or physical_cores()


def engine_info(engine_dir: str | Path) -> dict[str, Any]:
    """The summary; an engine whose files are not as the build wrote them is still described, from its manifest,
    with runs_here False and the reason (a manifest that cannot be read raises its EngineError)."""
    engine_dir = Path(engine_dir)
    try:
        m = read_manifest(engine_dir)
        reason, files_ok = runs_here(m, engine_dir), True
    except EngineError as exc:
        reason = str(exc)
        try:  # an edited manifest over the files it lists: the files are as the build wrote them
            m, files_ok = read_manifest(engine_dir, check_digest=False), True
        except EngineError:
            m, files_ok = read_manifest(engine_dir, check_files=False, check_digest=False), False
    c, limits, kv = m.model, m.limits, m.kv_cache
    per_block = bytes_per_block(m) * cache_copies(m)  # the memory a block takes (TensorRT: two buffers a cache)
    quant = m.quantization or {}
    sequence = m.sequence_graph
    if sequence is None and m.target == "onnxruntime":
        kv_dtype = kv.dtype if kv.dtype in ("int8", "float8") else None
        sequence_note = sequence_graph_support(c, m.dtype, kv_dtype) or "built before sequence graphs"
    else:
        sequence_note = None if sequence is not None else "the TensorRT targets run the batch graph"
    return {
        "engine": str(engine_dir.resolve()),
        "format_version": m.format_version,
        "camshaft_version": m.camshaft_version,
        "build_id": m.build_id or None,
        "model": {"architecture": c.architecture, "num_layers": c.num_layers, "hidden_size": c.hidden_size,
                  "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                  "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
                  "tie_word_embeddings": c.tie_word_embeddings, "sliding_window": c.sliding_window,
                  "sliding_every_layer": c.attention_window is not None,
                  "rope": {"type": c.rope.type, "theta": c.rope.theta, "factor": c.rope.factor,
                           "rotary_dim": c.rotary_dim,
                           # LongRoPE: past this length a request rotates with the long factors (None: not built)
                           "long_factors_past": c.rope.original_max_position_embeddings
                           if c.rope.switches_to_long(m.limits.max_seq_len) else None},
                  # Gemma: the sliding layers' own rope, attention's scale (else head_dim ** -0.5), the softcaps
                  # (None: as other models)
                  "local_rope": None if c.local_rope is None else {
                      "type": c.local_rope.type, "theta": c.local_rope.theta, "factor": c.local_rope.factor},
                  "attention_scale": c.attention_scale, "attn_softcap": c.attn_softcap,
                  "logit_softcap": c.logit_softcap, "embed_scale": c.embed_scale, "residual_scale": c.residual_scale,
                  "logits_divisor": c.logits_divisor, "layers_without_rope": list(c.layers_without_rope),
                  "sampling_defaults": dict(c.sampling_defaults)},
        "dtype": m.dtype,
        "quantization": {k: quant.get(k) for k in ("format", "group_size", "kv_cache_dtype", "kv_cache_affine",
                                                    "lowering", "activations", "dequantized_linear_layers")
                         if quant.get(k)} or None,
        "lm_head": quant.get("lm_head"),
        "target": m.target,
        "device": TARGET_DEVICES.get(m.target, m.target),
        "gpu_arch": m.target_options.get("gpu_arch"),
        "graphs": {"batch": m.artifact, "sequence": sequence.artifact if sequence else None},
        # a Session drafts (PromptLookup) on its default graph: the batch graph, or a sequence graph of several rows
        "prompt_lookup": sequence is None or sequence.checks_drafts,
        "no_sequence_graph": sequence_note,
        "limits": {"max_batch_size": limits.max_batch_size, "max_seq_len": limits.max_seq_len,
                   "max_num_tokens": limits.max_num_tokens, "kv_block_size": limits.kv_block_size},
        "kv_cache": {"dtype": kv.dtype, "bytes_per_token": per_block // limits.kv_block_size,
                     "bytes_per_sequence": per_block * limits.max_blocks_per_seq,
                     "default_pool_bytes": pool_bytes(m, pool_blocks(m, limits.max_batch_size)),
                     "host_memory": host_memory() if m.target == "onnxruntime" else None},
        "files": len(m.files),
        "bytes_listed": sum(m.files.values()),
        "files_as_built": files_ok,
        "fingerprinted": bool(m.fingerprints),
        "eos_token_ids": _end_ids(engine_dir, m),
        "chat_template": (engine_dir / TOKENIZER_DIR / CHAT_TEMPLATE).is_file()
        or _tokenizer_config(engine_dir).get("chat_template") is not None,
        "chat_template_problem": chat_template_problem(engine_dir),
        "tools": dict(m.tools),
        "runs_here": reason is None,
        "runs_here_reason": reason,
    }


def _end_ids(engine_dir: Path, manifest: Manifest) -> list[int]:
    """The ids generation ends on: the model's and its tokenizer's eos (runtime/engine.py end_ids)."""
    try:
        return list(end_ids(manifest.model, load_tokenizer(engine_dir, manifest.files)))
    except EngineError:
        return list(manifest.model.eos_token_ids)


def chat_template_problem(engine_dir: Path) -> str | None:
    """Why the engine's chat template (tokenizer/chat_template.jinja, else tokenizer_config.json's) does not parse,
    or None (none, or one that parses): chat requests would fail on it."""
    from camshaft.runtime.chat_template import template_problem

    if problem := not_utf8(engine_dir / TOKENIZER_DIR / CHAT_TEMPLATE):
        return f"{CHAT_TEMPLATE} {problem}"
    try:
        text = (engine_dir / TOKENIZER_DIR / CHAT_TEMPLATE).read_text(encoding="utf-8")
    except OSError:
        text = _tokenizer_config(engine_dir).get("chat_template")
    return template_problem(text) if isinstance(text, str) else None


def _tokenizer_config(engine_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((engine_dir / TOKENIZER_DIR / "tokenizer_config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return config if isinstance(config, dict) else {}


def _template_note(problem: str | None) -> str:
    if problem is None:
        return ""
    if "is not UTF-8 text" in problem:  # no request runs: the tokenizer does not load (runs here: no)
        return f" ({problem}; the engine does not load until then)"
    return f" (does not parse, {problem}: chat requests fail until tokenizer/chat_template.jinja is fixed)"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def info_lines(info: dict[str, Any]) -> list[str]:
    md, lim, kv, q = info["model"], info["limits"], info["kv_cache"], info["quantization"]
    heads = f"{md['num_heads']} heads / {md['num_kv_heads']} KV heads x {md['head_dim']}"
    window = f", sliding window {md['sliding_window']}" if md["sliding_window"] else ""
    window += (" on every layer (the in-flight batcher frees the KV blocks it has passed)" if md["sliding_every_layer"]
               else " on some layers" if md["sliding_window"] else "")
    rope, local = md["rope"], md["local_rope"]
    if local is not None:  # Gemma 3: a rope for each kind of layer
        scaled = f" x{rope['factor']:g}" if rope["type"] != "default" else ""
        window += (f", full layers' rope {rope['type']}{scaled} θ {rope['theta']:g}, sliding layers' "
                   f"{local['type']} θ {local['theta']:g}")
    else:
        window += f", rope {rope['type']} x{rope['factor']:g}" if rope["type"] != "default" else ""
    window += f" over {rope['rotary_dim']} of each head's dimensions" if rope["rotary_dim"] < md["head_dim"] else ""
    caps = [f"{what} softcap {v:g}" for what, v in (("attention", md["attn_softcap"]),
                                                    ("logit", md["logit_softcap"])) if v is not None]
    window += f", {', '.join(caps)}" if caps else ""
    window += f", layers {md['layers_without_rope']} without rope" if md["layers_without_rope"] else ""
    if rope["type"] == "longrope":
        past = rope["long_factors_past"]
        window += (f" (long factors for requests whose prompt + max_tokens - 1 exceeds {past})" if past
                   else " (short factors only: max_seq_len is within the original context)")
    quant = "none" if q is None else ", ".join(f"{k} {len(v) if isinstance(v, list) else v}" for k, v in q.items())
    head = (info["lm_head"] or {}).get("dtype")
    sequence = info["graphs"]["sequence"] or f"none ({info['no_sequence_graph']})"
    if info["graphs"]["sequence"] and not info["prompt_lookup"]:
        sequence += " (one logits row: prompt lookup on the batch graph only; rebuild for it on this one)"
    arch = f" {info['gpu_arch']}" if info["gpu_arch"] else ""
    return [
        f"engine      {info['engine']} (format {info['format_version']}, camshaft {info['camshaft_version']}"
        + (f", build {info['build_id'][:12]}" if info["build_id"] else "") + ")",
        f"model       {md['architecture']}, {md['num_layers']} layers, hidden {md['hidden_size']}, {heads}, vocab "
        f"{md['vocab_size']}, {'tied' if md['tie_word_embeddings'] else 'untied'} embeddings{window}",
        f"precision   {info['dtype']}; quantization: {quant}" + (f"; lm_head {head}" if head else ""),
        f"target      {info['target']}{arch} ({info['device']}); graphs: batch {info['graphs']['batch']}, "
        f"sequence {sequence}",
        f"limits      max_batch_size {lim['max_batch_size']}, max_seq_len {lim['max_seq_len']}, max_num_tokens "
        f"{lim['max_num_tokens']}, KV blocks of {lim['kv_block_size']} tokens",
        f"KV cache    {kv['dtype']}, {kv['bytes_per_token']} bytes a token ({_size(kv['bytes_per_sequence'])} a full "
        f"sequence); default pool {_size(kv['default_pool_bytes'])} (max_batch_size full sequences)"
        + (f", more than this machine's {_size(kv['host_memory'])}: run or serve it with a smaller --kv-cache-memory "
           "or --max-batch-size (kv_cache_memory, max_batch_size)"
           if kv["host_memory"] is not None and kv["default_pool_bytes"] > kv["host_memory"] else ""),
        f"files       {info['files']}, {_size(info['bytes_listed'])}"
        + ((", sizes and fingerprints as the build recorded them" if info["fingerprinted"] else
            f", sizes as the build recorded them (format {info['format_version']} records no fingerprints)")
           if info["files_as_built"] else ", NOT as the build wrote them (below)"),
        f"tokenizer   end ids {info['eos_token_ids']}, chat template {'yes' if info['chat_template'] else 'no'}"
        + _template_note(info["chat_template_problem"])
        + "".join(f", {k} {v:g}" for k, v in md["sampling_defaults"].items()),
        "tools       " + ", ".join(f"{k} {v}" for k, v in info["tools"].items()),
        f"runs here   {'yes' if info['runs_here'] else 'no: ' + info['runs_here_reason']}",
    ]
