"""Block-causal attention and the positions context parallelism hands a rank: a window of several documents
under the block-causal mask gives each document the logits it has alone; a rank's balanced share of a sequence,
with its true positions and the gathered keys, gives that share of the whole sequence's logits. Attention cores
are chosen by name, and context parallelism wraps whichever a block has."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers import run_ranks
from titanlite.base.errors import ConfigError
from titanlite.models.build import build_model
from titanlite.models.common.attention import (
    ATTENTION_CORES,
    CoreAttention,
    SDPAttention,
    Sequence,
    additive_mask,
    attention_mask,
    build_core,
    document_ids,
)
from titanlite.models.common.init import init_weights
from titanlite.parallel.context_parallel import (
    ContextParallelCore,
    SequenceSplit,
    apply_cp,
    balanced_positions,
    check_cp_degree,
    gathered_positions,
)

EOT = 99


def model(name: str):
    torch.manual_seed(0)
    m = build_model(name, "debug", 100, 64)
    init_weights(m, seed=3, device=torch.device("cpu"))
    return m.eval()


def window_of_documents() -> tuple[torch.Tensor, list[torch.Tensor]]:
    docs = [torch.randint(0, 99, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 14, 4, 21)]
    docs = [torch.cat([d, torch.tensor([EOT])]) for d in docs]  # each document ends with the end-of-text id
    return torch.cat(docs)[None], docs


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "block-causal"])
def test_grouped_query_attention_inside_sdpa_equals_repeating_keys_and_values(masked):
    """enable_gqa (query head j reads key/value head j // 4) gives the outputs and gradients of the path it
    replaced: keys and values repeated per query head (repeat_interleave), then plain SDPA."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 96, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 96, 16, generator=g, requires_grad=True) for _ in range(2))
    documents = torch.randint(0, 3, (2, 96), generator=g).sort(dim=1).values
    sequence = Sequence(documents=documents) if masked else None
    ours = build_core("sdpa")(q, k, v, sequence)
    (ours * torch.linspace(-1, 1, 16)).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    k_rep, v_rep = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    if masked:
        mask = additive_mask(Sequence(documents=documents), 96, 96, q.dtype, q.device)
        old = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)
    else:
        old = F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
    (old * torch.linspace(-1, 1, 16)).sum().backward()
    torch.testing.assert_close(ours, old, rtol=1e-6, atol=1e-6)
    for new, before in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(new, before, rtol=1e-5, atol=1e-5)


def test_document_ids_count_the_end_of_text_ids_before_each_token():
    tokens = torch.tensor([[5, EOT, 6, 7, EOT, EOT, 8]])
    assert document_ids(tokens, EOT).tolist() == [[0, 0, 1, 1, 1, 2, 3]]


def test_block_causal_gives_each_document_its_own_logits_on_llama():
    """With RoPE, attention depends on relative positions only: a document inside the window, masked from
    the others, has the logits it has alone at positions 0.. (GPT-2's learned positions do not allow this)."""
    llama = model("llama3")
    tokens, docs = window_of_documents()
    with torch.no_grad():
        together = llama(tokens, sequence=Sequence(documents=document_ids(tokens, EOT)))[0]
        causal = llama(tokens)[0]
        alone = torch.cat([llama(d[None])[0] for d in docs])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(causal[10:], alone[10:], atol=1e-3), "plain causal lets documents see each other"


def test_the_mask_sees_earlier_tokens_of_the_same_document_only():
    documents = torch.tensor([[0, 0, 1, 1]])
    mask = attention_mask(Sequence(documents=documents), 4, 4, torch.device("cpu"))[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_balanced_chunks_give_every_rank_the_same_causal_work():
    assert balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_positions(16, 4).tolist()) == list(range(16))
    work = [int(balanced_positions(64, 4, r).add(1).sum()) for r in range(4)]  # keys seen under a causal mask
    assert len(set(work)) == 1


@pytest.mark.parametrize("name", ["llama3", "gpt2"])
@pytest.mark.parametrize("eot", [None, EOT])
def test_each_ranks_share_in_the_gathered_order_with_true_positions_gives_the_same_logits(name, eot):
    """A rank keeps its balanced share of inputs and labels; the keys it attends over arrive in the gathered
    order (rank 0's share, then rank 1's, ...). With true positions (RoPE or learned) and the mask built from
    them, the sequence laid out in that order gives, token for token, the logits of the natural order."""
    m = model(name)
    tokens, _ = window_of_documents()
    tokens = tokens[:, :48]
    labels = tokens.roll(-1, 1)
    with torch.no_grad():
        documents = {"sequence": Sequence(documents=document_ids(tokens, eot))} if eot is not None else {}
        whole = m(tokens, **documents)[0]
        for rank in range(3):
            inputs, mine, sequence = SequenceSplit(cp=3, rank=rank, eot_id=eot)(tokens, labels)
            positions = balanced_positions(48, 3, rank)
            assert torch.equal(inputs[0], tokens[0, positions]) and torch.equal(mine[0], labels[0, positions])
            assert torch.equal(sequence.positions, positions)
            order = sequence.key_positions
            laid_out = m(tokens[:, order], sequence=Sequence(positions=order, documents=sequence.key_documents))[0]
            torch.testing.assert_close(laid_out, whole[order], rtol=1e-5, atol=1e-5)


def test_a_cp_degree_must_cut_the_sequence_into_equal_chunks():
    check_cp_degree(4, 32)
    with pytest.raises(ConfigError, match=r"context_parallel_degree=3 does not cut training.seq_len=32 into 6 equal"):
        check_cp_degree(3, 32)


