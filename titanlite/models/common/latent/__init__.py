"""Multi-head latent attention as a piece families share: its arguments (args.py) and config.json fields
(hf_config.py), both torch-free; the decoder that builds and initialises it (model.py); its weights' names (weights.py).
The attention module itself is titanlite/models/common/mixers.py LatentAttention."""
