"""Ray Data: embed a dataset's text column with fastbert when one machine is not enough. `Embedder` is a
callable class for `Dataset.map_batches`: Ray builds one per actor, so each loads the model once.

    import ray
    from fastbert.integrations.ray import Embedder

    ds = ray.data.read_parquet("s3://bucket/corpus/")
    ds = ds.map_batches(Embedder, fn_constructor_kwargs={"model": "/models/all-MiniLM-L6-v2", "column": "text"},
                        batch_size=4096, concurrency=8, num_cpus=2)
    ds.write_parquet("s3://bucket/embeddings/")

Needs `pip install "ray[data]"`; fastbert itself never imports ray.
"""
from __future__ import annotations

import numpy as np
import torch


class Embedder:
    """Adds `output_column` (float32 [rows, hidden]) to each batch: fastbert.encode of `column`. The model
    is an HF BERT directory every worker can read; dtype "fp32", "bf16" or "int8" (None: as saved, fp32 or
    int8); `threads` sets torch's
    intra-op threads per actor (default: torch's choice, which Ray's num_cpus bounds)."""

    def __init__(self, model: str, column: str = "text", output_column: str = "embedding", dtype: str | None = None,
                 pooling: str | None = None, normalize: bool | None = None, batch_tokens: int = 16384,
                 max_length: int | None = None, truncate: bool = True, threads: int | None = None):
        from fastbert.encode import default_max_length, load, recipe_of

        if pooling == "none":
            raise ValueError("pooling 'none' gives one array per text; Embedder adds pooled embeddings")
        if threads:
            torch.set_num_threads(threads)
        self.recipe = recipe_of(model, pooling, normalize)  # a sentence-transformers directory's, as fastbert.encode
        self.model, self.tokenizer = load(model, dtype)
        self.max_length = max_length if max_length is not None else default_max_length(self.model, self.tokenizer, model)
        self.column, self.output_column = column, output_column
        self.batch_tokens, self.truncate = batch_tokens, truncate

    def __call__(self, batch):
        """`batch`: a dict of columns (map_batches' default), a pandas DataFrame or a pyarrow Table
        (batch_format="pandas" / "pyarrow"); returned with the embeddings added, a Table as a Table."""
        from fastbert.encode import encode_windows

        table = hasattr(batch, "column_names")  # a pyarrow Table: `in` and iteration see its columns' values
        names = batch.column_names if table else list(batch)
        if self.column not in names:
            raise KeyError(f"the batch has no column {self.column!r} (columns: {', '.join(map(str, names))})")
        texts = batch.column(self.column).to_pylist() if table else list(batch[self.column])
        for row, t in enumerate(texts):
            if not isinstance(t, str):  # a null is not the text "None"
                raise TypeError(f"row {row} of column {self.column!r} is {type(t).__name__}, not a string")
        texts = [str(t) for t in texts]  # numpy's str_ as str
        windows = encode_windows(self.model, texts, self.tokenizer, self.recipe, self.batch_tokens, self.max_length,
                                 self.truncate, window=max(len(texts), 1))
        embeddings = [e.numpy() for _, e in windows]  # one window (none for an empty batch)
        width = self.recipe.width(self.model.config.hidden_size)
        embeddings = np.concatenate(embeddings, dtype=np.float32) if embeddings else np.empty((0, width), np.float32)
        if table:
            import pyarrow as pa

            return batch.append_column(self.output_column,
                                       pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), width))
        return {**batch, self.output_column: embeddings}
