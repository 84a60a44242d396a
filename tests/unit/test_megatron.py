"""Specification of Megatron-LM indexed datasets (.bin + .idx) read in place: the layout written by hand per
megatron-core's _IndexWriter, each damaged index refused by name, and files made by megatron-core itself."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from titanlite.base.errors import ConfigError
from titanlite.data.indexed import documents_end_with, index_path_for, read_indexed_layout

EOT = 7
CODES = {"uint16": 8, "int32": 4}
# Documents as lists of sequences (preprocess_data.py --split-sentences makes one sequence per sentence);
# the third is empty, as preprocess_data.py leaves a document without text.
DOCUMENTS = [[[1, 2, 3, EOT]], [[4, 5], [6, EOT]], [], [[9, 10, 11], [12], [13, EOT]], [[300, EOT]]]


def write_indexed(folder, documents, dtype="uint16", *, code=None, version=1, magic=b"MMIDIDX\x00\x00", modes=False):
    """A .bin/.idx pair laid out as megatron-core's IndexedDatasetBuilder writes it; returns the .bin path."""
    dtype = np.dtype(dtype)
    lengths = np.array([len(s) for doc in documents for s in doc], dtype="<i4")
    pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * dtype.itemsize
    doc_index = np.cumsum([0] + [len(doc) for doc in documents], dtype=np.int64)
    ids = np.array([t for doc in documents for s in doc for t in s], dtype=dtype)
    code = CODES[dtype.name] if code is None else code
    header = struct.pack("<9sQBQQ", magic, version, code, len(lengths), len(doc_index))
    extra = np.zeros(len(lengths), dtype=np.int8).tobytes() if modes else b""
    (folder / "corpus.bin").write_bytes(ids.tobytes())
    arrays = lengths.tobytes() + pointers.astype("<i8").tobytes() + doc_index.astype("<i8").tobytes()
    (folder / "corpus.idx").write_bytes(header + arrays + extra)
    return str(folder / "corpus.bin")


def layout_of(bin_path):
    return read_indexed_layout(bin_path, os.path.getsize(bin_path))


def document_tokens(bin_path, layout):
    ids = np.memmap(bin_path, dtype=layout.dtype, mode="r", shape=(layout.count,))
    starts = [0, *layout.document_ends[:-1].tolist()]
    return [ids[a:b].tolist() for a, b in zip(starts, layout.document_ends.tolist())]


def flat(documents):
    return [[t for s in doc for t in s] for doc in documents]


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_layout_gives_types_counts_and_document_ends(tmp_path, dtype):
    bin_path = write_indexed(tmp_path, DOCUMENTS, dtype)
    layout = layout_of(bin_path)
    assert index_path_for(bin_path) == str(tmp_path / "corpus.idx")
    assert layout.dtype == np.dtype(dtype)
    assert (layout.count, layout.documents) == (16, 5)
    assert layout.document_ends.dtype == np.int64
    assert layout.document_ends.tolist() == [4, 8, 8, 14, 16]
    assert document_tokens(bin_path, layout) == flat(DOCUMENTS)
    assert documents_end_with(bin_path, layout, EOT)


def test_documents_end_with_tells_data_made_without_append_eod(tmp_path):
    documents = [[[1, 2, EOT]], [[3], [4]]]
    bin_path = write_indexed(tmp_path, documents)
    layout = layout_of(bin_path)
    assert not documents_end_with(bin_path, layout, EOT)
    assert not documents_end_with(bin_path, layout, 70000)  # an id the token type cannot hold


def test_checks_run_in_chunks_across_chunk_edges(tmp_path, monkeypatch):
    monkeypatch.setattr("titanlite.data.indexed.CHUNK", 3)
    bin_path = write_indexed(tmp_path, DOCUMENTS)
    layout = layout_of(bin_path)
    assert layout.document_ends.tolist() == [4, 8, 8, 14, 16]
    assert documents_end_with(bin_path, layout, EOT)
    patch_idx(tmp_path, 62 + 8 * 4, 99)  # sequence 4, in the second chunk: its offset depends on the first
    with pytest.raises(ConfigError, match="sequence 4 at a byte offset"):
        layout_of(bin_path)
    write_indexed(tmp_path, DOCUMENTS)
    patch_idx(tmp_path, 118 + 8 * 3, 2)  # document index 3, the first of the second chunk, falls below index 2
    with pytest.raises(ConfigError, match="document indices that do not rise"):
        layout_of(bin_path)


def test_index_path_needs_a_bin_with_an_idx_beside_it(tmp_path):
    (tmp_path / "alone.bin").write_bytes(b"\0\0")
    (tmp_path / "other.idx").write_bytes(b"")
    assert index_path_for(str(tmp_path / "alone.bin")) is None
    assert index_path_for(str(tmp_path / "other.npy")) is None
    with pytest.raises(ConfigError, match="alone.bin has no Megatron index"):
        read_indexed_layout(str(tmp_path / "alone.bin"), 2)


def keep_idx(folder, nbytes):
    idx = folder / "corpus.idx"
    idx.write_bytes(idx.read_bytes()[:nbytes])


