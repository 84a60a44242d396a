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
