"""Tiny random-weight checkpoints of every supported architecture, made with transformers configs.

Biases and norm weights are randomised: transformers' default init (biases 0, norms 1) would hide bugs.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-rope": ("LlamaConfig", dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32),
    )),
    "llama-mqa-headdim": ("LlamaConfig", dict(num_key_value_heads=1, head_dim=24, attention_bias=True)),
    "mistral-sliding": ("MistralConfig", dict(sliding_window=7, num_key_value_heads=2, head_dim=16)),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "phi3-fused": ("Phi3Config", dict(pad_token_id=0, sliding_window=40)),  # q/k/v and gate/up stored fused
    "qwen3-qknorm": ("Qwen3Config", dict(head_dim=32, num_key_value_heads=4)),
    "phi3-longrope": ("Phi3Config", dict(  # the 128k Phi-3 models' rope: short factors up to 32 positions, long past
        pad_token_id=0, original_max_position_embeddings=32,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                             short_factor=[1.0, 1.1, 1.3, 1.2, 1.6, 1.5, 1.9, 2.0],
                             long_factor=[1.5, 2.5, 3.0, 4.5, 6.0, 8.0, 11.0, 16.0]),
    )),
    "phi4-mini-partial": ("Phi3Config", dict(  # Phi-4-mini's layout: half of each head rotated, short LongRoPE
        pad_token_id=0, hidden_size=128, tie_word_embeddings=True,  # heads of 32, 16 of them rotated
        original_max_position_embeddings=256,  # (its long factors: "phi3-longrope")
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                             short_factor=[1.0, 1.2, 1.1, 1.5, 1.3, 1.8, 2.0, 1.7],
                             long_factor=[2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]),
    )),
    "gemma2": ("Gemma2Config", dict(  # Gemma 2: Gemma 3's layers with softcapped scores and logits, every 2nd full
        head_dim=32, query_pre_attn_scalar=24, sliding_window=6, num_hidden_layers=3, tie_word_embeddings=True,
        pad_token_id=0, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,  # low caps, so they bite here
    )),
    "gemma3": ("Gemma3TextConfig", dict(  # Gemma 3 1B's layout: 1 + w norms, four a layer, a scaled embedding, GELU,
        head_dim=32, num_key_value_heads=1, query_pre_attn_scalar=24, sliding_window=6,  # every 3rd layer full
        num_hidden_layers=3, sliding_window_pattern=3, tie_word_embeddings=True, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )),
    "smollm3-nope": ("SmolLM3Config", dict(  # SmolLM3: every 2nd layer without rope here (4th in the 3B), biases
        num_hidden_layers=4, no_rope_layer_interval=2, attention_bias=True, mlp_bias=True, pad_token_id=0,
    )),
    "granite-multipliers": ("GraniteConfig", dict(  # Granite 3: Llama's layers with multipliers, as granite-3.x sets
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2, logits_scaling=8.0,
        tie_word_embeddings=True, attention_bias=True,
    )),
    "olmo2": ("Olmo2Config", dict(attention_bias=True)),  # norms after the attention and MLP, q/k norms over all heads
    "qwen3-moe": ("Qwen3MoeConfig", dict(  # 4 experts, 2 a token, renormalized; layer 1 keeps a dense MLP
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
    )),
    "mixtral-moe": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, attention_bias=True)),  # not renormalized
    "granitemoe": ("GraniteMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=6.0,
                                            residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=4.0)),
    "qwen2-yarn": ("Qwen2Config", dict(  # long-context Qwen2.5: YaRN past 64 of the tests' positions
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=64,
                             beta_fast=4.0),
    )),
}

# What the TensorRT targets build: not Gemma 2, whose softcapped attention TensorRT's has no form of, nor mixtures of
# experts, which the graph runs with ONNX Runtime's own MoE operator (both refused at build)
TRT_VARIANTS = {name: spec for name, spec in VARIANTS.items()
                if name not in ("gemma2", "qwen3-moe", "mixtral-moe", "olmoe", "granitemoe")}


def make_tiny_model(name: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    config_cls, extra = VARIANTS[name]
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in pname:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)
    tokenizer_json(out_dir, config.vocab_size)
    return out_dir


def tokenizer_json(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with a small vocabulary (no merges beyond bytes) and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bytes_vocab = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(bytes_vocab))}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="<|im_end|>")
    fast.chat_template = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    fast.save_pretrained(out_dir)


def tiny_engine(root: Path, arch: str = "llama", **build_options) -> Path:
    """A tiny model's checkpoint in root/hf built into root/engine (BuildConfig keyword arguments)."""
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    build_engine(BuildConfig(make_tiny_model(arch, root / "hf"), root / "engine", **build_options))
    return root / "engine"


def stamped(manifest: dict) -> dict:
    """An edited manifest with its digest recomputed: what a build writing those values would have written (tests of
    the checks behind the digest edit manifests this way)."""
    from camshaft.manifest import manifest_digest

    return {**manifest, "digest": manifest_digest(manifest)}


def greedy_under_transformers(model_dir: Path, prompt: list[int], got: list[int]) -> bool:
    """`got` is what transformers' greedy decoding gives (each token the argmax of its forward pass over the
    sequence before it; generate's min_new_tokens would ban the end id, which ignore_eos lets the engine pick)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1:]
    return logits.argmax(-1).tolist() == got


def check_generation(engine: Path, model_dir: Path, prompts: list[list[int]], new: int) -> None:
    """Greedy outputs of both Session graphs and of LLM's in-flight batching are transformers' own (see
    greedy_under_transformers), and LLM's equal the Session's."""
    from camshaft import LLM, SamplingParams
    from camshaft.runtime.session import Session

    for graph in ("sequence", "batch"):
        with Session(engine, graph=graph) as session:
            got = [session.generate(p, max_tokens=new, ignore_eos=True).token_ids for p in prompts]
        for prompt, tokens in zip(prompts, got, strict=True):
            assert len(tokens) == new and greedy_under_transformers(model_dir, prompt, tokens), (graph, prompt)
    with LLM(engine) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == got


def fail_step(llm, at: int, message: str = "device lost") -> None:
    """The LLM's engine step number `at` (from 1) raises RuntimeError(message); the others run as before."""
    step, calls = llm.engine.step, []

    def failing(chunks):
        calls.append(1)
        if len(calls) == at:
            raise RuntimeError(message)
        return step(chunks)
    llm.engine.step = failing
