"""The engine's tokenizer: saved as transformers loads the checkpoint's, in its fast (tokenizer.json) form, and checked
against the model's vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from camshaft.errors import CheckpointError
from camshaft.model_config import check_tokenizer_vocab
from camshaft.transformers_import import from_transformers
from camshaft.weight_files import lfs_pointer, lfs_pointer_error

Progress = Callable[[str], None]


def _plain_tokenizer_json(model_dir: Path) -> bool:
    PreTrainedTokenizerFast = from_transformers("PreTrainedTokenizerFast")

    path = model_dir / "tokenizer.json"
    try:
        return path.is_file() and PreTrainedTokenizerFast(tokenizer_file=str(path)) is not None
    except Exception:  # tokenizers raises its own types for a file it cannot read
        return False


def save_tokenizer(model_dir: Path, tok_dir: Path, vocab_size: int, progress: Progress) -> None:
    """The engine's tokenizer as transformers loads the checkpoint's (its class may rewrite tokenizer.json's
    pre-tokenizer, e.g. Llama's legacy / add_prefix_space), saved as a fast tokenizer (tokenizer.json) that the runtime
    loads without its class. A vocabulary larger than the model's (another model's tokenizer) is refused."""
    AutoTokenizer = from_transformers("AutoTokenizer")

    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file() and lfs_pointer(path):
            raise lfs_pointer_error(path)
    try:
        AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False).save_pretrained(str(tok_dir))
    except Exception as exc:  # transformers raises many types for tokenizers it cannot load or convert
        if _plain_tokenizer_json(model_dir):  # e.g. a custom tokenizer class: its tokenizer.json (copied), as it is
            check_engine_tokenizer(model_dir, tok_dir, vocab_size, progress)
            return
        hint = ""
        if not (model_dir / "tokenizer.json").is_file() and (model_dir / "tokenizer.model").is_file():
            hint = (" (a SentencePiece tokenizer.model without tokenizer.json: install sentencepiece, "
                    "pip install sentencepiece, or add the checkpoint's tokenizer.json)")
        raise CheckpointError(f"the tokenizer in {model_dir} could not be loaded{hint}: {exc}") from exc
    if not (tok_dir / "tokenizer.json").is_file():
        raise CheckpointError(f"the tokenizer in {model_dir} has no fast (tokenizer.json) form")
    check_engine_tokenizer(model_dir, tok_dir, vocab_size, progress)


def check_engine_tokenizer(model_dir: Path, tok_dir: Path, vocab_size: int, progress: Progress) -> None:
    """The engine's tokenizer loads and encodes as the runtime's will (a checkpoint's tokenizer_config.json that
    transformers' own class got past was saved with the engine and failed every run), its chat template is text, and
    its vocabulary is the model's."""
    PreTrainedTokenizerFast = from_transformers("PreTrainedTokenizerFast")

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
        tokenizer("")  # encoding reads model_max_length (a string there failed every prompt)
    except Exception as exc:  # transformers raises many types for a tokenizer it cannot load
        raise CheckpointError(f"the tokenizer in {model_dir} cannot be used as saved for the engine ({exc}); fix its "
                              "tokenizer files (tokenizer_config.json, special_tokens_map.json) or restore them from "
                              "the original checkpoint") from exc
    check_tokenizer_vocab(tokenizer, vocab_size)
    template = tokenizer.chat_template
    named = isinstance(template, dict) and all(isinstance(v, str) for v in template.values())
    if not (template is None or isinstance(template, str) or named):
        raise CheckpointError(f"{model_dir}: its chat_template (tokenizer_config.json) is {template!r:.60}, neither a "
                              "Jinja string nor a list of named templates; fix it or remove it")
    beyond = sorted(t for t, i in tokenizer.get_added_vocab().items() if i >= vocab_size)
    if beyond:
        progress(f"note: the tokenizer's added tokens {', '.join(beyond[:5])} have ids past the model's vocabulary "
                 f"({vocab_size}); prompts holding them are refused")
