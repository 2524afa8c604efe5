"""Checkpoint I/O: Hugging Face directories, loaded (safetensors first; .bin only with weights_only) and saved.

Parameter names are HF's, so a checkpoint maps onto a fastbert model by name alone: the only
translations are the base-model prefix (`bert.`), which BertFor* checkpoints carry and BertModel ones
don't, and the old TF-converted LayerNorm names (gamma / beta).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import pickle

import torch

from fastbert import quantization
from fastbert.config import BertConfig

logger = logging.getLogger("fastbert")

SAFETENSORS, PICKLE = "model.safetensors", "pytorch_model.bin"
SAFETENSORS_INDEX, PICKLE_INDEX = SAFETENSORS + ".index.json", PICKLE + ".index.json"  # sharded checkpoints
# Tensors a checkpoint may carry that no fastbert module owns and nobody needs to hear about.
_SILENT = ("embeddings.position_ids", "embeddings.token_type_ids")


def read_state_dict(directory: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors. Never unpickles arbitrary objects."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def load_safetensors(path):
        try:
            return load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupted?): {e}") from None

    def load_pickle(path):
        with open(path, "rb") as f:
            head = f.read(64)
        # torch.save writes a zip (PK), its legacy format a pickle (protocol opcode 0x80); anything else is
        # another file under the name (a git-lfs pointer, a saved web page), not code to refuse.
        if head and not head.startswith((b"PK\x03\x04", b"\x80")):
            lfs = " (a git-lfs pointer: fetch the file itself, git lfs pull)" if head.startswith(b"version https://git-lfs") else ""
            raise ValueError(f"{path} is not a PyTorch checkpoint{lfs}: it starts with {head[:32]!r}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # weights_only refuses anything but tensors and plain containers
            raise ValueError(f"{path} was refused: it holds more than tensors (fastbert never unpickles code): {e}") from None
        except (RuntimeError, OSError, EOFError) as e:
            raise ValueError(f"{path} is not a readable PyTorch file (truncated or corrupted?): "
                             f"{str(e) or type(e).__name__}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{path} must hold a dict of tensors")
        return state

    for single, index, load in ((SAFETENSORS, SAFETENSORS_INDEX, load_safetensors), (PICKLE, PICKLE_INDEX, load_pickle)):
        path = os.path.join(directory, single)
        if os.path.isfile(path):
            return load(path)
        path = os.path.join(directory, index)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    index = json.load(f)
            except ValueError as e:  # not JSON, or not UTF-8
                raise ValueError(f"{path} is not a shard index: not JSON ({e})") from None
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{path} has no weight_map (tensor name -> shard file name): not a shard index")
            shards = sorted(set(weight_map.values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(load(os.path.join(directory, shard)))
            return state
    raise FileNotFoundError(f"no weights in {directory}: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, {PICKLE} "
                            f"or {PICKLE_INDEX}")


def _canonical(key: str) -> str:
    if key.endswith("LayerNorm.gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith("LayerNorm.beta"):
        return key[: -len("beta")] + "bias"
    return key


def map_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str = "bert."):
    """Match checkpoint names to `model`'s: returns (mapped state, ignored checkpoint keys)."""
    expected = model.state_dict()
    mapped, ignored = {}, []
    for key, value in state.items():
        key = _canonical(key)
        for candidate in (key, key[len(prefix):] if key.startswith(prefix) else None, prefix + key):
            if candidate is not None and candidate in expected:
                mapped[candidate] = value
                break
        else:
            if not key.removeprefix(prefix) in _SILENT:
                ignored.append(key)
    return mapped, ignored


# transformers' config settings that BertConfig keeps in `extra`, and from_pretrained takes as overrides
_EXTRA_SETTINGS = ("id2label", "label2id", "output_hidden_states", "output_attentions", "return_dict")


def _config(cls, directory: str, config, overrides: dict) -> BertConfig:
    """The directory's config (or `config`: fastbert's or transformers' BertConfig) with `overrides`, keyword
    arguments of from_pretrained that are config settings (num_labels=3, ...), as transformers takes them."""
    if config is None:
        config = BertConfig.from_pretrained(directory)
    elif not isinstance(config, BertConfig):
        if not callable(getattr(config, "to_dict", None)):
            raise TypeError(f"config must be a fastbert or transformers BertConfig, got {type(config).__name__}")
        config = BertConfig.from_dict(config.to_dict())
    if not overrides:
        return config
    fields = {f.name for f in dataclasses.fields(BertConfig)} - {"extra"}
    unknown = sorted(k for k in overrides if k not in fields and k not in _EXTRA_SETTINGS)
    if unknown:
        why = " (fastbert runs its own attention kernels)" if "attn_implementation" in unknown else ""
        raise TypeError(f"{cls.__name__}.from_pretrained: {', '.join(unknown)} is neither an argument of "
                        f"{cls.__name__} nor a BertConfig setting{why}")
    settings = config.to_dict()
    if "num_labels" in overrides and "id2label" not in overrides:  # new classes: their old names go
        settings = {k: v for k, v in settings.items() if k not in ("id2label", "label2id")}
    elif "id2label" in overrides and "num_labels" not in overrides:
        settings["num_labels"] = len(overrides["id2label"])
    return BertConfig.from_dict({**settings, **overrides})


