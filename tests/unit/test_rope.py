"""YaRN's frequencies and attention scale (titanlite/models/common/rope.py) against transformers' own computation,
and its config.json both ways."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.models.common.decoder_config import rope_settings  # noqa: E402
from titanlite.models.common.rope import yarn_frequencies  # noqa: E402
from titanlite.models.common.rope_args import yarn_from_hf, yarn_to_hf  # noqa: E402

CASES = {  # rope dicts as config.json writes them (head_dim 64, theta 1e4 / 5e4, max_position_embeddings 4096)
    "plain": {"factor": 4.0, "original_max_position_embeddings": 1024},
    "gpt-oss": {"factor": 32.0, "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False},
    "deepseek": {"factor": 40.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                 "mscale": 1.0, "mscale_all_dim": 0.707},
    "attention_factor": {"factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 1.3},
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("theta", [1e4, 5e4])
def test_yarn_frequencies_and_scale_equal_transformers(case, theta):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": theta, **CASES[case]}
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=dict(rope)
    )
    theirs, their_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    scaling = yarn_from_hf(rope, "config.json rope_parameters", {"max_position_embeddings": 4096})
    ours = yarn_frequencies(64, theta, scaling)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert scaling.attention_scale == pytest.approx(their_scale, rel=1e-12)
    assert yarn_from_hf(yarn_to_hf(scaling), "again", {}) == scaling


def test_yarn_reads_the_top_level_original_context_first():
    """transformers gives a top-level original_max_position_embeddings priority, then the dict's, then
    max_position_embeddings."""
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}
    assert yarn_from_hf(rope, "w", {"original_max_position_embeddings": 256}).original_max_position_embeddings == 256
    assert yarn_from_hf({"factor": 2.0}, "w", {"max_position_embeddings": 300}).original_max_position_embeddings == 300


@pytest.mark.parametrize(
    "rope, words",
    [
        ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}, "factor=0.5"),
        (
            {"rope_type": "yarn", "factor": 2.0, "beta_fast": 1, "beta_slow": 2, "original_max_position_embeddings": 8},
            "beta_fast > beta_slow",
        ),
        ({"rope_type": "yarn", "factor": 2.0}, "lacks 'original_max_position_embeddings'"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "lacks 'factor'"),
    ],
)
def test_a_bad_yarn_config_is_one_line_naming_it(rope, words):
    with pytest.raises(ConfigError, match=words) as e:
        rope_settings({"rope_scaling": rope}, "config.json")
    assert "\n" not in str(e.value)


def test_the_shared_decoders_partial_rotary_is_transformers_and_converts_its_rows():
    """DecoderArgs.rotary_dim: the shared decoder rotates the leading rotary_dim channels of each head over a table of
    rotary_dim // 2 frequencies (a layer kind's own LayerRope.rotary_dim overriding it), and the Llama decoder's
    conversion reorders only those rows, so the query projected with the exported weights and rotated as
    transformers' partial rotary does (GLM-4.5's apply_rotary_pos_emb) is ours in Hugging Face's row order."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    from titanlite.models.common import decoder_weights
    from titanlite.models.common.decoder import Transformer
    from titanlite.models.common.decoder_args import debug
    from titanlite.models.common.decoder_config import DecoderConfig
    from titanlite.models.common.rope import apply_rope
    from titanlite.models.common.rope_args import LayerRope

    with pytest.raises(ValueError, match="rotary_dim=7"):
        debug("llama3", vocab_size=64, rotary_dim=7)
    with pytest.raises(ValueError, match="rotary_dim=18"):
        debug("llama3", vocab_size=64, rotary_dim=18)
    assert debug("llama3", vocab_size=64).rotary_dim == 16  # 0: the whole head
    own = {"sliding_attention": LayerRope(1e4, rotary_dim=4)}
    args = debug("llama3", vocab_size=64, rotary_dim=8, qk_norm="head", sliding_window=4, layer_types=(
        "full_attention", "sliding_attention", "full_attention", "full_attention"), layer_rope=own)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(args)
    assert [model.layers[str(i)].attention.rotary_dim for i in range(4)] == [8, 4, 8, 8]
    assert model.rope_cos.shape[-1] == 4 and model.rope_sliding_attention_cos.shape[-1] == 2
    with pytest.raises(ConfigError, match="rotary_dim=8"):
        DecoderConfig("llama3", "llama", "LlamaForCausalLM", switches=lambda *a: {}).write(args)

    sd = {k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items()}
    names = decoder_weights.hf_names(args)
    hf = decoder_weights.to_hf(args, sd, sd.__getitem__)
    for ours, theirs in names.items():  # the import undoes the export
        assert torch.equal(decoder_weights.from_hf_tensor(args, ours, hf[theirs]), sd[ours])
    for layer, rotary in ((0, 8), (1, 4)):
        wq, norm = sd[f"layers.{layer}.attention.wq.weight"], sd[f"layers.{layer}.attention.q_norm.weight"]
        hf_wq = hf[f"model.layers.{layer}.self_attn.q_proj.weight"]
        hf_norm = hf[f"model.layers.{layer}.self_attn.q_norm.weight"]
        x = torch.randn(1, 5, args.dim)
        table = model.rope_cos if rotary == 8 else model.rope_sliding_attention_cos
        angles = torch.atan2(
            (model.rope_sin if rotary == 8 else model.rope_sliding_attention_sin)[:5], table[:5]
        )  # [T, rotary / 2]
        cos, sin = angles.cos(), angles.sin()
        q = torch.nn.functional.rms_norm((x @ wq.T).view(1, 5, 4, 16), (16,), norm, 1e-5)
        ours = apply_rope(q, cos, sin, rotary)
        q_hf = torch.nn.functional.rms_norm((x @ hf_wq.T).view(1, 5, 4, 16), (16,), hf_norm, 1e-5).transpose(1, 2)
        doubled = torch.cat([angles, angles], dim=-1)[None]  # transformers' [B, T, rotary] tables
        theirs, _ = apply_rotary_pos_emb(q_hf, q_hf, doubled.cos(), doubled.sin())
        # our channel 2i + a of the rotating ones is theirs a * rotary / 2 + i; the rest in place
        order = [a * rotary // 2 + i for i in range(rotary // 2) for a in (0, 1)] + list(range(rotary, 16))
        torch.testing.assert_close(ours, theirs.transpose(1, 2)[..., order], rtol=1e-5, atol=1e-6)
