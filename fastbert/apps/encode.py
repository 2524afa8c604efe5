"""`python -m fastbert encode`: embed a text file (.txt one text a line, .jsonl, .parquet) into .npy or
.parquet. Embeddings are written in shards (OUT.parts/) as the run goes; a run that stops resumes after
its last complete shard, and its result equals an uninterrupted run's (each shard is one of
fastbert.encode's windows, batched the same way on every run)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import sys
import time
from typing import Iterator

import numpy as np

from fastbert.apps import InputError
from fastbert.apps.files import replace_durably, sha256


def read_texts(path: str, field: str | None = None, column: str | None = None) -> Iterator[str]:
    """The texts of `path`, in order: .txt one a line (empty lines are empty texts), .jsonl the string in
    `field` of each line, .parquet the string column `column`. What can be checked without reading a text
    (the file, its kind, the field or column asked for) is checked here, before anything is written."""
    ext = os.path.splitext(path)[1].lower()
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    if ext not in (".txt", ".jsonl", ".parquet"):
        raise InputError(f"{path}: the input must be .txt, .jsonl or .parquet")
    if (ext == ".jsonl") != (field is not None):
        raise InputError("a .jsonl input needs --field" if ext == ".jsonl" else "--field is for .jsonl inputs")
    if (ext == ".parquet") != (column is not None):
        raise InputError("a .parquet input needs --column" if ext == ".parquet" else "--column is for .parquet inputs")
    if ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            f = pq.ParquetFile(path)
        except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid, ArrowIOError: not parquet, or damaged
            raise InputError(f"{path}: not a readable parquet file ({e})") from None
        if column not in f.schema_arrow.names:
            raise InputError(f"{path} has no column {column!r} (columns: {', '.join(f.schema_arrow.names)})")
        return _parquet_texts(path, f, column)
    return _line_texts(path, field)


def _parquet_texts(path, f, column) -> Iterator[str]:
    row = 0
    for batch in f.iter_batches(columns=[column]):
        for value in batch.column(0).to_pylist():
            row += 1
            if not isinstance(value, str):
                raise InputError(f"{path} row {row}: column {column!r} is {type(value).__name__}, not a string")
            yield value


def _line_texts(path, field) -> Iterator[str]:
    """.txt lines, or (field given) .jsonl records' `field`. Blank lines closing a .jsonl file are no
    records (editors and `cat` leave them); one between records is named (its text would shift every later
    line's embedding by one). Lines end at \n (a \r inside a line is the text's, as `wc -l` counts); a file
    whose lines end in \r alone (old Mac) is refused, not taken as one text."""
    blank = None  # the first of the blank .jsonl lines read since the last record
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and not raw.endswith(b"\n") and b"\r" in raw.rstrip(b"\r"):
                raise InputError(f"{path} line 1: the file's lines end in a carriage return (\\r) alone, which "
                                 "would make the whole file one text: end them in \\n (tr '\\r' '\\n')")
            raw = raw.rstrip(b"\n").rstrip(b"\r")
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark is not text
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{path} line {number}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if field is None:
                yield line
                continue
            if not line.strip():
                blank = blank or number
                continue
            if blank is not None:
                raise InputError(f"{path} line {blank}: blank (a .jsonl line holds one record)")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path} line {number}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise InputError(f"{path} line {number}: no field {field!r}")
            text = record[field]
            if not isinstance(text, str):
                raise InputError(f"{path} line {number}: field {field!r} is {type(text).__name__}, not a string")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON's "\ud800" decodes to a lone surrogate
                raise InputError(f"{path} line {number}: field {field!r} is not valid Unicode ({e.reason} at "
                                 f"character {e.start})") from None
            yield text


def _files(directory: str, output: str) -> dict:
    """{path: _fingerprint} of the files under `directory` (hidden ones and this run's output aside): a
    model saved again in place, under the same name, is another model. Paths compare resolved: the model or
    the output may be named through a symlink."""
    files, own = {}, {os.path.realpath(p) for p in (output, output + ".tmp", output + ".parts")}
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and os.path.realpath(os.path.join(root, d)) not in own)
        for name in sorted(n for n in names if not n.startswith(".")):
            path = os.path.join(root, name)
            if os.path.realpath(path) not in own:
                files[os.path.relpath(path, directory)] = _fingerprint(path)
    return files


def _fingerprint(path: str) -> list:
    """[bytes, mtime_ns, sha256]: a file replaced by another of its size and mtime (cp -p, rsync -a) is
    another file, wherever they differ. The whole file is read (~1.5 GB/s: seconds for a corpus that takes
    hours to embed)."""
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns, sha256(path)]


def _manifest(args, input_path, model_dir, output) -> dict:
    size, mtime, digest = _fingerprint(input_path)
    return {"input": os.path.realpath(input_path), "input_bytes": size, "input_mtime_ns": mtime,
            "input_sha256": digest,
            "model": os.path.realpath(model_dir), "model_files": _files(model_dir, output), "dtype": args["dtype"],
            "recipe": args["recipe"], "max_length": args["max_length"],
            "truncate": args["truncate"], "batch_tokens": args["batch_tokens"], "shard_texts": args["shard_texts"],
            "field": args["field"], "column": args["column"]}


def _resumable(previous: dict, manifest: dict) -> list[str]:
    """The settings that keep `previous`'s shards from being part of this run (none: resume)."""
    from fastbert.encode import Recipe

    if isinstance(previous.get("recipe"), dict):  # written before a field existed: it ran as that field's default
        previous = {**previous, "recipe": {**dataclasses.asdict(Recipe()), **previous["recipe"]}}
    changed = sorted(k for k in manifest if previous.get(k) != manifest[k])
    if changed == ["truncate"] and manifest["truncate"]:
        return []  # the shards so far hold no text over max_length (the run would have stopped): truncation changes none
    return changed


SHARD = re.compile(r"\d{6}\.npy(\.tmp)?")


def _whole_shards(parts: str, shard_texts: int, width: int) -> int:
    """How many shards, from 000000 on, are whole: float32 [shard_texts, width], the last one possibly fewer
    rows (the input's end). A shard the disk lost part of (a crash after its rename) ends the count, named."""
    done = 0
    while os.path.exists(path := os.path.join(parts, f"{done:06d}.npy")):
        try:
            shard = np.load(path, mmap_mode="r")  # reads the header, maps the rows: checks the file's size
            shape, dtype = shard.shape, shard.dtype
            del shard
        except (ValueError, EOFError, OSError):  # an empty file, a header or data cut short
            shape, dtype = None, None
        if dtype != np.float32 or len(shape) != 2 or shape[1] != width or not 0 < shape[0] <= shard_texts:
            print(f"{path} is damaged: encoding again from there", file=sys.stderr)
            break
        done += 1
        if shape[0] < shard_texts:
            break  # the input's last shard: what follows is no part of this run
    return done


def _shard_files(parts: str) -> list[str]:
    return [name for name in os.listdir(parts) if SHARD.fullmatch(name)]


def _drop_shards_from(parts: str, first: int) -> None:
    """Remove shard files numbered `first` and up, and unfinished ones: what a resumed run does not keep
    (a damaged shard and what follows it, another run's leftovers past a gap) is never taken for its own."""
    for name in _shard_files(parts):
        if name.endswith(".tmp") or int(name[:6]) >= first:
            os.remove(os.path.join(parts, name))


def _assemble(parts: str, count: int, out: str, width: int) -> int:
    """The shards ([texts, width] each), in order, into `out` (.npy or .parquet, written under a temporary
    name first)."""
    shards = [os.path.join(parts, f"{i:06d}.npy") for i in range(count)]
    rows = sum(np.load(s, mmap_mode="r").shape[0] for s in shards)
    tmp = out + ".tmp"
    if out.endswith(".npy"):
        array = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(rows, width))
        at = 0
        for s in shards:
            block = np.load(s)
            array[at:at + len(block)] = block
            at += len(block)
        array.flush()
        del array
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("embedding", pa.list_(pa.float32(), width))])
        with pq.ParquetWriter(tmp, schema) as writer:
            for s in shards:
                block = np.load(s)
                values = pa.FixedSizeListArray.from_arrays(pa.array(block.reshape(-1)), width)
                writer.write_table(pa.table({"embedding": values}, schema=schema))
    replace_durably(tmp, out)  # before the shards go
    return rows


