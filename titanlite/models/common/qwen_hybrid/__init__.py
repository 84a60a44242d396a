"""The Qwen hybrid decoder: Gated DeltaNet linear-attention layers beside gated full-attention ones (Qwen3.5's text
model), shared by the families built on it (qwen3_5, qwen3_5_moe, qwen3_next): its arguments, module, config.json,
weight names and tensor-parallel plan."""
