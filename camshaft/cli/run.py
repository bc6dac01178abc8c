"""Commands that generate or score text: run, eval ppl."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from camshaft.cli import app, err, eval_app, flag_names, pipe_closed, progress, require_stdout
from camshaft.cli.serve import ThreadsOption

if TYPE_CHECKING:
    from camshaft.runtime.sampling_params import SamplingParams


@app.command()
def run(
    engine: Annotated[Path, typer.Option(help="Engine directory")],
    prompt: Annotated[str, typer.Option(help="Prompt text; - reads it from stdin (UTF-8, one final newline "
                                             "dropped)")],
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt as a user message in the chat template")]
    = False,
    system: Annotated[str | None, typer.Option(help="System message (with --chat)")] = None,
    chat_template: Annotated[str | None, typer.Option(
        help="A Jinja chat template (a file, or the template itself) used in place of the engine's (with --chat)")]
    = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate")] = 128,
    temperature: Annotated[float | None, typer.Option(
        help="0 = greedy (default: the model's recommended value, else 0)")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling: the smallest set of tokens with this much "
                                                     "probability (1 = off; default: the model's, else 1)")] = None,
    top_k: Annotated[int | None, typer.Option(help="0 or -1 = off (default: the model's, else 0)")] = None,
    min_p: Annotated[float | None, typer.Option(help="Drop tokens less likely than this fraction of the likeliest "
                                                     "(0 = off; default: the model's, else 0)")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(
        help="Divide the logits of tokens already in the prompt or output by this (1 = off; default: the model's, "
             "else 1)")] = None,
    stop: Annotated[list[str] | None, typer.Option(
        metavar="TEXT", help="End the output where this text appears, leaving it out (repeatable)")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the sampling (default: a fresh one)")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print text as it is generated")] = False,
    prompt_lookup: Annotated[int, typer.Option(
        min=0, max=16, metavar="N",
        help="Draft up to this many tokens a step from text the prompt and output already hold (prompt lookup "
             "decoding: the same output, faster where text repeats); 0 = off")] = 0,
    threads: ThreadsOption = None,
) -> None:
    """Generate text from a prompt."""
    require_stdout()
    from dataclasses import replace

    from camshaft.errors import RequestError
    from camshaft.manifest import read_manifest
    from camshaft.runtime.sampling_params import GREEDY_BELOW, RECOMMENDED_TEMPERATURE, model_defaults

    if system is not None and not chat:
        raise RequestError("--system is the chat's system message; add --chat (or drop --system)")
    if chat_template is not None and not chat:
        raise RequestError("--chat-template renders --chat messages; add --chat (or drop --chat-template)")
    if prompt == "-":
        prompt = _stdin_text()
    given = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                               ("repetition_penalty", repetition_penalty), ("seed", seed)) if v is not None}
    with flag_names("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
                    "prompt_lookup", "threads"):
        model = read_manifest(engine, check_files=False).model  # its recommended sampling, as Session and serve
        params = replace(model_defaults(model), max_tokens=max_tokens, stop=tuple(stop or ()), **given)
        unused = [flag for flag, sent in (("--top-p", top_p not in (None, 1.0)),
                                          ("--top-k", top_k not in (None, 0, -1)), ("--min-p", min_p not in (None, 0)),
                                          ("--seed", seed is not None))
                  if sent]
        greedy = params.temperature < GREEDY_BELOW  # top_p, top_k, min_p and the seed then do nothing
        if greedy and unused:  # said once the values are known to be valid
            verb = "changes" if len(unused) == 1 else "change"
            err.print(f"[yellow]note:[/yellow] {', '.join(unused)} {verb} nothing at --temperature 0 (greedy "
                      "decoding); add --temperature above 0 to sample", soft_wrap=True)
        taken = [f"{k} {v:g}" for k, v in model.sampling_defaults
                 if k not in given and not (greedy and k in ("temperature", "top_p", "top_k", "min_p"))]
        if taken and greedy:
            err.print(f"[dim]greedy decoding, with the model's generation_config.json {', '.join(taken)}[/dim]",
                      soft_wrap=True)
        elif taken:
            implied = "temperature" not in given and "temperature" not in dict(model.sampling_defaults)
            at = f"at temperature {RECOMMENDED_TEMPERATURE:g}, vLLM's where it names none; " if implied else ""
            err.print(f"[dim]sampling as the model's generation_config.json recommends: {', '.join(taken)}"
                      + ("" if "temperature" in given else f" ({at}--temperature 0 for greedy decoding)") + "[/dim]",
                      soft_wrap=True)
        _run(engine, prompt, chat, system, params, stream, prompt_lookup, chat_template, threads)


def _stdin_text() -> str:
    from camshaft.errors import RequestError

    if sys.stdin is None:
        raise RequestError("--prompt - reads the prompt from stdin, which is closed; pipe the prompt in, or pass it "
                           "as --prompt TEXT")
    try:
        text = sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"--prompt - reads UTF-8 text from stdin; byte {exc.start} is not UTF-8") from None
    return text.removeprefix("\ufeff").removesuffix("\n").removesuffix("\r")


def _run(engine: Path, prompt: str, chat: bool, system: str | None, params: SamplingParams, stream: bool,
         prompt_lookup: int, chat_template: str | None = None, threads: int | None = None) -> None:
    from camshaft.runtime.session import Session

    max_tokens = params.max_tokens
    # One prompt, then exit: moving the weights to huge pages (0.2-1.3 s for SmolLM2 fp32) repays itself at 6 % of
    # each decode step after 200-1300 tokens (both scale with the weights' size; BENCHMARKS.md): only long runs ask.
    from camshaft.errors import EngineError
    from camshaft.manifest import read_manifest
    from camshaft.runtime.prompt_lookup import checks_drafts

    if prompt_lookup and not checks_drafts(read_manifest(engine, check_files=False)):
        raise EngineError(f"{engine}: built before prompt lookup (its sequence graph gives logits for one token a "
                          "step); rebuild it with this camshaft for --prompt-lookup, or drop --prompt-lookup")
    session = Session(engine, huge_pages=max_tokens >= 512, prompt_lookup=prompt_lookup, chat_template=chat_template,
                      threads=threads)
    messages = None
    if chat:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}]  # --system "": an empty system turn, not the template's default
    kwargs = {"messages": messages} if chat else {"prompt": prompt}
    try:
        if stream:
            deltas = session.stream(sampling_params=params, **kwargs)
            while True:
                try:
                    sys.stdout.write(next(deltas))
                    sys.stdout.flush()
                except StopIteration as done:
                    result = done.value
                    break
            sys.stdout.write("\n")
        else:
            result = session.generate(sampling_params=params, **kwargs)
            sys.stdout.write(result.text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        pipe_closed()
    t = result.timings
    drafts = f" · drafts {session.accepted_draft_tokens}/{session.draft_tokens} taken" if prompt_lookup else ""
    speed = f" · {t.decode_tok_s:.1f} tok/s" if t.output_tokens > 1 else ""  # decode speed: from the second token
    err.print(f"[dim]{t.output_tokens} token{'s' if t.output_tokens != 1 else ''} · finish {result.finish_reason} · "
              f"TTFT {t.ttft_s * 1000:.0f} ms{speed}{drafts}[/dim]")


@eval_app.command("ppl")
def eval_ppl(
    data: Annotated[Path, typer.Option(help="UTF-8 text file")],
    engine: Annotated[Path | None, typer.Option(help="Engine directory")] = None,
    model: Annotated[Path | None, typer.Option(help="HF checkpoint: transformers fp32 reference")] = None,
    window: Annotated[int | None, typer.Option(min=2, help="Window (tokens) for --model (default: the --engine's "
                                                    "max_seq_len, so both score the same windows; else 1024, or "
                                                    "the model's max_position_embeddings if fewer); engines use "
                                                    "their max_seq_len")] = None,
    threads: ThreadsOption = None,
) -> None:
    """Perplexity of a text through an engine and/or transformers, in non-overlapping windows."""
    require_stdout()
    from camshaft.errors import RequestError
    from camshaft.manifest import read_manifest
    from camshaft.runtime.perplexity import (
        check_reference_model,
        check_same_model,
        check_window,
        engine_perplexity,
        read_text,
        reference_perplexity,
        reference_window,
    )

    if engine is None and model is None:
        raise RequestError("pass --engine, --model or both")
    if threads is not None and engine is None:
        raise RequestError("--threads sets the --engine's threads (transformers takes torch's); add --engine or drop "
                           "--threads")
    if model is None and window is not None:
        raise RequestError("--window sets the transformers reference's window (--model); an engine scores in "
                           "windows of its max_seq_len: drop --window or add --model")
    manifest = None if engine is None else read_manifest(engine, check_files=False)
    engine_window = None if manifest is None else manifest.limits.max_seq_len
    given = "--window" if window is not None else "the engine's max_seq_len"
    window = engine_window if window is None else window
    if model is not None:
        check_reference_model(model)
        if manifest is not None:
            check_same_model(manifest.model, model)
        window = reference_window(model, window, given)
        check_window(window)
    if engine_window is not None and model is not None and window != engine_window:
        typer.echo(f"note: transformers scores windows of {window} tokens, the engine of {engine_window}: the two "
                   "perplexities are not of the same windows", err=True)
    text = read_text(data)
    runs = []
    if engine is not None:
        runs.append(("engine", engine_window, lambda: engine_perplexity(engine, text, threads, progress)))
    if model is not None:
        runs.append(("transformers", window, lambda: reference_perplexity(model, text, window, progress)))
    for name, size, score in runs:  # each printed when done: a failing second run loses nothing of the first
        with flag_names("threads"):
            r = score()
        windows = f"{r.windows} window{'s' if r.windows != 1 else ''}"
        scored = f"{r.tokens_scored} token{'s' if r.tokens_scored != 1 else ''}"
        typer.echo(f"{name:<12} ppl {r.perplexity:.4f}  ({scored}, {windows} of {size} tokens)")