def test_a_sequence_cut_into_micro_batches_gives_each_its_own_rows_of_the_mask():
    """What a pipeline schedule does to the batch-major Sequence: cut along dim 0, rebuilt per micro-batch."""
    tokens = torch.tensor([[5, 0, 7, 8, 0, 9, 9, 9], [1, 2, 3, 0, 4, 0, 6, 7], [0, 0, 3, 3, 3, 3, 0, 1], [9] * 8])
    _, _, whole = SequenceSplit(cp=2, rank=1, eot_id=0)(tokens, tokens)
    fields = whole.batch_major(batch=4)
    assert set(fields) == {"positions", "documents", "key_positions", "key_documents"}
    full = attention_mask(whole, 4, 8, tokens.device)
    for first in (0, 2):
        part = Sequence.from_batch_major(**{name: value[first : first + 2] for name, value in fields.items()})
        assert torch.equal(attention_mask(part, 4, 8, tokens.device), full[first : first + 2])
    assert Sequence.from_batch_major() is None


def test_one_additive_mask_serves_every_block_that_keeps_it_and_is_freed_with_them():
    sequence = Sequence(documents=torch.tensor([[0, 0, 1, 1]]))
    first = additive_mask(sequence, 4, 4, torch.float32, "cpu")
    assert additive_mask(sequence, 4, 4, torch.float32, "cpu") is first
    allowed = attention_mask(sequence, 4, 4, "cpu")
    assert torch.equal(first == 0, allowed) and torch.isneginf(first[~allowed]).all()
    del first  # no block keeps it (activation checkpointing): the next one builds its own
    assert sequence.masks.get((4, 4, torch.float32)) is None


class HalfScale(CoreAttention):
    """A test-only second core: softmax(q k^T / 2) under the sequence's mask, not SDPA's default scale."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequence: Sequence | None) -> torch.Tensor:
        mask = additive_mask(sequence or Sequence(), q.shape[2], k.shape[2], q.dtype, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)


def test_a_core_is_chosen_by_name_and_an_unknown_name_is_refused_naming_the_known_ones(monkeypatch):
    assert type(build_core("sdpa")) is SDPAttention
    assert all(type(block.attention.core) is SDPAttention for block in model("llama3").layers.values())
    monkeypatch.setitem(ATTENTION_CORES, "half_scale", HalfScale)
    assert type(build_core("half_scale")) is HalfScale
    with pytest.raises(
        ConfigError, match=r"^attention core 'ring' is not a known one; use one of: sdpa, flex, half_scale$"
    ):
        build_core("ring")


def local_qkv(rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s queries, keys and values [B, H, T/cp, hd] (any rank can make any rank's)."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(2, 2, 4, 8, generator=g) for _ in range(3)]


TOKENS = torch.tensor([[5, 0, 7, 8, 0, 9, 9, 9], [1, 2, 3, 0, 4, 0, 6, 7]])  # 0 ends a document


def cp_wraps_a_registered_core(rank: int) -> None:
    """One rank of test_context_parallelism_wraps_whatever_core_a_block_has."""
    ATTENTION_CORES["half_scale"] = HalfScale  # this spawned process only
    cp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    block = nn.Module()
    block.core = build_core("half_scale")
    apply_cp(block, cp_mesh)
    assert type(block.core) is ContextParallelCore and type(block.core.inner) is HalfScale

    q, k, v = (t.requires_grad_() for t in local_qkv(rank))
    weights = torch.linspace(-1, 1, 8)
    sequence = SequenceSplit(cp=2, rank=rank, eot_id=0)(TOKENS, TOKENS)[2]
    (block.core(q, k, v, sequence) * weights).sum().backward()

    # One process: the inner core over every rank's keys and values (gathered order: rank 0's, then rank 1's),
    # each rank's queries with their Sequence; the gradient of a rank's keys sums every rank's use of them.
    parts = [[t.requires_grad_() for t in local_qkv(r)] for r in range(2)]
    keys, values = (torch.cat([part[i] for part in parts], dim=2) for i in (1, 2))
    expected = []
    for r, (q_r, _, _) in enumerate(parts):
        out = HalfScale()(q_r, keys, values, SequenceSplit(cp=2, rank=r, eot_id=0)(TOKENS, TOKENS)[2])
        (out * weights).sum().backward(retain_graph=True)
        expected.append(out.detach())
    torch.testing.assert_close(block.core(q, k, v, sequence), expected[rank], rtol=0, atol=0)
    for mine, whole in zip((q, k, v), parts[rank]):
        torch.testing.assert_close(mine.grad, whole.grad, rtol=1e-6, atol=1e-7)

    # A family's blocks: every core wrapped, the state dict's names unchanged (cores hold no parameters).
    with torch.device("meta"):
        llama = build_model("llama3", "debug", 100, 64)
    names = list(llama.state_dict())
    apply_cp(llama, cp_mesh)
    assert list(llama.state_dict()) == names
    assert all(type(block.attention.core.inner) is SDPAttention for block in llama.layers.values())


@pytest.mark.distributed
def test_context_parallelism_wraps_whatever_core_a_block_has():
    """A block whose core is a test-only one, built by name: apply_cp wraps it, and on 2 gloo processes the
    inner core attends over the keys and values of both ranks (outputs equal to one process's, gradients
    summed into their owners); a family's blocks are wrapped likewise, their state dict unchanged."""
    run_ranks(cp_wraps_a_registered_core)
