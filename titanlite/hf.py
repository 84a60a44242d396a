"""Hugging Face interoperability: export a GPT-2 or Llama to a folder `transformers` loads, and import back.

A folder's config.json gives the model's shape and every field that changes its math (honoured, or refused
with one line naming the field); its safetensors give the weights, read one tensor at a time, so a sharded
layout never holds more than one full parameter; its tokenizer.json is the tokenizer (titanlite/data/tokenizer.py).
Only torch, json and safetensors are needed (transformers only in the tests)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from titanlite.errors import ConfigError
from titanlite.models.gpt2 import GPT2Args
from titanlite.models.llama import Llama3RopeScaling, LlamaArgs

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Our model family (model.name) of each supported config.json model_type.
FAMILIES = {"gpt2": "gpt2", "llama": "llama3"}

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


def hf_config(args, dtype: torch.dtype = torch.float32, token_ids: dict | None = None) -> dict:
    """The config.json content that makes transformers build exactly this model.

    vocab_size is the model's (for a named flavor, the tokenizer's padded to a multiple of 64, e.g. 50304
    for GPT-2's 50257 tokens: ids past the tokenizer's are never produced by it). dtype is the dtype the
    weights are saved in; token_ids the tokenizer's bos/eos ids (none rather than GPT2Config's/LlamaConfig's
    defaults, which may not even be in our vocabulary)."""
    ids = {"bos_token_id": None, "eos_token_id": None, **(token_ids or {})}
    common = {"vocab_size": args.vocab_size, "tie_word_embeddings": args.tie_embeddings, **ids, "pad_token_id": None}
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
            # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta and rope_scaling.
            "rope_theta": args.rope_theta,
            "rope_parameters": {"rope_theta": args.rope_theta, **_rope_scaling_to_hf(args.rope_scaling)},
            "rope_scaling": _rope_scaling_to_hf(args.rope_scaling) if args.rope_scaling else None,
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
        "n_inner": args.ffn_dim,
        "n_positions": args.max_seq_len,
        "layer_norm_epsilon": args.norm_eps,
        "activation_function": _GPT2_ACTIVATION_TO_HF[args.activation],
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


def _rope_scaling_to_hf(scaling: Llama3RopeScaling | None) -> dict:
    if scaling is None:
        return {"rope_type": "default"}
    return {"rope_type": "llama3", **dataclasses.asdict(scaling)}


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


def _hf_keys(args, keys) -> dict[str, str]:
    """Our view of a folder's tensor names: non-parameter buffers dropped, and bare GPT2Model checkpoints
    (e.g. openai-community/gpt2, saved without the "transformer." prefix) given it. Maps to the stored name."""
    keys = [k for k in keys if not k.endswith(_HF_BUFFER_SUFFIXES)]
    if not _is_llama(args) and "transformer.wte.weight" not in keys and "wte.weight" in keys:
        return {(k if k == "lm_head.weight" else "transformer." + k): k for k in keys}
    return {k: k for k in keys}


def hf_sources(args) -> dict[str, str]:
    """Our parameter name -> the Hugging Face tensor it is made from (GPT-2's q, k, v all come from c_attn;
    a tied output.weight from the embedding, as it is the same tensor)."""
    names = dict(_llama_names(args) if _is_llama(args) else _gpt2_names(args))
    if not _is_llama(args):
        for i in range(args.n_layers):
            for w in ("wq", "wk", "wv"):
                for leaf in ("weight", "bias"):
                    names[f"layers.{i}.attention.{w}.{leaf}"] = f"transformer.h.{i}.attn.c_attn.{leaf}"
    if args.tie_embeddings:
        names["output.weight"] = names["tok_embeddings.weight"]
    return names


def from_hf_tensor(args, name: str, hf: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s full value from its Hugging Face tensor (hf_sources[name])."""
    if name.endswith("attention.wq.weight") and _is_llama(args):
        return rope_from_hf(hf, args.n_heads).contiguous()
    if name.endswith("attention.wk.weight") and _is_llama(args):
        return rope_from_hf(hf, args.n_kv_heads).contiguous()
    if not _is_llama(args) and ".attention.w" in name and name.rsplit(".", 2)[-2] in ("wq", "wk", "wv"):
        # HF fuses q, k, v into one Conv1D: weight [dim, 3*dim] (q | k | v along the output dim), bias [3*dim].
        fused = hf.t() if name.endswith("weight") else hf
        return fused.chunk(3, dim=0)["qkv".index(name.rsplit(".", 2)[-2][1])].contiguous()
    if not _is_llama(args) and name.endswith(("attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight")):
        return hf.t().contiguous()  # HF's Conv1D stores these [in, out]
    return hf


