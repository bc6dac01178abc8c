"""The builds the latency benchmark compares: camshaft's fp32 engine and onnxruntime-genai's fp32 model, each built
when missing (or stale) and timed with its peak memory."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_common import log, rel, show_cmd


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure_command(cmd: list[str]) -> dict:
    """Run a build command as a child process: wall time and peak RSS (GNU time -v, else the children's rusage)."""
    gnu_time = shutil.which("time", path="/usr/bin:/bin")
    full = [gnu_time, "-v", *cmd] if gnu_time else cmd
    started = time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"build command failed ({proc.returncode}): {show_cmd(cmd)}")
    peak_kb = None
    if gnu_time:
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        peak_kb = int(match.group(1)) if match else None
    if peak_kb is None:  # Linux reports ru_maxrss in KiB: the largest child so far (builds run first, one at a time)
        peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"command": show_cmd(cmd), "wall_s": round(wall, 2), "peak_rss_mb": round(peak_kb / 1024, 1),
            "peak_rss_source": "/usr/bin/time -v" if gnu_time else "getrusage(RUSAGE_CHILDREN)"}


def camshaft_cli() -> list[str]:
    script = Path(sys.executable).parent / "camshaft"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from camshaft.cli import main; main()"]


def engine_usable(engine_dir: Path, min_seq_len: int) -> bool:
    from camshaft.errors import CamshaftError
    from camshaft.io_signature import KVCacheLayout
    from camshaft.manifest import read_manifest
    from camshaft.runtime.backends.onnxruntime import check_compatible

    if not engine_dir.is_dir():
        return False
    try:
        manifest = read_manifest(engine_dir)
        check_compatible(manifest)
    except CamshaftError:
        return False
    # An engine from an older builder with another KV layout loads but fails at the first step: compare layouts.
    current_layout = next((f.default for f in dataclasses.fields(KVCacheLayout) if f.name == "layout"), None)
    if isinstance(current_layout, str) and getattr(manifest.kv_cache, "layout", current_layout) != current_layout:
        return False
    return (manifest.target == "onnxruntime" and manifest.dtype == "float32"
            and manifest.sequence_graph is not None and manifest.limits.max_seq_len >= min_seq_len)


def graph_hash(engine_dir: Path) -> str | None:
    try:
        return json.loads((engine_dir / "manifest.json").read_text()).get("graph_sha256")
    except (OSError, ValueError):
        return None


def ortgenai_present(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in ("genai_config.json", "model.onnx", "model.onnx.data"))


def camshaft_build_cmd(model_dir: Path, out: Path, max_seq_len: int) -> list[str]:
    return [*camshaft_cli(), "build", "--model", str(model_dir), "--output", str(out),
            "--max-seq-len", str(max_seq_len)]


def ortgenai_build_cmd(model_dir: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out),
            "-p", "fp32", "-e", "cpu"]


def ensure_builds(args, model_dir: Path, engine_dir: Path, ortgenai_dir: Path, previous: dict | None) -> dict:
    """Build what is missing; measure each build (into a scratch directory when the artifact already exists)."""
    work = Path(args.work_dir)
    builds: dict = {}
    need = args.prompt_len + args.new_tokens
    jobs = [
        ("camshaft", engine_dir, engine_usable(engine_dir, need),
         lambda out: camshaft_build_cmd(model_dir, out, args.max_seq_len)),
        ("onnxruntime-genai", ortgenai_dir, ortgenai_present(ortgenai_dir),
         lambda out: ortgenai_build_cmd(model_dir, out)),
    ]
    for name, target, present, make_cmd in jobs:
        present = present and not args.rebuild
        if present and args.skip_build_measure:
            log(f"{name}: using {rel(target)}; build not re-measured")
            old = (previous or {}).get("builds", {}).get(name)
            if old:
                builds[name] = {**old, "reused_from_previous_run": True}
            continue
        if present:
            out = work / f".build-probe-{name}"
            shutil.rmtree(out, ignore_errors=True)
            log(f"{name}: {rel(target)} exists; measuring a fresh build into {rel(out)}")
        else:
            out = target
            if out.exists():
                log(f"{name}: {rel(out)} is stale or incomplete; rebuilding it")
                shutil.rmtree(out)
            log(f"{name}: building {rel(out)}")
        result = measure_command(make_cmd(out))
        result["size_mb"] = round(dir_bytes(out) / 1e6, 1)
        if present and name == "camshaft" and graph_hash(out) != graph_hash(target):
            log(f"camshaft: {rel(target)} differs from what the current builder makes; replacing it with the new build")
            shutil.rmtree(target)
            os.replace(out, target)
        elif present:
            shutil.rmtree(out, ignore_errors=True)
        builds[name] = result
        log(f"{name}: built in {result['wall_s']} s, peak RSS {result['peak_rss_mb']} MB, {result['size_mb']} MB")
    return builds


def set_ortgenai_threads(model_dir: Path, threads: int) -> None:
    path = model_dir / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    if options.get("intra_op_num_threads") != threads:
        options["intra_op_num_threads"] = threads
        path.write_text(json.dumps(config, indent=4) + "\n")
    print(f"onnxruntime-genai: genai_config.json model.decoder.session_options.intra_op_num_threads = {threads} "
          f"(the thread count camshaft uses)")
