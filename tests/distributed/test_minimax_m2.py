"""MiniMax-M2 folders on real layouts (gloo, fp32): a folder imports on TP x 2 and EP x 2 with transformers' logits.
Its debug model's training on every layout: tests/distributed/test_bias_routed_families.py."""

import pytest
import torch

pytestmark = pytest.mark.distributed


@pytest.mark.slow  # two 2-rank imports, about 10 s: CI runs them
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_a_minimax_m2_folder_imports_on_a_layout_with_transformers_logits(tmp_path, layout):
    """TP x 2 (each rank's heads of the projections and of the whole-projection norms' weights, their rotating rows
    reordered per head) or EP x 2 (experts stacked from their tensors and sharded): each rank reads the folder one
    tensor at a time, the routing biases too, and the forward gives transformers' logits."""
    pytest.importorskip("transformers")
    from tests.conformance import assert_logits_match
    from tests.distributed.test_hf_layouts import layout_logits
    from tests.unit.test_minimax_m2 import VOCAB, random_minimax

    hf = random_minimax()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    ours = layout_logits(tmp_path / "hf", tokens, layout)
    with torch.no_grad():
        assert_logits_match(ours, hf(tokens).logits)
