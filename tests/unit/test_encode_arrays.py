"""`prepare` encodes through Tokenizer.encode_batch_arrays (ids straight into arrays); it must give exactly
the ids of encode_batch, which the rest of titanlite and the raw tiktoken baseline use."""

from __future__ import annotations

import numpy as np
import pytest

from titanlite.data.store import encode_documents
from titanlite.data.tokenizer import ByteTokenizer, GPT2Tokenizer

TEXTS = ["Hello world", "", "a <|endoftext|> b", "lone \ud800 surrogate", "héllo 世界\n\n  spaced  ", "x" * 5000]


@pytest.mark.parametrize("tokenizer", [GPT2Tokenizer(), ByteTokenizer()], ids=["gpt2", "byte"])
def test_arrays_hold_the_ids_of_encode_batch(tokenizer):
    arrays = tokenizer.encode_batch_arrays(TEXTS)
    assert [a.dtype for a in arrays] == [np.dtype(np.uint32)] * len(TEXTS)
    assert [a.tolist() for a in arrays] == tokenizer.encode_batch(TEXTS)


@pytest.mark.parametrize("dtype", ["<u2", "<u4"])
def test_encode_documents_appends_end_of_text_only_where_a_document_ends(dtype):
    tok = GPT2Tokenizer()
    batch = [(text, i % 2 == 0) for i, text in enumerate(TEXTS)]
    expected = [i for text, ends in batch for i in [*tok.encode(text), *([tok.eot_id] if ends else [])]]
    ids = encode_documents(tok, batch, dtype)
    assert ids.dtype == np.dtype(dtype) and ids.tolist() == expected
