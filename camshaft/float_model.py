"""A checkpoint as transformers' float32 model (the numerics reference, and what ModelOpt calibrates), refused
where transformers cannot read it or would make up weights: it fills a missing tensor with random values and only
logs it."""

from __future__ import annotations

from pathlib import Path

from camshaft.errors import CheckpointError
from camshaft.transformers_import import from_transformers


def load_float_model(path: Path, given: str, purpose: str):
    """transformers' float32 model of `path`, in eval mode. `given`: how the user named it (`--model DIR`) and
    `purpose`: what random weights would spoil (`score`, `quantize`), for the messages."""
    import torch

    try:
        model, info = from_transformers("AutoModelForCausalLM").from_pretrained(
            str(path), dtype=torch.float32, use_safetensors=True, output_loading_info=True)
    except Exception as exc:  # unreadable files, shapes config.json denies, config fields its classes refuse, ...
        raise CheckpointError(f"{given}: transformers cannot load it: {str(exc).strip()[:400]}") from exc
    # a tensor of another shape is the RuntimeError above; a missing one is only listed
    missing = sorted(n for n in info["missing_keys"] if n != "lm_head.weight" or not model.config.tie_word_embeddings)
    if missing:
        raise CheckpointError(f"{given} lacks {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}; "
                              f"transformers would {purpose} random weights in their place: fix the checkpoint "
                              "(camshaft build refuses it too)")
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{given}: tensor {name!r} holds NaN or infinite values: restore the "
                                  "checkpoint's weights (camshaft build refuses it too)")
    return model.eval()


def transformers_tokenizer(path: Path, given: str):
    """transformers' tokenizer of `path` (its config.json read first, as its classes read it)."""
    auto_config, auto_tokenizer = from_transformers("AutoConfig", "AutoTokenizer")
    try:
        auto_config.from_pretrained(str(path))
    except Exception as exc:  # a field its config class refuses (an integer epsilon), an unknown dtype, ...
        raise CheckpointError(f"{given}: transformers cannot read its config.json: {str(exc).strip()[:400]}; fix "
                              "the field it names or restore the file from the original checkpoint") from exc
    try:
        return auto_tokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise CheckpointError(f"{given}: transformers cannot load its tokenizer: {str(exc).strip()[:400]}; restore "
                              "the tokenizer files from the original checkpoint") from exc