def from_hf(args, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names and layouts -> our state dict, ready for model.load_state_dict(strict=True).

    A tied model's state_dict() lists the shared tensor as both tok_embeddings.weight and output.weight,
    so both keys are returned (the same tensor); HF's lm_head.weight, saved or not, is then ignored."""
    keys = _hf_keys(args, hf_state_dict)
    sources = hf_sources(args)
    _check_tensor_names(args, keys, sources, "Hugging Face state dict")
    out = {name: from_hf_tensor(args, name, hf_state_dict[keys[hf]]) for name, hf in sources.items()
           if not (args.tie_embeddings and name == "output.weight")}
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _check_tensor_names(args, keys: dict[str, str], sources: dict[str, str], what: str) -> None:
    """Every tensor the model needs is there, and nothing else (a tied model's lm_head.weight may be)."""
    needed = set(sources.values())
    missing = sorted(needed - set(keys))
    if missing:
        raise ConfigError(f"{what} has no {missing[0]!r}; it does not match the model's configuration")
    unknown = sorted(set(keys) - needed - ({"lm_head.weight"} if args.tie_embeddings else set()))
    if unknown:
        raise ConfigError(f"{what} has {len(unknown)} unexpected tensors, e.g. {unknown[0]!r}")


def save_hf(
    folder: str | Path, args, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
    tokenizer=None, max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write config.json, generation_config.json, the weights cast to `dtype` and (given a tokenizer) its
    files to `folder` (created if needed), so that AutoModelForCausalLM and AutoTokenizer load it offline.

    Weights over max_shard_bytes are split into model-0000i-of-0000n.safetensors files listed by
    model.safetensors.index.json, as save_pretrained does. A tied model's lm_head.weight is left out, as
    save_pretrained does: safetensors refuses tensors that share memory, and transformers re-ties it on load."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    token_ids = {}
    if tokenizer is not None:
        from titanlite.hf_tokenizer import save_tokenizer

        token_ids = save_tokenizer(folder, tokenizer, args.max_seq_len)
    hf = to_hf(args, state_dict)
    if args.tie_embeddings:
        del hf["lm_head.weight"]
    # clone: no entry may share storage with another (or stay a view of the live model's parameters).
    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous().clone() for k, v in hf.items()}
    for stale in [*folder.glob("model*.safetensors"), folder / INDEX_FILE]:
        stale.unlink(missing_ok=True)  # a re-export must not leave shards of an earlier one beside its own
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in names}, str(folder / file), metadata={"format": "pt"})
            weight_map |= {k: file for k in names}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_FILE).write_text(json.dumps(hf_config(args, dtype, token_ids), indent=2, sort_keys=True) + "\n")
    generation = {**{k: v for k, v in token_ids.items() if v is not None}, "do_sample": False}
    (folder / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names in file order, cut into groups of at most max_bytes (a larger tensor gets its own)."""
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


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


def read_config(folder: str | Path) -> dict:
    """A Hugging Face model folder's config.json, as a dict."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"Hugging Face model folder {folder} does not exist")
    if not (folder / CONFIG_FILE).is_file():
        raise ConfigError(f"{folder / CONFIG_FILE} does not exist")
    return _read_json(folder / CONFIG_FILE)


class WeightReader:
    """The tensors of a folder's safetensors file(s), read one at a time (never the whole model at once)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        self.files = {}
        self.where: dict[str, Path] = {}
        for path in _weight_files(self.folder):
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for damaged files
                raise ConfigError(f"cannot read {path}: {e}; the file is damaged or not safetensors") from e
            self.files[path] = handle
            self.where |= {key: path for key in handle.keys()}

    def keys(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self.files[self.where[name]].get_tensor(name)


def load_hf(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a Hugging Face model folder whole: (config.json as a dict, every tensor on the CPU)."""
    config = read_config(folder)
    reader = WeightReader(folder)
    return config, {key: reader.get(key) for key in reader.keys()}


# ---- config.json -> our model arguments ------------------------------------------------------------------

# HF activation names that are our GPT-2 MLP's GELUs ("gelu_fast" is the tanh formula written differently).
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
_GPT2_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
# Fields of other families that a relabelled config.json may carry: each changes the math and is not built.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _refuse(where: str, key: str, value, why: str) -> ConfigError:
    return ConfigError(f"{where} {key}={value!r} is not supported: {why}")


def _check_no_unsupported(config: dict, where: str) -> None:
    """Refuse the fields titanlite does not implement (sliding windows, NoPE layers, MoE, quantization)."""
    if config.get("sliding_window") not in (None, 0) and config.get("use_sliding_window", True):
        raise _refuse(where, "sliding_window", config["sliding_window"], "attention is over the whole causal context")
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise _refuse(where, "layer_types", sorted(set(layer_types)), "every layer has full causal attention")
    if any(not use for use in config.get("no_rope_layers") or []):
        raise _refuse(where, "no_rope_layers", "[...0...]", "every layer applies RoPE (no NoPE layers)")
    for key in _MOE_FIELDS:
        if config.get(key):
            raise _refuse(where, key, config[key], "titanlite has dense MLPs, no mixture of experts")
    if config.get("quantization_config"):
        raise _refuse(where, "quantization_config", "{...}", "titanlite reads unquantized weights only")


def _gpt2_args(config: dict, where: str) -> GPT2Args:
    dim, n_heads = config["n_embd"], config["n_head"]
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise _refuse(where, "activation_function", activation, f"the MLP's GELU is one of {', '.join(_GPT2_ACTIVATIONS)}")
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise _refuse(where, "scale_attn_by_inverse_layer_idx", True, "no per-layer attention scaling")
    if config.get("scale_attn_weights", True) is not True:
        raise _refuse(where, "scale_attn_weights", config["scale_attn_weights"], "attention scales by 1/sqrt(head_dim)")
    if config.get("add_cross_attention"):
        raise _refuse(where, "add_cross_attention", True, "titanlite's GPT-2 is a decoder without cross-attention")
    if dim % n_heads:
        raise _refuse(where, "n_head", n_heads, f"it must divide n_embd={dim}")
    return GPT2Args(
        dim=dim,
        n_layers=config["n_layer"],
        n_heads=n_heads,
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("n_positions", 1024),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=config.get("tie_word_embeddings", True),
        ffn_dim=config.get("n_inner") or 4 * dim,
        activation=_GPT2_ACTIVATIONS[activation],
    )


def _llama_rope(config: dict, where: str) -> tuple[float, Llama3RopeScaling | None]:
    """rope_theta and the llama3 frequency scaling, from transformers 5's rope_parameters or 4.x's top-level
    rope_theta and rope_scaling; other RoPE types (linear, dynamic, yarn, longrope) are refused."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if rope_type != "llama3":
        raise ConfigError(f"{where} {key} rope_type={rope_type!r} is not supported: titanlite implements "
                          "unscaled RoPE and Llama 3.1's 'llama3' scaling")
    fields = [f.name for f in dataclasses.fields(Llama3RopeScaling)]
    absent = [f for f in fields if rope.get(f) is None]
    if absent:
        raise ConfigError(f"{where} {key} of rope_type 'llama3' lacks {absent[0]!r}")
    scaling = Llama3RopeScaling(**{f: rope[f] for f in fields})
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(f"{where} {key} needs high_freq_factor > low_freq_factor, not {scaling.high_freq_factor} "
                          f"and {scaling.low_freq_factor}")
    return theta, scaling


def _llama_args(config: dict, where: str) -> LlamaArgs:
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", config["hidden_act"], "the MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise _refuse(where, key, True, "titanlite's Llama has no biases")
    if n_heads % n_kv_heads:
        raise _refuse(where, "num_key_value_heads", n_kv_heads, f"it must divide num_attention_heads={n_heads}")
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim % 2:
        raise _refuse(where, "head_dim", head_dim, "RoPE rotates pairs, so it must be even")
    rope_theta, rope_scaling = _llama_rope(config, where)
    return LlamaArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=rope_theta,
        norm_eps=config.get("rms_norm_eps", 1e-6),  # LlamaConfig's defaults where a key is absent
        tie_embeddings=config.get("tie_word_embeddings", False),
        head_dim=head_dim,
        rope_scaling=rope_scaling,
    )


def args_from_hf_config(config: dict, where: str = "config.json") -> GPT2Args | LlamaArgs:
    """Our model arguments from a transformers config.json, any shape. Every field that changes the math is
    honoured or refused with one line naming it. The vocabulary is taken as is (not padded), so the imported
    model's logits match the HF model's column for column."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{where} model_type={model_type!r} is not supported; titanlite reads 'gpt2' and 'llama'")
    _check_no_unsupported(config, where)
    try:
        return _gpt2_args(config, where) if model_type == "gpt2" else _llama_args(config, where)
    except KeyError as e:
        raise ConfigError(f"{where} for model_type={model_type!r} lacks {e.args[0]!r}") from e


