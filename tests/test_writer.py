"""Log files as written: which columns Parquet dictionary-encodes (writer.dictionary_columns)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import nbcc


def _encodings(path: str) -> dict[str, set[str]]:
    md = pq.ParquetFile(path).metadata
    out: dict[str, set[str]] = {}
    for rg in range(md.num_row_groups):
        for c in range(md.num_columns):
            col = md.row_group(rg).column(c)
            out.setdefault(col.path_in_schema, set()).update(col.encodings)
    return out


def test_log_files_dictionary_encode_repetitive_columns_only(tmp_path):
    n = 50_000
    ids = np.arange(n, dtype=np.int64)
    data = pa.table({
        "id": ids,  # unique
        "amount": np.random.default_rng(0).random(n),  # unique
        "region": pa.array(np.array(["eu", "us", "apac"])[ids % 3]),  # 3 values
        "score": ids % 10,  # 10 values
        "ts": np.ones(n, dtype=np.int64),
    })
    table = nbcc.Table.create(str(tmp_path / "t"), data.schema, "id", ordering_field="ts", buckets=1)
    table.write(data)
    [log] = [s.log_files[0] for s in table.file_slices()]
    enc = _encodings(str(tmp_path / "t" / log))
    dictionary = {name for name, e in enc.items() if "RLE_DICTIONARY" in e or "PLAIN_DICTIONARY" in e}
    assert {"region", "score", "ts", "_nbcc_commit_time"} <= dictionary
    assert not {"id", "amount", "_nbcc_record_key"} & dictionary
    assert table.read().sort_by("id").to_pydict() == data.to_pydict()
