"""Prepared weights: forms of a module's weights that kernels make once and reuse (the stacked QKV
weight, oneDNN's blocked layout), owned by the module whose parameters they come from.

Nothing here is keyed by `id()` or an address: an entry keeps an alias of each tensor it was made
from, so that storage stays alive and no other tensor can take its place at the same address, and is
served only while every source still has that storage, strides and version (an optimizer step, fused
ones too (a hook below), `load_state_dict` and in-place writes bump the version; `.to()`, `.data =` and `assign=True` replace
the storage). Writes through `.data` (`p.data.copy_(...)`) bypass the version counter: whoever writes
so calls `clear()` (fastbert models: `model.clear_prepared_weights()`). A deepcopy or a pickle of the
owner starts empty, and `state_dict` never sees it. Under torch.compile and torch.func transforms nothing
is kept: the form is made from the real parameters on every call.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_PLAIN = (torch.Tensor, torch.nn.Parameter)


@torch._dynamo.disable  # a compiled step too: run eagerly after it, not traced into it
def _step_moves_versions(optimizer, args, kwargs) -> None:
    """After every optimizer step, the version of each parameter it stepped (one with a gradient) moves.
    torch's fused optimizers (fused=True, transformers' Trainer default) write parameters without moving it:
    forms made from the old values would be served on. Moving it twice (the other optimizers move it
    themselves) changes nothing else; a parameter without a gradient is left alone (a frozen one may be
    saved for a backward still to come)."""
    for group in optimizer.param_groups:
        stepped = [p for p in group["params"] if p.grad is not None]
        if stepped:
            torch.autograd.graph.increment_version(stepped)


register_optimizer_step_post_hook(_step_moves_versions)


_WARNED = [False]  # _warn_inference_weights has spoken in this process


def _warn_inference_weights() -> None:
    """Once a process: weights that are inference tensors are re-prepared at every call, which a user would
    otherwise only see as a slow model."""
    if _WARNED[0]:
        return
    _WARNED[0] = True
    warnings.warn("fastbert: the model's weights are inference tensors (the model was made, loaded, copied or "
                  "converted with .to() inside torch.inference_mode()). They carry no version counter, so a change "
                  "could not be told and fastbert re-prepares them (packs, stacks) at every call and runs its "
                  "layers op by op: MiniLM at one query ran 4x slower so. Make and convert the model outside "
                  "torch.inference_mode() and run only its forward inside.", UserWarning, stacklevel=4)


class PreparedWeights:
    """name -> (the sources' aliases, their stamps, the prepared value)."""

    def __init__(self):
        self._entries: dict[str, tuple[tuple, object]] = {}

    def get(self, name: str, sources: tuple[torch.Tensor, ...], make: Callable):
        """`make(*sources)`, remembered under `name` while the sources are unchanged."""
        if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
            return make(*sources)
        # Each source's stamp: what must be unchanged for the value to still be its: storage (the entry's
        # alias keeps that address from being reused), version, dtype, device, shape and strides. One loop,
        # no generators: a batch of one asks a few times per layer.
        stamps = []
        for s in sources:
            if type(s) not in _PLAIN or s.is_inference():
                if s.is_inference():
                    _warn_inference_weights()
                return make(*sources)  # inference tensors carry no version: nothing could tell a change
            stamps.append((s.data_ptr(), s._version, s.dtype, s.device, s.shape, s.stride()))
        stamps = tuple(stamps)
        hit = self._entries.get(name)
        if hit is not None and hit[1] == stamps:
            return hit[2]
        # Made outside inference mode so the value is an ordinary tensor (with a version) in any mode. The
        # stamps were taken first: a source written while `make` runs leaves an entry that never matches.
        with torch.inference_mode(False), torch.no_grad():
            aliases = tuple(s.detach() for s in sources)
            value = make(*sources)
        self._entries[name] = (aliases, stamps, value)  # one dict store: atomic under the GIL
        return value

    def clear(self) -> None:
        self._entries.clear()

    def snapshot(self) -> dict:
        return dict(self._entries)

    def restore(self, snapshot: dict) -> None:
        """Back to `snapshot`: what was made since is dropped (a variant's trial packing, tuning.py)."""
        self._entries = dict(snapshot)

    def __len__(self) -> int:
        return len(self._entries)

    def __deepcopy__(self, memo):
        return PreparedWeights()  # the copy's weights are other tensors: nothing of ours applies to them

    def __reduce__(self):
        return (PreparedWeights, ())

    def __repr__(self) -> str:
        return f"PreparedWeights({', '.join(self._entries)})"