def folder_model_args(folder: str | Path) -> GPT2Args | LlamaArgs:
    """The model a Hugging Face folder holds, from its config.json (errors name the file)."""
    return args_from_hf_config(read_config(folder), f"{Path(folder) / CONFIG_FILE}:")


def folder_args(folder: str | Path, seq_len: int) -> GPT2Args | LlamaArgs:
    """The model of model.flavor = "hf": the shape and math of the folder's config.json, for this run's
    sequence length (GPT-2's learned positions cannot grow; Llama's RoPE tables are computed to cover it)."""
    args = folder_model_args(folder)
    if seq_len > args.max_seq_len:
        if isinstance(args, GPT2Args):
            raise ConfigError(f"training.seq_len={seq_len} is longer than the {args.max_seq_len} learned positions of "
                              f"{folder} (n_positions); use training.seq_len <= {args.max_seq_len}")
        args = dataclasses.replace(args, max_seq_len=seq_len)
    return args


def resolve_model_folder(model, explicit: set[str]) -> None:
    """With model.flavor = "hf", take model.name (and model.tokenizer, when the folder has a tokenizer.json)
    from model.hf_assets_path, in place; a key set explicitly to something else is an error, not ignored."""
    folder = model.hf_assets_path
    if not folder:
        raise ConfigError("model.flavor='hf' takes the model from model.hf_assets_path; set it to a Hugging Face "
                          "model folder (config.json, safetensors, tokenizer.json)")
    args = folder_model_args(folder)
    family = "gpt2" if isinstance(args, GPT2Args) else "llama3"
    has_tokenizer = (Path(folder) / "tokenizer.json").is_file()
    wanted = {"model.name": family}
    if has_tokenizer:
        wanted["model.tokenizer"] = "hf"
    elif family == "gpt2" and args.vocab_size in (50257, 50304):
        wanted["model.tokenizer"] = "gpt2"  # GPT-2's own vocabulary (folders with vocab.json/merges.txt only)
    elif "model.tokenizer" not in explicit:
        raise ConfigError(f"{folder} has no tokenizer.json; set model.tokenizer to the tokenizer its model was trained "
                          "with ('gpt2', 'byte', or 'hf' with model.hf_assets_path naming a folder that has one)")
    if model.n_layers:
        wanted["model.n_layers"] = args.n_layers
    for key, value in wanted.items():
        ours = getattr(model, key.split(".")[1])
        if key in explicit and ours != value:
            raise ConfigError(f"{key}={ours!r} contradicts {folder} ({key} {value!r}); leave it out or set it to "
                              f"{value!r}, or use a named model.flavor")
        setattr(model, key.split(".")[1], value)