def patch_idx(folder, offset, value):
    """Overwrite the int64 at `offset` of the .idx (DOCUMENTS: 7 sequences, so the byte offsets start at 62
    and the document indices, 0 1 3 3 6 7, at 118)."""
    idx = folder / "corpus.idx"
    data = bytearray(idx.read_bytes())
    data[offset : offset + 8] = struct.pack("<q", value)
    idx.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("options", "damage", "named", "reason"),
    [
        ({"magic": b"NOTMAGIC\x00"}, None, "idx", "does not start with Megatron's index magic"),
        ({"version": 2}, None, "idx", "index version 2, not 1"),
        ({"code": 7}, None, "idx", "holds float32 values, not token ids"),
        ({"code": 6}, None, "idx", "holds float64 values"),
        ({"code": 9}, None, "idx", "unknown dtype code 9"),
        ({"modes": True}, None, "idx", "multimodal index"),
        ({}, lambda p: keep_idx(p, 166 - 8), "idx", "truncated or damaged"),
        ({}, lambda p: keep_idx(p, 20), "idx", "truncated inside its header"),
        ({}, lambda p: patch_idx(p, 62 + 8, 3), "idx", "sequence 1 at a byte offset"),
        ({}, lambda p: patch_idx(p, 118 + 24, 2), "idx", "document indices that do not rise from 0 to its 7"),
        ({}, lambda p: patch_idx(p, 118 + 40, 6), "idx", "document indices that do not rise"),
        ({}, lambda p: (p / "corpus.bin").write_bytes(b"\0" * 28), "bin", "holds 28 bytes but its index lists 16"),
    ],
)
def test_a_damaged_pair_is_refused_naming_the_file(tmp_path, options, damage, named, reason):
    bin_path = write_indexed(tmp_path, DOCUMENTS, **options)
    if damage:
        damage(tmp_path)
    with pytest.raises(ConfigError) as caught:
        layout_of(bin_path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(str(tmp_path / f"corpus.{named}"))
    assert reason in message
    assert "preprocess_data.py" in message


def test_an_empty_dataset_is_refused(tmp_path):
    bin_path = write_indexed(tmp_path, [])
    with pytest.raises(ConfigError, match="corpus.bin holds no tokens"):
        layout_of(bin_path)


# Files made by megatron-core itself. Its package __init__ imports the whole training stack (triton among it),
# which a CPU-only torch lacks; the data module does not need it, so that import is bypassed when it fails.
MEGATRON_SCRIPT = """
import json, sys, types
import numpy, torch

def indexed_dataset():
    try:
        from megatron.core.datasets import indexed_dataset
        return indexed_dataset, "megatron.core imported"
    except ImportError as e:
        reason = f"megatron.core imported without its package __init__ ({type(e).__name__}: {e})"
    spec_path = __import__("importlib.util").util.find_spec("megatron").submodule_search_locations[0]
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        del sys.modules[name]
    for name, path in (("megatron", spec_path), ("megatron.core", spec_path + "/core")):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package
    import megatron.core.parallel_state  # before utils, which it and indexed_dataset import in a cycle
    from megatron.core.datasets import indexed_dataset
    return indexed_dataset, reason

module, how = indexed_dataset()
documents, made = json.loads(sys.argv[1]), {}
for prefix, name in zip(sys.argv[2::2], sys.argv[3::2]):  # one dataset per (prefix, dtype): one import for all
    builder = module.IndexedDatasetBuilder(prefix + ".bin", dtype=getattr(numpy, name))
    for i, doc in enumerate(documents):
        if i % 2:  # both ways of adding a document
            builder.add_document(torch.tensor([t for s in doc for t in s]), [len(s) for s in doc])
        else:
            for sequence in doc:
                builder.add_item(torch.tensor(sequence))
            builder.end_document()
    builder.finalize(prefix + ".idx")
    ds = module.IndexedDataset(prefix)
    docs = ds.document_indices.tolist()
    made[name] = [[t for j in range(docs[i], docs[i + 1]) for t in ds[j].tolist()] for i in range(len(docs) - 1)]
print(json.dumps({"how": how, "documents": made}))
"""
DTYPES = ["uint16", "int32"]


@pytest.fixture(scope="module")
def made_by_megatron(tmp_path_factory):
    """megatron-core's IndexedDatasetBuilder writes DOCUMENTS once per dtype, in one process (megatron-core's import
    is most of its time): the folder of each dtype's made.bin/.idx, and what megatron-core reads back from each."""
    if importlib.util.find_spec("megatron") is None:
        pytest.skip(
            "megatron-core is not importable: pip install megatron-core --no-deps --target DIR, set PYTHONPATH=DIR"
        )
    folders = {dtype: tmp_path_factory.mktemp(f"megatron_{dtype}") for dtype in DTYPES}
    pairs = [arg for dtype in DTYPES for arg in (str(folders[dtype] / "made"), dtype)]
    result = subprocess.run(
        [sys.executable, "-c", MEGATRON_SCRIPT, json.dumps(DOCUMENTS), *pairs],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"megatron-core could not build an indexed dataset here: {last}")
    view = json.loads(result.stdout.strip().splitlines()[-1])
    return {dtype: (folders[dtype], view["documents"][dtype]) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
def test_files_made_by_megatron_core_read_alike(tmp_path, dtype, made_by_megatron):
    folder, megatron_view = made_by_megatron[dtype]
    prefix = str(folder / "made")
    layout = layout_of(prefix + ".bin")
    assert layout.dtype == np.dtype(dtype)
    assert (layout.count, layout.documents) == (16, 5)
    assert document_tokens(prefix + ".bin", layout) == megatron_view == flat(DOCUMENTS)
    assert documents_end_with(prefix + ".bin", layout, EOT)
    write_indexed(tmp_path, DOCUMENTS, dtype)  # the hand-written layout above is megatron-core's, byte for byte
    for suffix in (".bin", ".idx"):
        assert (folder / f"made{suffix}").read_bytes() == (tmp_path / f"corpus{suffix}").read_bytes()
