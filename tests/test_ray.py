"""fastbert.integrations.ray on a local Ray instance: a parquet dataset embedded by map_batches equals
fastbert.encode on the same texts."""
from pathlib import Path

import numpy as np
import pytest
import torch

import fastbert
from fastbert.apps.demo import minilm_dir
from fastbert.testing import assert_matches

ray = pytest.importorskip("ray")
SENTENCES = [line for line in (Path(__file__).parent / "data" / "sentences.txt").read_text("utf-8").split("\n") if line]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_map_batches_equals_encode(local_ray, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastbert.integrations.ray import Embedder

    texts = SENTENCES[:120]
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), tmp_path / "corpus.parquet")
    ds = ray.data.read_parquet(str(tmp_path / "corpus.parquet")).repartition(4)  # blocks for both actors
    ds = ds.map_batches(Embedder, fn_constructor_kwargs={"model": minilm_dir(), "column": "text", "threads": 1},
                        batch_size=32, concurrency=2, num_cpus=0.5)  # two actors on one CPU: the other reads
    rows = sorted(ds.take_all(), key=lambda r: r["id"])
    assert [r["text"] for r in rows] == texts  # every text once, its id and text kept
    got = torch.from_numpy(np.stack([r["embedding"] for r in rows]))
    assert got.shape == (len(texts), 384)
    assert_matches(got, fastbert.encode(minilm_dir(), texts), name="embeddings")


def test_missing_column_is_named():
    from fastbert.integrations.ray import Embedder

    embed = Embedder(minilm_dir(), column="body")
    with pytest.raises(KeyError, match="no column 'body'"):
        embed({"text": np.array(["a"])})


def test_a_null_or_a_number_is_not_embedded_as_its_name():
    from fastbert.integrations.ray import Embedder

    embed = Embedder(minilm_dir())
    with pytest.raises(TypeError, match="row 1 of column 'text' is NoneType, not a string"):
        embed({"text": np.array(["a", None], dtype=object)})
    with pytest.raises(TypeError, match="row 0 of column 'text' is float, not a string"):
        embed({"text": np.array([float("nan")], dtype=object)})


def test_a_pyarrow_batch_is_embedded_and_returned_as_a_table():
    """map_batches(..., batch_format="pyarrow") hands a Table: `in` and iteration see its columns' values,
    which took the column for missing (and then failed to name the columns)."""
    import pyarrow as pa

    from fastbert.integrations.ray import Embedder

    texts = SENTENCES[:5] + [""]
    out = Embedder(minilm_dir())(pa.table({"id": list(range(len(texts))), "text": texts}))
    assert isinstance(out, pa.Table) and out.column_names == ["id", "text", "embedding"]
    got = torch.from_numpy(np.stack(out["embedding"].to_numpy(zero_copy_only=False)))
    assert_matches(got, fastbert.encode(minilm_dir(), texts), name="embeddings")
    with pytest.raises(KeyError, match="no column 'body' \\(columns: text\\)"):
        Embedder(minilm_dir(), column="body")(pa.table({"text": texts}))
