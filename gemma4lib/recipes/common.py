"""What the three Neuron recipes share, all of it runnable on CPU.

- `KVParamModule`: a `DeviceGraph`/`RankGraph` built with `inplace=False` whose K/V buffers are
  `nn.Parameter`s (requires_grad=False) of the module. `forward(inputs...)` returns
  `(logits, *updated_kv)`; `aliases()` maps each K/V parameter to its output index, the
  `input_output_aliases` that torch_neuronx / NxD take so the compiled graph writes the updated K/V
  back into the same device buffers.
- `AliasEmulator`: runs a `KVParamModule` on CPU the way the device runs the compiled one (outputs
  copied back into the K/V parameters), so the host loop below is tested here.
- `host_generate`: the engine (`runtime.Engine`) over modules that hold their K/V: embeddings
  (and PLE) looked up on the host (`embedder.HostEmbedder`), prefill (one graph call, or the prompt
  token by token through the decode graph), greedy decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..device.embedder import HostEmbedder
from ..device.graph import INDEX_DTYPE
from ..errors import DeviceOutputError, GraphFormError, HostTablesMovedError


class KVParamModule(nn.Module):
    """A functional graph with its K/V held as parameters, ready for aliasing."""

    def __init__(self, graph: nn.Module, kv: nn.ParameterList | None = None):
        super().__init__()
        if getattr(graph, "inplace", False):
            raise GraphFormError(
                "KVParamModule needs the functional graph form (K/V returned as outputs): build it with "
                "DeviceGraph(..., inplace=False)"
            )
        self.graph = graph
        if kv is None:
            kv = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in graph.new_kv()])
        self.kv = kv

    @property
    def num_inputs(self) -> int:
        return 4 if getattr(self.graph, "has_ple", False) else 3

    def forward(self, *inputs: torch.Tensor):
        return self.graph(*inputs, *self.kv)

    def aliases(self) -> dict[nn.Parameter, int]:
        """`{kv_param: output_index}`: output 0 is the logits, then the K/V in buffer order."""
        return {p: 1 + i for i, p in enumerate(self.kv)}

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.graph.example_inputs()[: self.num_inputs])

    def sharing(self, graph: nn.Module) -> KVParamModule:
        """Another graph (e.g. decode next to prefill) over the same K/V parameters."""
        return KVParamModule(graph, self.kv)


def graph_example_inputs(config: Any, shape: Any, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Example inputs of a graph bucket without building it (same as `KVParamModule.example_inputs`)."""
    t = shape.tokens
    inputs = [torch.zeros(shape.batch, t, config.hidden_size, dtype=dtype)]
    ple = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
    if ple:
        inputs.append(torch.zeros(shape.batch, t, config.num_hidden_layers, ple, dtype=dtype))
    b = shape.batch  # start and length: one int32 value per row
    inputs += [torch.zeros(b, dtype=INDEX_DTYPE), torch.ones(b, dtype=INDEX_DTYPE)]
    return tuple(inputs)


class AliasEmulator:
    """Call a `KVParamModule` on CPU with device aliasing semantics; returns the logits."""

    def __init__(self, module: KVParamModule):
        self.module = module

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = self.module(*inputs)
            for param, new in zip(self.module.kv, out[1:], strict=True):
                param.copy_(new)
        return out[0]


def first_output(out: Any) -> torch.Tensor:
    """The logits, whether a compiled module returns a tensor or a tuple/list led by them."""
    return out[0] if isinstance(out, (tuple, list)) else out


