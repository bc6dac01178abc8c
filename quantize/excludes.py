"""--exclude: fnmatch patterns over the linear layers' module names, checked against the checkpoint before any long
work (a typo, or a layer index past the model's last, would otherwise quantize everything silently)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from camshaft.quantize.spec import QuantizeError, QuantSpec
from camshaft.weight_files import matrix_names


def module_names(model_dir: Path) -> list[str]:
    """The linear layers' module names as transformers will load them: the checkpoint's matrices, under `model.`
    where a checkpoint leaves that prefix out, and `lm_head` (a tied head has no tensor of its own)."""
    names = matrix_names(model_dir)
    return sorted({n if n.startswith("model.") or n == "lm_head" else f"model.{n}" for n in names} | {"lm_head"})


def check_excludes_match(spec: QuantSpec, linears: list[str]) -> None:
    """Every --exclude pattern names at least one linear layer (before loading: a typo, or a layer index past the
    model's last, would otherwise quantize everything silently), and some layer is left to quantize. lm_head is
    ModelOpt's to leave float and --lm-head's to quantize: excluding it while --lm-head quantizes it is refused."""
    excluded = {name for name in linears if any(fnmatch.fnmatchcase(name, p) for p in spec.exclude)}
    if "lm_head" in excluded and spec.lm_head != "float":
        raise QuantizeError(f"--exclude keeps lm_head float but --lm-head {spec.lm_head} quantizes it; drop one")
    if spec.exclude and not set(linears) - excluded - {"lm_head"}:
        raise QuantizeError(f"--exclude {' '.join(spec.exclude)} leaves no linear layer to quantize; exclude fewer "
                            "layers (or build the float checkpoint)")
    weight_only = [n for n in linears if any(fnmatch.fnmatchcase(n, p) for p in spec.info.weight_only_layers)]
    if weight_only and set(weight_only) <= excluded:
        raise QuantizeError(f"--exclude {' '.join(spec.exclude)} keeps float every layer {spec.format} makes "
                            f"weight-only ({', '.join(spec.info.weight_only_layers)}), so nothing of it would be "
                            "mixed; pass --quant int8_sq with the same --exclude for W8A8 layers beside float ones")
    if "AWQ" in spec.info.modelopt_config:  # AWQ calibration: input scales
        _check_awq_groups(spec, excluded, linears)
    for pattern in spec.exclude:
        matched = [name for name in linears if fnmatch.fnmatchcase(name, pattern)]
        if matched == ["lm_head"]:  # --lm-head float (else refused above): lm_head is float already
            raise QuantizeError(f"--exclude {pattern!r} names lm_head alone, which stays float already (--lm-head "
                                "float, the default): it changes nothing; drop it")
        if not matched:
            raise QuantizeError(
                f"--exclude {pattern!r} matches no linear layer of this model; its linear layers are named like "
                f"{', '.join(map(repr, examples(linears)))} (fnmatch patterns, e.g. 'model.layers.0.*' or "
                "'*.mlp.down_proj')"
            )


def examples(names: list[str]) -> list[str]:
    """The first and last few names, in layer order (layer 2 before layer 10)."""
    ordered = sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])
    return ordered if len(ordered) <= 4 else ordered[:2] + ["…"] + ordered[-2:]


def _check_awq_groups(spec: QuantSpec, excluded: set[str], linears: list[str]) -> None:
    """AWQ's export folds the common input scale of the quantized projections that read one layer norm's output into
    that norm (when two or more remain): an excluded q/k/v projection would then read scaled input with its float
    weights unchanged. Each layer's q, k and v are excluded all together, all but one, or none."""
    groups: dict[str, list[str]] = {}
    for name in linears:
        parent, _, leaf = name.rpartition(".")
        if leaf in ("q_proj", "k_proj", "v_proj"):
            groups.setdefault(parent, []).append(name)
    for parent, names in sorted(groups.items()):
        out = [n for n in names if n in excluded]
        if out and len(names) - len(out) > 1:
            raise QuantizeError(
                f"--exclude keeps {', '.join(out)} float but not the other projections that read the same input: "
                f"{spec.format} folds their shared scale into the layer norm before them, which the float one reads "
                f"too; exclude all of {parent}'s q_proj, k_proj and v_proj (e.g. '{parent}.[qkv]_proj') or none")
