"""A checkpoint as transformers' float32 model (the numerics reference, and what ModelOpt calibrates), refused
where transformers cannot read it or would make up weights: it fills a missing tensor with random values and only
logs it."""

from __future__ import annotations

from pathlib import Path

from camshaft.errors import CheckpointError


def load_float_model(path: Path, given: str, purpose: str):
    """transformers' float32 model of `path`, in eval mode. `given`: how the user named it (`--model DIR`) and
    `purpose`: what random weights would spoil (`score`, `quantize`), for the messages."""
    import torch
    import transformers
    from safetensors import SafetensorError

    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, use_safetensors=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # unreadable files, shapes config.json denies
        raise CheckpointError(f"{given}: transformers cannot load it: {str(exc).strip()[:400]}") from exc
    # a tensor of another shape is the RuntimeError above; a missing one is only listed
    missing = sorted(n for n in info["missing_keys"] if n != "lm_head.weight" or not model.config.tie_word_embeddings)
    if missing:
        raise CheckpointError(f"{given} lacks {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}; "
                              f"transformers would {purpose} random weights in their place: fix the checkpoint "
                              "(camshaft build refuses it too)")
    return model.eval()