def host_generate(
    decode: Callable[..., Any],
    host: HostEmbedder,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    vocab_size: int,
    prefill: Callable[..., Any] | None = None,
    prefill_len: int | None = None,
    context_length: int | None = None,
    eos_token_ids: Sequence[int] = (),
    keep_logits: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Greedy tokens from steps that hold their K/V themselves (a device module, or an
    `AliasEmulator`) and take only the graph inputs, through the one engine (`runtime.Engine`).

    `dtype`: the dtype the graphs were compiled for; the host embeddings are cast to it (a model
    loaded in float32 and compiled in bf16 would otherwise hand the device float32 inputs).
    `prefill`: a prefill graph of bucket `prefill_len`; without one the engine feeds the prompt
    through `decode` token by token. `keep_logits`: also return `step_logits` (LOGITS_MATCH).
    """
    from ..runtime import Engine, Steps

    prompt = [int(t) for t in prompt]
    steps = Steps(prefill={int(prefill_len or len(prompt)): prefill} if prefill is not None else {}, decode=decode)
    engine = Engine(
        host,
        steps,
        batch=1,
        context_length=context_length or len(prompt) + max_new_tokens,
        vocab_size=vocab_size,
        cap=None,
        dtype=dtype or torch.float32,
    )
    row = engine.generate(prompt, max_new_tokens, eos_token_ids=eos_token_ids, keep_logits=keep_logits)
    out = {
        "tokens": row.tokens,
        "prefill_mode": "graph" if prefill is not None else "decode-steps",
        "prefill_logits": row.first_logits,
        "prefill_s": row.prefill_s,
        "decode_s": sum(row.step_s),
        "decode_tok_s": row.decode_tok_s,
    }
    if keep_logits:
        out["step_logits"] = row.step_logits
    return out


def check_first_output(out: Any, vocab: int | None = None) -> None:
    """The first call's output, checked: the logits as a tensor (last dim `vocab` when given),
    alone. A tuple with more tensors means the module hands its K/V back every step (a copy of all
    of it to the host per token: a silent slowdown) — the aliased K/V should stay on the device."""
    logits = first_output(out)
    if not isinstance(logits, torch.Tensor):
        raise DeviceOutputError(
            f"the compiled module returned {type(out).__name__} led by {type(logits).__name__}, not the logits "
            "tensor: recompile (the artifact is not this recipe's) or check what the traced module returns"
        )
    if vocab is not None and logits.shape[-1] != vocab:
        raise DeviceOutputError(
            f"the compiled module's first output has shape {tuple(logits.shape)}, not [..., {vocab}] logits: "
            "the artifact was compiled for another model or output order; clear its cache entry and recompile"
        )
    extra = [t for t in (out[1:] if isinstance(out, (tuple, list)) else ()) if isinstance(t, torch.Tensor)]
    if extra:
        mb = sum(t.numel() * t.element_size() for t in extra) / 1e6
        raise DeviceOutputError(
            f"the compiled module returns {len(extra)} tensors after the logits ({mb:.1f} MB copied to the host "
            "every step): its K/V are outputs, not aliased device state; trace with input_output_aliases "
            "mapping every K/V parameter (KVParamModule.aliases) so they stay on the device"
        )


def check_host_tables(host: HostEmbedder) -> None:
    """After the compile or load: the embedder's tables are still host tensors with their storage
    (a compiler that moved or freed weights shared with the device module, e.g. the tied
    `lm_head`/`embed_tokens`, would make the next lookup fail or cross to the device)."""
    for name in ("embed_tokens", "embed_tokens_per_layer"):
        table = getattr(host, name, None)
        weight = getattr(table, "weight", None)
        if table is None or weight is None:
            continue
        if weight.device.type != "cpu" or weight.numel() == 0 or weight.untyped_storage().nbytes() == 0:
            raise HostTablesMovedError(
                f"the host {name} table is on {weight.device} with {weight.untyped_storage().nbytes()} bytes of "
                "storage after the compile: the compiler moved or freed a weight the host embedder shares; keep "
                "the host model out of the traced module (the recipes build it from the config) and reload it"
            )


class DeviceStep:
    """An engine step over a compiled module that keeps its K/V on the device.

    The engine calls `step(inputs..., start, length)`; the device module takes exactly those (its
    K/V are aliased state). The first call's
    output is checked (`check_first_output`), so a wrong artifact fails with a named error there.
    """

    def __init__(self, module: Callable[..., Any], num_inputs: int, vocab: int | None = None):
        self.module, self.num_inputs, self.vocab = module, num_inputs, vocab
        self.checked = False

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.module(*args[: self.num_inputs])
        if not self.checked:
            check_first_output(out, self.vocab)
            self.checked = True
        return first_output(out).float()