# ---- loading a folder into a run's model ------------------------------------------------------------------

_MATH_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "tie_embeddings", "rope_theta",
                "rope_scaling", "norm_eps", "activation")


def _check_compatible(source, target, folder) -> None:
    """The configured model (a named flavor) must compute what the folder's does, or the load is refused."""
    if type(source) is not type(target):
        raise ConfigError(
            f"checkpoint.initial_load_path='{folder}' holds a {type(source).__name__.removesuffix('Args')} model, "
            f"but model.name builds a {type(target).__name__.removesuffix('Args')}; set model.flavor = 'hf' and "
            f"model.hf_assets_path = '{folder}' to take the folder's model"
        )
    differ = [f for f in _MATH_FIELDS if hasattr(target, f) and getattr(source, f) != getattr(target, f)]
    if isinstance(target, GPT2Args) and source.max_seq_len != target.max_seq_len:
        differ.append("max_seq_len")
    if source.vocab_size > target.vocab_size:
        differ.append("vocab_size")
    if differ:
        have = ", ".join(f"{f}={getattr(source, f)}" for f in differ)
        want = ", ".join(f"{f}={getattr(target, f)}" for f in differ)
        raise ConfigError(
            f"checkpoint.initial_load_path='{folder}' has {have}, but the configured model has {want}; set "
            f"model.flavor = 'hf' and model.hf_assets_path = '{folder}' to take the folder's shape"
        )


def load_hf_into(model_parts: list, folder: str | Path) -> None:
    """Fill a (possibly sharded or pipelined) model from a Hugging Face folder, as a run's starting weights.

    Each parameter is read from the safetensors files, converted and sliced to this rank's shard one at a
    time, so no rank ever holds the whole model. A named flavor's vocabulary may be larger than the
    folder's (GPT-2: 50304 padded of 50257): the extra rows start at zero and are never an input token."""
    from titanlite.parallel.parallelize import fill_parameters

    source, target = folder_model_args(folder), model_parts[0].args
    _check_compatible(source, target, folder)
    reader = WeightReader(folder)
    keys, sources = _hf_keys(source, reader.keys()), hf_sources(source)
    _check_tensor_names(source, keys, sources, f"{folder}'s safetensors")

    def full_value(name: str, param: torch.nn.Parameter) -> torch.Tensor:
        value = from_hf_tensor(source, name, reader.get(keys[sources[name]])).to(param.dtype)
        if value.shape[0] < param.shape[0] and name in ("tok_embeddings.weight", "output.weight"):
            value = torch.cat([value, value.new_zeros(param.shape[0] - value.shape[0], *value.shape[1:])])
        if value.shape != param.shape:
            raise ConfigError(f"{folder}: {sources[name]!r} has shape {tuple(value.shape)}, but the model's {name} "
                              f"is {tuple(param.shape)}")
        return value

    for part in model_parts:
        fill_parameters(part, full_value)
