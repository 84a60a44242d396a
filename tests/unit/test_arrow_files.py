"""Specification of Arrow text sources: folders written by `datasets`' save_to_disk (Dataset and DatasetDict)
and .arrow files in both IPC formats, read whole and in order, in record-batch spans that cover every batch once."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.feather as feather
import pytest

import titanlite.data.arrow_files as arrow_files
from titanlite.base.errors import ConfigError
from titanlite.data.arrow_files import arrow_batch_spans, arrow_texts, is_arrow_file, saved_dataset_files

datasets = pytest.importorskip("datasets")

LABEL = "training.dataset_split"
# 2,500 rows: save_to_disk writes record batches of at most 1,000 rows, so each file holds several.
TEXTS = [f"document {i}: ünïcödé €\nsecond line\n" if i % 7 else "" for i in range(2500)]


def read_all(path, field="text", piece_bytes=4096):
    """Every text of `path`, span by span, after checking that the spans cover its batches once, in order."""
    spans = arrow_batch_spans(str(path), piece_bytes)
    assert [start for start, _, _ in spans] == [0] + [stop for _, stop, _ in spans[:-1]]
    assert all(start < stop and nbytes > 0 for start, stop, nbytes in spans)
    return [text for start, stop, _ in spans for text in arrow_texts(str(path), start, stop, field)]


def single_line_naming(error: pytest.ExceptionInfo, path) -> str:
    message = str(error.value)
    assert "\n" not in message
    assert str(path) in message
    return message


# save_to_disk folders


def test_a_saved_dataset_lists_its_files_in_state_order_and_reads_whole(tmp_path):
    datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))}).save_to_disk(
        tmp_path / "saved", num_shards=3
    )
    files = saved_dataset_files(tmp_path / "saved", "train", LABEL)
    assert [f.name for f in files] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    assert all(is_arrow_file(f) for f in files)
    assert [text for f in files for text in read_all(f)] == TEXTS
    assert [text for f in files for text in read_all(f, piece_bytes=2**30)] == TEXTS

    state_path = tmp_path / "saved" / "state.json"
    state = json.loads(state_path.read_text())
    state["_data_files"].reverse()
    state_path.write_text(json.dumps(state))
    assert saved_dataset_files(tmp_path / "saved", "train", LABEL) == files[::-1]


def test_a_saved_dataset_has_batches_of_at_most_a_thousand_rows(tmp_path):
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "saved")
    [path] = saved_dataset_files(tmp_path / "saved", "train", LABEL)
    spans = arrow_batch_spans(str(path), 1)
    assert [(start, stop) for start, stop, _ in spans] == [(0, 1), (1, 2), (2, 3)]
    assert list(arrow_texts(str(path), 1, 2, "text")) == TEXTS[1000:2000]


def test_a_saved_dataset_dict_gives_the_chosen_split(tmp_path):
    splits = {"train": TEXTS[:2000], "validation": TEXTS[2000:]}
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": t}) for name, t in splits.items()}).save_to_disk(
        tmp_path / "saved"
    )
    for name, texts in splits.items():
        files = saved_dataset_files(tmp_path / "saved", name, LABEL)
        assert all(f.parent == tmp_path / "saved" / name for f in files)
        assert [text for f in files for text in read_all(f)] == texts
    with pytest.raises(ConfigError) as caught:
        saved_dataset_files(tmp_path / "saved", "test", LABEL)
    message = single_line_naming(caught, tmp_path / "saved")
    assert "no split 'test' (splits: train, validation); set training.dataset_split" in message


def test_the_text_may_live_in_another_column(tmp_path):
    datasets.Dataset.from_dict({"content": TEXTS, "id": list(range(len(TEXTS)))}).save_to_disk(tmp_path / "saved")
    [path] = saved_dataset_files(tmp_path / "saved", "train", LABEL)
    assert read_all(path, "content") == TEXTS
    with pytest.raises(ConfigError) as caught:
        list(arrow_texts(str(path), 0, 1, "text"))
    assert str(caught.value) == f"{path} has no 'text' column (columns: content, id); set training.dataset_text_field"


def test_other_folders_are_not_saved_datasets(tmp_path):
    assert saved_dataset_files(tmp_path, "train", LABEL) is None
    write_ipc(tmp_path / "loose.arrow", pa.table({"text": ["a"]}), "stream")
    assert saved_dataset_files(tmp_path, "train", LABEL) is None


def test_a_state_listing_a_missing_file_is_refused(tmp_path):
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "saved", num_shards=2)
    (tmp_path / "saved" / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(ConfigError) as caught:
        saved_dataset_files(tmp_path / "saved", "train", LABEL)
    assert "data-00001-of-00002.arrow, missing" in single_line_naming(caught, tmp_path / "saved" / "state.json")


def test_a_damaged_state_file_is_refused(tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(ConfigError) as caught:
        saved_dataset_files(tmp_path, "train", LABEL)
    assert "is not readable JSON" in single_line_naming(caught, tmp_path / "state.json")


# .arrow files written by pyarrow


def write_ipc(path, table, kind, max_chunksize=None):
    if kind == "feather":  # Feather v2: the IPC file format, lz4-compressed by default
        feather.write_feather(table, path, chunksize=max_chunksize)
        return
    new = pa.ipc.new_stream if kind == "stream" else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max_chunksize)


@pytest.mark.parametrize("kind", ["stream", "file", "feather"])
@pytest.mark.parametrize("text_type", [pa.string(), pa.large_string()])
def test_arrow_files_in_both_ipc_formats_read_in_order(tmp_path, kind, text_type):
    path = tmp_path / "corpus.arrow"
    table = pa.table({"id": list(range(len(TEXTS))), "text": pa.array(TEXTS, type=text_type)})
    write_ipc(path, table, kind, max_chunksize=300)
    spans = arrow_batch_spans(str(path), 8192)
    assert len(spans) > 1 and spans[-1][1] == 9  # ceil(2500 / 300) batches
    assert sum(nbytes for _, _, nbytes in spans) == pytest.approx(table.nbytes, rel=0.01)  # uncompressed sizes
    assert read_all(path) == TEXTS
    assert list(arrow_texts(str(path), 8, 20, "text")) == TEXTS[2400:]
    assert read_all(path, piece_bytes=2**30) == TEXTS


@pytest.mark.parametrize("kind", ["stream", "file"])
def test_only_the_text_column_is_read(tmp_path, monkeypatch, kind):
    path = tmp_path / "corpus.arrow"
    write_ipc(path, pa.table({"id": list(range(10)), "text": [str(i) for i in range(10)], "n": [1.0] * 10}), kind)
    widths = []
    original = arrow_files._batches

    def spy(reader, start, stop):
        for index, batch in original(reader, start, stop):
            widths.append(batch.num_columns)
            yield index, batch

    monkeypatch.setattr(arrow_files, "_batches", spy)
    assert list(arrow_texts(str(path), 0, 1, "text")) == [str(i) for i in range(10)]
    assert widths == [1]


def test_an_empty_arrow_stream_has_no_spans(tmp_path):
    path = tmp_path / "empty.arrow"
    write_ipc(path, pa.table({"text": pa.array([], type=pa.string())}), "stream")
    assert arrow_batch_spans(str(path), 1024) == []


@pytest.mark.parametrize(
    ("column", "found"),
    [
        (pa.array(list(range(600))), "int64 values in its 'text' column (record batch 0)"),
        (pa.array(["a"] * 450 + [None] + ["b"] * 149), "a null in its 'text' column (record batch 2)"),
    ],
)
def test_a_value_that_is_not_a_string_is_refused_naming_file_and_batch(tmp_path, column, found):
    path = tmp_path / "corpus.arrow"
    write_ipc(path, pa.table({"text": column}), "stream", max_chunksize=200)
    with pytest.raises(ConfigError) as caught:
        list(arrow_texts(str(path), 0, 3, "text"))
    assert found in single_line_naming(caught, path)


@pytest.mark.parametrize("data", [b"", b"not arrow data at all", b"ARROW1\0\0truncated"])
def test_a_file_that_is_not_arrow_is_refused(tmp_path, data):
    path = tmp_path / "broken.arrow"
    path.write_bytes(data)
    for read in (lambda: arrow_batch_spans(str(path), 1024), lambda: list(arrow_texts(str(path), 0, 1, "text"))):
        with pytest.raises(ConfigError) as caught:
            read()
        assert "is not a readable Arrow file" in single_line_naming(caught, path)


def test_a_truncated_stream_is_refused(tmp_path):
    path = tmp_path / "cut.arrow"
    write_ipc(path, pa.table({"text": TEXTS}), "stream", max_chunksize=500)
    path.write_bytes(path.read_bytes()[:-3000])
    with pytest.raises(ConfigError) as caught:
        arrow_batch_spans(str(path), 1024)
    assert "is not a readable Arrow file" in single_line_naming(caught, path)


def test_arrow_files_are_told_by_suffix(tmp_path):
    assert is_arrow_file("data/x.arrow") and is_arrow_file(tmp_path / "X.ARROW")
    assert not is_arrow_file("x.parquet") and not is_arrow_file("arrow")
