"""Run a model's forward in a higher precision without a second copy of the model.

The logit check's spread (`reference.logits_spread`) needs the forward in float32 (of a bf16 model)
or float64 (of a float32 one); a `deepcopy(lm).to(high)` would hold a second, wider model (E2B: ~19 GB
more on a 16 GiB inf2.xlarge). Here each module's parameters and buffers are cast when the forward
reaches it and put back when it leaves (forward hooks), so one module is wide at a time and the two
large ones never whole: an `nn.Embedding` widens only the rows looked up, a large `nn.Linear` (the
tied LM head) runs in blocks of output rows (the same dot products; `tests/test_serving_host.py`
checks equality with the deep copy at real width).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Output rows of a widened LM-head block: 16,384 x hidden 5,376 x 4 bytes = 352 MB for the 31B.
LINEAR_BLOCK_ROWS = 16384


def _float(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.is_floating_point()


def widest_module_bytes(lm: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the largest set of own parameters and buffers one module widens to `dtype` at a
    time (embeddings and blocked linears excluded: they never widen whole): the working set of
    `upcast_forward` besides the activations, for the memory plan."""
    size = torch.finfo(dtype).bits // 8
    widest = 0
    for module in lm.modules():
        if isinstance(module, nn.Embedding) or _blocked(module):
            continue
        own = [t for t in (*module._parameters.values(), *module._buffers.values()) if _float(t)]
        widest = max(widest, sum(t.numel() for t in own) * size)
    return widest


def _blocked(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.out_features > LINEAR_BLOCK_ROWS


class _Widener:
    """Swaps one module's own floating tensors for wide copies, and back."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.saved: dict[int, list[tuple[str, str, torch.Tensor]]] = {}

    def widen(self, module: nn.Module, _args=None) -> tuple | None:
        """Pre-hook: the module's own tensors wide, and its narrower floating inputs too (a module
        that casts its input to its weight's dtype before the weight's own hook ran, as Gemma-4's
        vision patch embedder does, would otherwise hand a float32 input to a float64 weight)."""
        saved = []
        for name, param in module._parameters.items():
            if _float(param) and param.dtype != self.dtype:
                saved.append(("p", name, param.data))
                param.data = param.data.to(self.dtype)
        for name, buf in module._buffers.items():
            if _float(buf) and buf.dtype != self.dtype:
                saved.append(("b", name, buf))
                module._buffers[name] = buf.to(self.dtype)
        self.saved[id(module)] = saved
        if not _args:
            return None
        wide = tuple(
            a.to(self.dtype) if isinstance(a, torch.Tensor) and _float(a) and a.dtype != self.dtype else a
            for a in _args
        )
        return wide if any(w is not a for w, a in zip(wide, _args, strict=True)) else None

    def restore(self, module: nn.Module, _args=None, _out=None) -> None:
        for kind, name, original in self.saved.pop(id(module), []):
            if kind == "p":
                module._parameters[name].data = original
            else:
                module._buffers[name] = original

    def embed(self, module: nn.Embedding, args: tuple) -> tuple:
        """Pre-hook of an embedding: a wide table of the looked-up rows only, ids remapped to it."""
        (ids, *rest) = args
        rows, remapped = torch.unique(ids, return_inverse=True)
        saved = [("p", "weight", module.weight.data)]
        padding = module.padding_idx
        if padding is not None:  # keep the padding row addressable in the compact table
            rows = torch.cat([rows, rows.new_tensor([padding])])
            saved.append(("padding", "", torch.tensor(padding)))
            module.padding_idx = rows.numel() - 1
        module.weight.data = module.weight.data[rows].to(self.dtype)
        self.saved[id(module)] = saved
        return (remapped, *rest)

    def unembed(self, module: nn.Embedding, _args=None, _out=None) -> None:
        for kind, _name, original in self.saved.pop(id(module), []):
            if kind == "p":
                module.weight.data = original
            else:
                module.padding_idx = int(original)

    def blocked_linear(self, module: nn.Linear):
        """A forward for `module` that widens `LINEAR_BLOCK_ROWS` output rows at a time."""

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight, bias = module.weight, module.bias
            out = []
            for start in range(0, weight.shape[0], LINEAR_BLOCK_ROWS):
                rows = slice(start, start + LINEAR_BLOCK_ROWS)
                b = None if bias is None else bias[rows].to(self.dtype)
                out.append(F.linear(x, weight[rows].to(self.dtype), b))
            return torch.cat(out, dim=-1)

        return forward


@contextlib.contextmanager
def upcast_forward(lm: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """Within the context, `lm`'s forward runs as `copy.deepcopy(lm).to(dtype)`'s would, one module
    widened at a time; on exit every tensor is the original again. Not thread-safe (the model's
    tensors are swapped in place): run nothing else on `lm` meanwhile. `lm.narrow_modules` (the audio part:
    transformers' conformer casts to float32 inside) run as they are, their output widened."""
    widener = _Widener(dtype)
    handles = []
    patched: list[nn.Module] = []
    experts = getattr(getattr(lm, "config", None), "_experts_implementation", None)
    try:
        if experts == "grouped_mm":  # torch's grouped_mm takes no float64; the deep copy switched too
            lm.set_experts_implementation("eager")
        narrow = getattr(lm, "narrow_modules", ())
        kept = {id(m) for part in narrow for m in part.modules()}
        for part in narrow:
            handles.append(
                part.register_forward_hook(lambda _m, _a, out: out.to(dtype) if isinstance(out, torch.Tensor) else None)
            )
        for module in (m for m in lm.modules() if id(m) not in kept):
            if isinstance(module, nn.Embedding):
                handles.append(module.register_forward_pre_hook(widener.embed))
                handles.append(module.register_forward_hook(widener.unembed))
            elif _blocked(module):
                module.forward = widener.blocked_linear(module)
                patched.append(module)
            else:
                handles.append(module.register_forward_pre_hook(widener.widen))
                handles.append(module.register_forward_hook(widener.restore))
        yield lm
    finally:
        for handle in handles:
            handle.remove()
        for module in patched:
            del module.forward
        for module in lm.modules():  # a forward that raised midway leaves some modules wide
            if id(module) in widener.saved:
                (widener.unembed if isinstance(module, nn.Embedding) else widener.restore)(module)
        if experts == "grouped_mm":
            lm.set_experts_implementation(experts)
