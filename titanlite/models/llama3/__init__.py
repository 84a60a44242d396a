"""Llama 3 (RoPE, RMSNorm, SwiGLU, grouped-query attention): its spec, the shared decoder at its flavors."""

from __future__ import annotations

from titanlite.models.common.decoder_spec import decoder_spec
from titanlite.models.llama3 import args, hf_config

SPEC = decoder_spec(
    "llama3", args.FLAVORS, hf_config.LLAMA, "Llama 3: RoPE (with Llama 3.1's scaling), RMSNorm, SwiGLU, GQA"
)