def _dtype(dtype, config: BertConfig, state: dict) -> torch.dtype | None:
    """from_pretrained's dtype: a torch.dtype, its name ("bfloat16"), or "auto" (the checkpoint's: config.json's
    dtype, else its weights'), also when not given, as in transformers 5."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        saved = config.extra.get("dtype") or config.extra.get("torch_dtype")
        if not isinstance(saved, str):
            return next((t.dtype for t in state.values() if t.is_floating_point()), None)
        dtype = saved
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(named, torch.dtype) or not named.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, its name ('bfloat16') or 'auto', got {dtype!r}")
    return named


def from_pretrained(cls, directory, dtype: torch.dtype | str | None = None, *, config=None, torch_dtype=None,
                    **kwargs):
    """`cls` with the weights of the HF directory; `dtype` (or its older name torch_dtype) as _dtype takes it;
    keyword arguments that `cls` does not take are config settings (num_labels=3), as in transformers."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is not a directory (fastbert loads local HF directories)")
    if torch_dtype is not None:
        if dtype is not None and str(dtype).removeprefix("torch.") != str(torch_dtype).removeprefix("torch."):
            raise ValueError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree (torch_dtype is dtype's older name)")
        dtype = torch_dtype
    takes = set(inspect.signature(cls.__init__).parameters) - {"self", "config"}
    config = _config(cls, directory, config, {k: v for k, v in kwargs.items() if k not in takes})
    model = cls(config, **{k: v for k, v in kwargs.items() if k in takes})
    quantized = config.extra.get("fastbert_quantization")
    if quantized:  # saved by a quantized model: its int8 weights and scales load as they were saved
        quantization.replace_linears(model, quantized["mode"])
        model.requires_grad_(False)  # as quantize() leaves it
    state = read_state_dict(directory)
    dtype = _dtype(dtype, config, state)
    mapped, ignored = map_state_dict(model, state)
    expected = model.state_dict()
    if quantized:
        mapped = quantization.loaded_form(mapped, expected)
    tied = model.tied_weights()  # aliases follow their source; HF checkpoints leave them out
    through_alias = {source for alias, source in tied.items() if alias in mapped}  # loaded under the other name
    missing = [k for k in expected if k not in mapped and k not in tied and k not in through_alias]
    # Checkpoints saved from heads without a pooler (e.g. BertForMaskedLM) are common: HF starts
    # that pooler fresh, and so does fastbert, saying so.
    fresh_pooler = [k for k in missing if k.removeprefix("bert.").startswith("pooler.")]
    # Likewise a task head (anything outside the encoder) missing from the checkpoint, e.g. a
    # classifier on a plain BertModel checkpoint: fresh, and named in a warning.
    prefix = model.base_model_prefix + "." if model.base_model_prefix else ""
    fresh_head = [k for k in missing if prefix and not k.startswith(prefix)]
    missing = [k for k in missing if k not in fresh_pooler and k not in fresh_head]
    misshaped = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(expected[k].shape)}"
                 for k, v in mapped.items() if v.shape != expected[k].shape]
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped))
    if problems:
        raise ValueError(f"cannot load {directory} into {cls.__name__}: " + " | ".join(problems))
    for target, source in tied.items():  # an alias stored with a value of its own stays apart, as in transformers
        if target in mapped and source in mapped and not torch.equal(mapped[target], mapped[source]):
            module, _, name = target.rpartition(".")
            setattr(model.get_submodule(module), name, torch.nn.Parameter(torch.empty_like(expected[target])))
            logger.warning("fastbert: %s holds %s and %s, tied in %s, with different values: they are not tied",
                           directory, source, target, cls.__name__)
    model.load_state_dict(mapped, strict=False)
    if ignored:
        logger.warning("fastbert: %s ignored %d checkpoint tensors it has no module for: %s",
                       cls.__name__, len(ignored), ", ".join(ignored))
    if fresh_head:
        logger.warning("fastbert: %s: %d tensors of the task head are not in %s and are freshly initialized "
                       "(train the model before using it): %s", cls.__name__, len(fresh_head), directory,
                       ", ".join(fresh_head))
    if fresh_pooler:
        logger.warning("fastbert: %s has no pooler weights; the pooler is freshly initialized "
                       "(pass add_pooling_layer=False to leave it out)", directory)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def save_pretrained(model: torch.nn.Module, directory) -> None:
    """config.json + model.safetensors, in the layout transformers reads."""
    from safetensors.torch import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    # The weights' dtype, not the one the config was read with (transformers loads by it: float32 weights
    # under a config saying bfloat16 would load rounded); torch_dtype is its earlier name.
    dtype = str(next(p.dtype for p in model.parameters() if p.is_floating_point())).removeprefix("torch.")
    names = ["dtype"] + (["torch_dtype"] if "torch_dtype" in model.config.extra else [])
    model.config.save_pretrained(directory, architectures=[type(model).__name__], **dict.fromkeys(names, dtype))
    # safetensors stores one name per storage: tied aliases are left out, as transformers does (it ties
    # them again on load).
    tied = model.tied_weights()
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in tied}
    if quantization.is_quantized(model):
        state = quantization.saved_form(state)
    save_file(state, os.path.join(directory, SAFETENSORS), metadata={"format": "pt"})
