"""Hugging Face interoperability: export a GPT-2 or Llama to a folder `transformers` loads, and import back.
Weights move as plain state dicts (full tensors, not DTensor shards); only torch, json and safetensors needed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from titanlite.errors import ConfigError
from titanlite.models.gpt2 import GPT2Args
from titanlite.models.llama import LlamaArgs

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Conv1D weights in HF's GPT-2 are stored [in, out], the transpose of nn.Linear's [out, in].
_GPT2_TRANSPOSED = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Non-parameter entries some HF checkpoints carry (old GPT-2 causal-mask buffers, old Llama RoPE tables).
_HF_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _is_llama(args) -> bool:
    if isinstance(args, LlamaArgs):
        return True
    if isinstance(args, GPT2Args):
        return False
    raise ConfigError(f"Hugging Face export supports GPT2Args and LlamaArgs, not {type(args).__name__}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config(args, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json content that makes transformers build exactly this model.

    vocab_size is our padded vocabulary (a multiple of 64, e.g. 50304 for GPT-2's 50257 tokens): the
    exported embedding and output rows are the padded ones, and ids past the tokenizer's are never produced
    by it. dtype is the dtype the weights are saved in."""
    # The tokenizer is not known here: no special token ids rather than GPT2Config's/LlamaConfig's defaults
    # (50256, 1/2), which may not even be in our vocabulary.
    common = {
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    # transformers >= 4.56 reads "dtype"; older versions read "torch_dtype".
    dtypes = {"dtype": _dtype_name(dtype), "torch_dtype": _dtype_name(dtype)}
    if _is_llama(args):
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len,
            # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta.
            "rope_theta": args.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
            **common,
            **dtypes,
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": args.dim,
        "n_layer": args.n_layers,
        "n_head": args.n_heads,
        "n_inner": 4 * args.dim,
        "n_positions": args.max_seq_len,
        "layer_norm_epsilon": args.norm_eps,
        "activation_function": "gelu_new",  # the tanh approximation our FeedForward uses
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        **common,
        **dtypes,
    }


def _llama_names(args: LlamaArgs) -> dict[str, str]:
    """Our parameter name -> HF LlamaForCausalLM name (output.weight included even when tied)."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        names[ours + "attention_norm.weight"] = hf + "input_layernorm.weight"
        names[ours + "ffn_norm.weight"] = hf + "post_attention_layernorm.weight"
        for w, proj in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            names[f"{ours}attention.{w}.weight"] = f"{hf}self_attn.{proj}.weight"
        for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            names[f"{ours}feed_forward.{w}.weight"] = f"{hf}mlp.{proj}.weight"
    return names


def _gpt2_names(args: GPT2Args) -> dict[str, str]:
    """Our parameter name -> HF GPT2LMHeadModel name, for every parameter but the fused q/k/v."""
    names = {
        "tok_embeddings.weight": "transformer.wte.weight",
        "pos_embeddings.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
        "output.weight": "lm_head.weight",
    }
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for leaf in ("weight", "bias"):
            names[f"{ours}attention_norm.{leaf}"] = f"{hf}ln_1.{leaf}"
            names[f"{ours}ffn_norm.{leaf}"] = f"{hf}ln_2.{leaf}"
            names[f"{ours}attention.wo.{leaf}"] = f"{hf}attn.c_proj.{leaf}"
            names[f"{ours}feed_forward.w1.{leaf}"] = f"{hf}mlp.c_fc.{leaf}"
            names[f"{ours}feed_forward.w2.{leaf}"] = f"{hf}mlp.c_proj.{leaf}"
    return names


def rope_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows of a q/k projection from adjacent RoPE pairs (2i, 2i+1) to halves (i, i+hd/2).

    HF row a*hd/2 + i of a head is our row 2i + a, so HF's rotate_half rotates the same pairs by the same
    angles; q and k get the same reordering, so their dot products, and the logits, do not change."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def rope_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of rope_to_hf: halves (i, i+hd/2) back to adjacent pairs (2i, 2i+1)."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, 2, hd // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _take(sd: dict, name: str, what: str) -> torch.Tensor:
    if name not in sd:
        raise ConfigError(f"{what} has no {name!r}; it does not match the model's configuration")
    return sd[name]


def to_hf(args, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts. lm_head.weight is always present (equal to the embedding
    when tied, as in HF's own state_dict()); save_hf drops it for tied models."""
    sd = state_dict
    tied = args.tie_embeddings
    out: dict[str, torch.Tensor] = {}
    if _is_llama(args):
        for ours, hf in _llama_names(args).items():
            t = _take(sd, "tok_embeddings.weight" if tied and ours == "output.weight" else ours, "state dict")
            if ours.endswith("attention.wq.weight"):
                t = rope_to_hf(t, args.n_heads)
            elif ours.endswith("attention.wk.weight"):
                t = rope_to_hf(t, args.n_kv_heads)
            out[hf] = t
        return out
    for ours, hf in _gpt2_names(args).items():
        t = _take(sd, "tok_embeddings.weight" if tied and ours == "output.weight" else ours, "state dict")
        out[hf] = t.t() if hf.endswith(_GPT2_TRANSPOSED) else t
    for i in range(args.n_layers):
        # HF fuses q, k, v into one Conv1D: weight [dim, 3*dim] (q | k | v along the output dim), bias [3*dim].
        for leaf in ("weight", "bias"):
            parts = [_take(sd, f"layers.{i}.attention.{w}.{leaf}", "state dict") for w in ("wq", "wk", "wv")]
            fused = torch.cat(parts, dim=0)
            out[f"transformer.h.{i}.attn.c_attn.{leaf}"] = fused.t() if leaf == "weight" else fused
    return out