def run(model_dir: str, input_path: str, output: str, dtype: str | None = None, batch_tokens: int = 16384,
        field: str | None = None, column: str | None = None, pooling: str | None = None, normalize: bool | None = None,
        max_length: int | None = None, truncate: bool = False, shard_texts: int = 4096, restart: bool = False,
        progress: bool = True) -> int:
    """Embed every text of `input_path` into `output`; returns the number of texts. dtype None: as saved (fp32,
    or int8 for a directory saved quantized), as fastbert.encode.load takes it."""
    from fastbert.encode import TextTooLong, default_max_length, encode_windows, load, recipe_of
    from fastbert.quantization import is_quantized

    if not output.endswith((".npy", ".parquet")):
        raise InputError(f"--output must end in .npy or .parquet, got {output}")
    if os.path.realpath(output) == os.path.realpath(input_path):
        raise InputError(f"--output {output} is the input: the embeddings would replace the texts")
    if pooling == "none":
        raise InputError("pooling 'none' gives one array per text: the encode command writes pooled embeddings")
    if not os.path.isdir(model_dir):
        raise InputError(f"--model {model_dir}: not a directory")
    for name, value, least in (("--batch-tokens", batch_tokens, 1), ("--shard-texts", shard_texts, 1),
                               ("--max-length", max_length, 2)):  # [CLS] and [SEP] at the least
        if value is not None and value < least:
            raise InputError(f"{name} must be at least {least}, got {value}")
    texts = read_texts(input_path, field, column)
    try:
        how = recipe_of(model_dir, pooling, normalize)
        model, tokenizer = load(model_dir, dtype)
    except (ValueError, OSError) as e:  # OSError: a file the model directory lacks (config.json, weights)
        raise InputError(str(e)) from None
    dtype = dtype or ("int8" if is_quantized(model) else "fp32")  # (a resume names it or not: the same run)
    limit = model.config.max_position_embeddings
    if max_length is None:
        max_length = default_max_length(model, tokenizer, model_dir)
    elif max_length > limit:
        raise InputError(f"--max-length {max_length} is over the model's {limit} positions (max_position_embeddings)")
    settings = dict(dtype=dtype, recipe=dataclasses.asdict(how), max_length=max_length, truncate=truncate,
                    batch_tokens=batch_tokens, shard_texts=shard_texts, field=field, column=column)
    manifest = _manifest(settings, input_path, model_dir, output)
    parts = output + ".parts"
    if restart and os.path.isdir(parts):
        shutil.rmtree(parts)
    os.makedirs(parts, exist_ok=True)
    manifest_path = os.path.join(parts, "manifest.json")
    width = how.width(model.config.hidden_size)
    done = _whole_shards(parts, shard_texts, width)
    if any(not name.endswith(".tmp") for name in _shard_files(parts)):  # whole or not, another run's are refused
        previous = {}
        if os.path.exists(manifest_path):
            with open(manifest_path) as f:
                previous = json.load(f)
        changed = _resumable(previous, manifest)
        if changed:
            raise InputError(f"{parts} holds a run with other settings or input ({', '.join(changed)}): "
                             "pass --restart to start over")
    _drop_shards_from(parts, done)
    with open(manifest_path + ".tmp", "w") as f:  # a run without shards has nothing to keep: this one's settings
        json.dump(manifest, f, indent=1)
    replace_durably(manifest_path + ".tmp", manifest_path)
    if done:
        print(f"resuming after {done} complete shards ({done * shard_texts} texts) in {parts}", file=sys.stderr)
    texts = itertools.islice(texts, done * shard_texts, None)

    bar, counts, started = None, [0, 0], time.perf_counter()
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="encoding", unit=" texts", file=sys.stderr, dynamic_ncols=True, initial=done * shard_texts)

    def on_batch(n_texts, n_tokens):
        counts[0] += n_texts
        counts[1] += n_tokens
        if bar is not None:
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.update(n_texts)
            bar.set_postfix_str(f"{counts[0] / elapsed:.0f} texts/s, {counts[1] / elapsed:.0f} tokens/s")

    shard = done
    try:
        for _, embeddings in encode_windows(model, texts, tokenizer, how, batch_tokens, max_length,
                                            truncate, shard_texts, on_batch):
            path = os.path.join(parts, f"{shard:06d}.npy")
            with open(path + ".tmp", "wb") as f:
                np.save(f, embeddings.numpy())
            replace_durably(path + ".tmp", path)  # a shard exists whole or not at all
            shard += 1
    except TextTooLong as e:  # text k of the input is its line (or row) k + 1
        where = "row" if input_path.endswith(".parquet") else "line"
        raise InputError(f"{input_path} {where} {e.index + done * shard_texts + 1}: {e.tokens} tokens, over max_length "
                         f"{e.max_length} (--truncate cuts it, --max-length sets it)") from None
    finally:
        if bar is not None:
            bar.close()
    rows = _assemble(parts, shard, output, width)
    shutil.rmtree(parts)
    elapsed = time.perf_counter() - started
    print(f"{rows} texts -> {output} ({counts[0] / max(elapsed, 1e-9):.0f} texts/s, "
          f"{counts[1] / max(elapsed, 1e-9):.0f} tokens/s this run)", file=sys.stderr)
    return rows
