"""Blocks every family may use: the model interface, attention cores, the KV cache, weight init, building."""
