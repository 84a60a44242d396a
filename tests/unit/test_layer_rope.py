"""The shared decoder's per-layer-type rotary settings (DecoderArgs.layer_rope) read from config.json's
rope_parameters keyed by layer type, against transformers' own frequencies: Gemma 4's "proportional" RoPE (a
fraction of each head's pairs rotated, at frequencies over the whole head width) and a partial rotary factor; and
written back the same way. (YaRN and linear per layer type: tests/unit/test_olmo3.py, tests/unit/test_gemma3.py.)"""

import types

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.models.common.decoder_args import DecoderArgs  # noqa: E402
from titanlite.models.common.decoder_config import layer_rope_from_hf, layer_rope_to_hf  # noqa: E402
from titanlite.models.common.rope import RotaryTable  # noqa: E402

HEAD_DIM = 64
PARAMS = {
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
}


def transformers_frequencies(kind: str) -> torch.Tensor:
    """transformers' inverse frequencies of layer type `kind` (a bare config: the fields its functions read)."""

    class Config(types.SimpleNamespace):
        @property
        def per_layer_config(self):  # none: transformers then reads the layer type's entry of rope_parameters
            raise ValueError("no per-layer config")

    config = Config(rope_parameters=PARAMS, head_dim=HEAD_DIM, hidden_size=256, num_attention_heads=4,
                    standardize_rope_params=lambda: None)  # fmt: skip
    if PARAMS[kind]["rope_type"] == "proportional":
        inv_freq, _ = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type=kind)
        return inv_freq
    # The default RoPE over a partial rotary factor: head_dim x factor channels (transformers' models' own
    # compute_default_rope_parameters).
    dim = int(HEAD_DIM * PARAMS[kind]["partial_rotary_factor"])
    return 1.0 / (PARAMS[kind]["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


@pytest.mark.parametrize("kind", PARAMS)
def test_a_layer_types_rotations_are_transformers(kind):
    rope = layer_rope_from_hf({"rope_parameters": PARAMS}, "config.json", HEAD_DIM, ("default", "proportional"))[kind]
    theirs = transformers_frequencies(kind)
    rotated = rope.rotary_dim // 2
    assert rotated == int(PARAMS[kind]["partial_rotary_factor"] * HEAD_DIM) // 2
    assert not theirs[rotated:].any()  # proportional: the pairs past the rotated ones turn at frequency zero
    positions = torch.arange(50, dtype=torch.float32)
    cos, sin = RotaryTable.of(rope, HEAD_DIM).compute(50, "cpu")
    angles = torch.outer(positions, theirs[:rotated])
    torch.testing.assert_close(cos, angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, angles.sin(), rtol=0, atol=1e-6)
    args = DecoderArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=64, family="llama3",
                       head_dim=HEAD_DIM, layer_rope={kind: rope})  # fmt: skip
    written = layer_rope_to_hf(args, (kind,))
    assert layer_rope_from_hf({"rope_parameters": written}, "x", HEAD_DIM, ("default", "proportional"))[kind] == rope


def test_a_rope_type_the_family_does_not_take_is_refused_naming_the_layer_type():
    with pytest.raises(ConfigError, match="rope_parameters full_attention rope_type='proportional'"):
        layer_rope_from_hf({"rope_parameters": PARAMS}, "config.json", HEAD_DIM)