def _normalize_hf_keys(args, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop non-parameter buffers; give bare GPT2Model checkpoints (e.g. openai-community/gpt2) their prefix."""
    sd = {k: v for k, v in hf_state_dict.items() if not k.endswith(_HF_BUFFER_SUFFIXES)}
    if not _is_llama(args) and "transformer.wte.weight" not in sd and "wte.weight" in sd:
        sd = {(k if k == "lm_head.weight" else "transformer." + k): v for k, v in sd.items()}
    return sd


def from_hf(args, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names and layouts -> our state dict, ready for model.load_state_dict(strict=True).

    A tied model's state_dict() lists the shared tensor as both tok_embeddings.weight and output.weight,
    so both keys are returned (the same tensor); HF's lm_head.weight, saved or not, is then ignored."""
    sd = _normalize_hf_keys(args, hf_state_dict)
    tied = args.tie_embeddings
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return _take(sd, name, "Hugging Face state dict")

    out: dict[str, torch.Tensor] = {}
    names = _llama_names(args) if _is_llama(args) else _gpt2_names(args)
    for ours, hf in names.items():
        if tied and ours == "output.weight":
            continue
        t = take(hf)
        if ours.endswith("attention.wq.weight"):
            t = rope_from_hf(t, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            t = rope_from_hf(t, args.n_kv_heads)
        elif hf.endswith(_GPT2_TRANSPOSED):
            t = t.t()
        out[ours] = t.contiguous()
    if not _is_llama(args):
        for i in range(args.n_layers):
            for leaf in ("weight", "bias"):
                fused = take(f"transformer.h.{i}.attn.c_attn.{leaf}")
                fused = fused.t() if leaf == "weight" else fused
                for w, part in zip(("wq", "wk", "wv"), fused.chunk(3, dim=0)):
                    out[f"layers.{i}.attention.{w}.{leaf}"] = part.contiguous()
    if tied:
        used.add("lm_head.weight")
        out["output.weight"] = out["tok_embeddings.weight"]
    unknown = sorted(set(sd) - used)
    if unknown:
        raise ConfigError(f"Hugging Face state dict has {len(unknown)} unexpected tensors, e.g. {unknown[0]!r}")
    return out


def save_hf(folder: str | Path, args, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    """Write config.json and model.safetensors to `folder` (created if needed), weights cast to `dtype`.

    A tied model's lm_head.weight is left out, as HF's save_pretrained does: safetensors refuses tensors
    that share memory, and transformers re-ties lm_head to the embedding on load."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = to_hf(args, state_dict)
    if args.tie_embeddings:
        del hf["lm_head.weight"]
    # clone: no entry may share storage with another (or stay a view of the live model's parameters).
    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous().clone() for k, v in hf.items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(hf_config(args, dtype), indent=2, sort_keys=True) + "\n")


def _weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    index = folder / INDEX_FILE
    if not index.is_file():
        raise ConfigError(f"{folder} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index} has no weight_map")
    files = [folder / name for name in sorted(set(weight_map.values()))]
    for path in files:
        if not path.is_file():
            raise ConfigError(f"{path} is listed in {index} but does not exist")
    return files


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


def load_hf(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a Hugging Face model folder: (config.json as a dict, every tensor of its safetensors files on CPU)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"Hugging Face model folder {folder} does not exist")
    if not (folder / CONFIG_FILE).is_file():
        raise ConfigError(f"{folder / CONFIG_FILE} does not exist")
    config = _read_json(folder / CONFIG_FILE)
    state_dict: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        state_dict.update(load_file(str(path), device="cpu"))
    return config, state_dict


def _require(config: dict, key: str, ok, why: str) -> None:
    value = config.get(key)
    if not ok(value):
        raise ConfigError(f"config.json {key}={value!r} is not supported: {why}")


def _gpt2_args(config: dict) -> GPT2Args:
    dim = config["n_embd"]
    _require(config, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), "need tanh GELU")
    _require(config, "n_inner", lambda v: v in (None, 4 * dim), "the MLP must be 4 * n_embd wide")
    _require(config, "scale_attn_by_inverse_layer_idx", lambda v: not v, "no per-layer attention scaling")
    _require(config, "scale_attn_weights", lambda v: v in (None, True), "attention scales by 1/sqrt(head_dim)")
    return GPT2Args(
        dim=dim,
        n_layers=config["n_layer"],
        n_heads=config["n_head"],
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("n_positions", 1024),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=config.get("tie_word_embeddings", True),
    )


def _llama_rope_theta(config: dict) -> float:
    """rope_theta from transformers 5's rope_parameters or 4.x's top level; only unscaled RoPE is supported."""
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(f"config.json rope_type={rope_type!r} is not supported: titanlite's RoPE is unscaled")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _llama_args(config: dict) -> LlamaArgs:
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    _require(config, "hidden_act", lambda v: v in (None, "silu"), "the MLP is SwiGLU")
    _require(config, "attention_bias", lambda v: not v, "attention has no biases")
    _require(config, "mlp_bias", lambda v: not v, "the MLP has no biases")
    _require(config, "head_dim", lambda v: v in (None, dim // n_heads), "head_dim must be hidden_size // heads")
    return LlamaArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=_llama_rope_theta(config),
        norm_eps=config.get("rms_norm_eps", 1e-6),  # LlamaConfig's defaults where a key is absent
        tie_embeddings=config.get("tie_word_embeddings", False),
    )


def args_from_hf_config(config: dict) -> GPT2Args | LlamaArgs:
    """Our model arguments from a transformers config.json, flavor or not. The vocabulary is taken as is
    (not padded), so the imported model's logits match the HF model's column for column."""
    model_type = config.get("model_type")
    try:
        if model_type == "gpt2":
            return _gpt2_args(config)
        if model_type == "llama":
            return _llama_args(config)
    except KeyError as e:
        raise ConfigError(f"config.json for model_type={model_type!r} lacks {e.args[0]!r}") from e
    raise ConfigError(f"config.json model_type={model_type!r} is not supported; use 'gpt2' or 'llama'")


def load_hf_into(model_parts: list, folder: str | Path) -> None:
    """Fill a (possibly sharded or pipelined) model from a Hugging Face folder, as a run's starting weights.

    The folder's model must have the configured model's shape. Its vocabulary may be smaller than our
    padded one (GPT-2: 50257 of 50304): the extra rows start at zero and are never an input token.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    config, hf_state = load_hf(folder)
    source, target = args_from_hf_config(config), model_parts[0].args
    if type(source) is not type(target):
        raise ConfigError(
            f"checkpoint.initial_load_path='{folder}' holds a {config.get('model_type')} model, but model.name "
            f"builds a {type(target).__name__.removesuffix('Args')}; set model.name to match"
        )
    fields = [f for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings") if hasattr(target, f)]
    differ = [f for f in fields if getattr(source, f, None) != getattr(target, f)]
    if differ or source.vocab_size > target.vocab_size:
        have = ", ".join(f"{f}={getattr(source, f, None)}" for f in differ + ["vocab_size"])
        want = ", ".join(f"{f}={getattr(target, f)}" for f in differ + ["vocab_size"])
        raise ConfigError(
            f"checkpoint.initial_load_path='{folder}' holds a {type(source).__name__} with {have}, but the "
            f"configured model has {want}; set model.name/flavor/tokenizer to match"
        )
    if isinstance(target, GPT2Args) and source.max_seq_len != target.max_seq_len:
        raise ConfigError(
            f"checkpoint.initial_load_path='{folder}' has {source.max_seq_len} positions but the model has "
            f"{target.max_seq_len}; use training.seq_len <= {source.max_seq_len}"
        )
    state = from_hf(source, hf_state)
    for key in ("tok_embeddings.weight", "output.weight"):
        if key in state and state[key].shape[0] < target.vocab_size:
            extra = state[key].new_zeros(target.vocab_size - state[key].shape[0], state[key].shape[1])
            state[key] = torch.cat([state[key], extra])
    # Every rank reads the same full tensors and keeps its own shard of each.
    for part in model_parts:
        set_model_state_dict(part, state, options=StateDictOptions(full_state_dict=True, strict=False))
