"""Run a tiny variant's prefill + decode graphs on the XLA lane against the host greedy reference.

    PJRT_DEVICE=CPU .venv-xla/bin/python -m gemma4lib.tools.xla_check --variant e2b
    PJRT_DEVICE=CPU .venv-xla/bin/python -m gemma4lib.tools.xla_check --variant all --hlo-dir artifacts/xla
    PJRT_DEVICE=CPU .venv-xla/bin/python -m gemma4lib.tools.xla_check --variant e2b --leaky   # the leak demo

Prints one JSON object per variant (one per line): ``seq_match`` (prefill token + every decode token
equal to transformers' greedy `generate` on the host fp32 model), ``xla_fallbacks``,
``xla_compilations`` / ``xla_executions`` / ``xla_graph_hashes`` per graph, ``one_compile_per_shape``
and the HLO files and op counts (see `gemma4lib.backends.xla`). Exit status 1 if any variant fails
(tokens differ, a fallback, more than one compilation per graph shape, or more than one
execution per step).

``--leaky`` swaps in `LeakyPositionGraph`, which reads the position as a Python int at trace time:
the tokens still match, but every decode step is a new graph (a recompile per token on inf2), and
the compilation count shows it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..device.graph import DeviceGraph, GraphShape
from ..errors import SettingsError
from ..models.loading import build_tiny
from ..models.variants import VARIANTS, get_variant


class LeakyPositionGraph(DeviceGraph):
    """A deliberately wrong graph: the position becomes a Python int baked into the trace.

    `int(start)` pulls the position to the host (torch_xla counts it as ``aten::_local_scalar_dense``)
    and `torch.arange(position, ...)` then records it as a constant of the traced op, so each
    position is a different graph. (A Python int that only reaches the graph as a tensor value, e.g.
    ``torch.tensor([position])``, would not leak on torch_xla: scalars are uploaded as data. Shapes,
    slices, integer indexing and `arange` bounds do leak.)
    """

    def forward(self, inputs_embeds: torch.Tensor, *args: torch.Tensor):
        i = 1 if self.has_ple else 0
        position = int(args[i])
        start = torch.arange(position, position + 1, device=args[i].device)
        return super().forward(inputs_embeds, *args[:i], start, *args[i + 1 :])


def run_variant(
    variant: str,
    *,
    decode_steps: int = 16,
    prompt_tokens: int = 20,
    bucket: int = 24,
    context_length: int = 64,
    ring: bool = False,
    expert_forms: tuple[str, str] = ("dense", "selective"),
    leaky: bool = False,
    hlo_dir: str | Path | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Prefill one prompt, decode `decode_steps` tokens on XLA; compare with HF greedy decoding."""
    from ..backends.xla import XLASession

    if prompt_tokens + 1 + decode_steps > context_length or prompt_tokens > bucket:
        raise SettingsError(
            "prompt + decode steps must fit context_length, and the prompt the bucket: "
            "lower steps or prompt_len, or raise context_length"
        )
    t0 = time.perf_counter()
    v = get_variant(variant)
    model = build_tiny(v, seed=seed)
    ids = torch.randint(
        3, model.config.vocab_size - 12, (1, prompt_tokens), generator=torch.Generator().manual_seed(seed + 1)
    )
    with torch.no_grad():
        reference = model.lm.generate(
            ids, max_new_tokens=1 + decode_steps, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, prompt_tokens:].tolist()
    t_ref = time.perf_counter()

    graph_cls = LeakyPositionGraph if leaky else DeviceGraph
    graphs = {
        phase: graph_cls(
            model.text_model,
            model.lm_head,
            model.layout,
            GraphShape(1, tokens, context_length, ring),
            inplace=False,
            expert_form=form,
        )
        for phase, tokens, form in (("prefill", bucket, expert_forms[0]), ("decode", 1, expert_forms[1]))
    }
    session = XLASession(graphs, hlo_dir=hlo_dir)
    prefill, decode = session.step("prefill"), session.step("decode")
    kv = session.new_kv("prefill")
    text = model.text_model
    has_ple = graphs["prefill"].has_ple

    def host_inputs(token_ids: torch.Tensor, pad_to: int) -> list[torch.Tensor]:
        n = token_ids.shape[1]
        embeds = text.embed_tokens(token_ids)
        out = [torch.nn.functional.pad(embeds, (0, 0, 0, pad_to - n))]
        if has_ple:
            ple = text.get_per_layer_inputs(token_ids)
            out.append(torch.nn.functional.pad(ple, (0, 0, 0, 0, 0, pad_to - n)))
        return out

    tokens: list[int] = []
    with torch.no_grad():
        logits = prefill(*host_inputs(ids, bucket), torch.tensor([0]), torch.tensor([prompt_tokens]), *kv)
        tokens.append(int(logits.cpu().argmax()))
        t_prefill = time.perf_counter()
        for step in range(decode_steps):
            position = prompt_tokens + step
            logits = decode(
                *host_inputs(torch.tensor([[tokens[-1]]]), 1), torch.tensor([position]), torch.tensor([1]), *kv
            )
            tokens.append(int(logits.cpu().argmax()))
    t_end = time.perf_counter()

    report = session.report()
    compiles, hashes = report["xla_compilations"], report["xla_graph_hashes"]
    one_per_shape = all(compiles.get(p) == 1 and hashes.get(p) == 1 for p in graphs)
    # more executions than steps: something in the graph forced a materialisation (a graph break)
    one_execution_per_step = report["xla_executions"] == report["xla_steps"]
    return {
        "variant": v.name,
        "backend": "xla",
        "leaky": leaky,
        "ring": ring,
        "expert_forms": list(expert_forms) if v.is_moe else None,
        "decode_steps": decode_steps,
        "seq_match": tokens == reference,
        "tokens": tokens,
        "reference": reference,
        **report,
        "one_compile_per_shape": one_per_shape,
        "one_execution_per_step": one_execution_per_step,
        "seconds": {
            "reference": round(t_ref - t0, 2),
            "prefill": round(t_prefill - t_ref, 2),
            "decode": round(t_end - t_prefill, 2),
            "total": round(t_end - t0, 2),
        },
        "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    import torch_xla
    import transformers

    return {"torch": torch.__version__, "torch_xla": torch_xla.__version__, "transformers": transformers.__version__}


def passed(result: dict[str, Any]) -> bool:
    return bool(
        result["seq_match"]
        and result["xla_fallbacks"] == 0
        and result["one_compile_per_shape"]
        and result["one_execution_per_step"]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gemma4lib.tools.xla_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--variant", action="append", required=True, help=f"one of {', '.join(VARIANTS)} or 'all'; repeatable"
    )
    parser.add_argument("--steps", type=int, default=16, help="decode steps after the prefill token")
    parser.add_argument("--ring", action="store_true", help="sliding layers as ring buffers")
    parser.add_argument(
        "--expert-forms", default="dense,selective", help="MoE expert form for prefill,decode (dense|selective)"
    )
    parser.add_argument("--leaky", action="store_true", help="the shape-leak demo (must recompile per step)")
    parser.add_argument("--hlo-dir", default=None, help="write <dir>/<variant>/<graph>.<n>.hlo.txt")
    parser.add_argument(
        "--optimized-cpu-compile",
        action="store_true",
        help="keep XLA:CPU's backend optimisation (slower compiles; default: off)",
    )
    args = parser.parse_args(argv)
    if not args.optimized_cpu_compile:
        from ..backends.xla import use_fast_cpu_compile

        use_fast_cpu_compile()
    torch.set_num_threads(1)
    names = list(VARIANTS) if "all" in args.variant else args.variant
    forms = tuple(args.expert_forms.split(","))
    ok = True
    for name in names:
        hlo_dir = Path(args.hlo_dir) / get_variant(name).name if args.hlo_dir else None
        result = run_variant(
            name, decode_steps=args.steps, ring=args.ring, expert_forms=forms, leaky=args.leaky, hlo_dir=hlo_dir
        )
        # the leak demo passes when the leak is caught: tokens right, compilations per step
        ok &= (result["seq_match"] and not result["one_compile_per_shape"]) if args.leaky else passed(result)
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
