"""Multi-head latent attention's config.json fields both ways, torch-free, in DeepSeek-V3's names (which Kimi Linear's
config.json shares): read into LatentArgs' fields with the refusals every latent family makes, and written back."""

from __future__ import annotations

from titanlite.base.hf_config import COUNT, WHOLE, FieldTypes, refuse
from titanlite.models.common.latent.args import LatentArgs

WIDTHS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# LatentArgs' fields -> their config.json keys (the same names), for refusals in config.json's words.
LATENT_KEYS = {name: name for name in WIDTHS}
# The decoder's config.json fields (decoder_config.decoder_fields) a latent family's leaves out: each head's widths
# are WIDTHS.
LATENT_OMITS = ("head_dim",)
# Their JSON types (check_types' table, titanlite/base/hf_config.py): a latent family's spec declares them.
LATENT_FIELDS: FieldTypes = {
    "q_lora_rank": (WHOLE, True),
    "kv_lora_rank": (COUNT, False),
    "qk_nope_head_dim": (COUNT, False),
    "qk_rope_head_dim": (COUNT, False),
    "v_head_dim": (COUNT, False),
}


def latent_from_config(config: dict, where: str, family: str, n_heads: int, q_lora_rank: int = 0) -> dict:
    """LatentArgs' fields of a config.json (absent keys: DeepseekV3Config's defaults, and `q_lora_rank`, the family's;
    null q_lora_rank: one q_proj). Refused in one line: a num_key_value_heads other than the `n_heads` heads (each has
    its own key and value) and attention_bias (`family`'s projections have none)."""
    kv_heads = config.get("num_key_value_heads") or n_heads
    if kv_heads != n_heads:
        raise refuse(
            where, "num_key_value_heads", kv_heads, f"latent attention gives every head its own key and value; "
            f"set it to num_attention_heads={n_heads}",
        )  # fmt: skip
    if config.get("attention_bias"):
        raise refuse(where, "attention_bias", True, f"{family}'s attention projections have no biases")
    return {
        "q_lora_rank": config.get("q_lora_rank", q_lora_rank) or 0,
        "kv_lora_rank": config.get("kv_lora_rank", 512),
        "qk_nope_head_dim": config.get("qk_nope_head_dim", 128),
        "qk_rope_head_dim": config.get("qk_rope_head_dim", 64),
        "v_head_dim": config.get("v_head_dim", 128),
    }


def latent_to_config(args: LatentArgs) -> dict:
    """The latent attention's config.json fields (q_lora_rank null for one q_proj), without biases or dropout; the
    family writes the heads (num_attention_heads, and num_key_value_heads as many)."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "q_lora_rank": args.q_lora_rank or None,
        **{name: getattr(args, name) for name in WIDTHS[1:]},
    }
