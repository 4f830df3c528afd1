"""Issue 46's byte table: per device graph and batch, what one execution reads, writes and returns.

`hlo_audit` sets each decode graph's bytes *read* next to the roofline. This table covers every graph
a port serves with (prefill at each bucket, decode with logits and the ids-returning decode, drafting's
verify of k + 1 tokens and the assistant's draft, each with logits and in its ids form, the one-row
join), lowered from the tiny fixtures
(`hlo_audit._tiny`) through torch_xla and never executed, and tables per graph what a device across
a bus pays for:

- **Weights and K/V bytes read**: `hlo_audit.audit_hlo`'s rules (a gather reads its slices, a dot its
  operand whole; the scatter into a K/V buffer and the output handing it back read none of it: a
  join reads its row's K/V, not the batch's).
- **K/V bytes written** (`hlo_audit.kv_bytes_written`): the updates of the scatters /
  dynamic-update-slices each returned K/V buffer is made of; a buffer returned any other way counts
  whole. Set against the **new positions' bytes**: for every K/V buffer `[B, heads, slots, D]`, the
  rows the call writes (B; a join 1; the draft, which only reads the K/V, 0) x its tokens x heads x D.
- **Bytes returned to the host**: every output but the K/V (which stay on the device as state). An ids
  graph's bound per row: 16 bytes for the decode; the verdict's k + 2 int32 for a greedy verify and the
  argmax's one for the draft, each with the one hidden state the next draft starts from.
- **Gather / scatter elements over the K/V**: the elements moved by the `gather` and `dynamic-slice`
  ops (their output) and the `scatter` and `dynamic-update-slice` ops (their updates) whose data
  operand is a K/V buffer: an entry parameter of the K/V, followed through reshapes, bitcasts,
  transposes, copies and earlier scatters / dynamic-update-slices of it (`kv_access`).
- An **element-wise** gather over the K/V indexes single elements instead of rows of the head
  dimension: its slice size is 1 along its operand's minor dimension (the layout's first, D for a
  `[B, heads, slots, D]` buffer) where that dimension is longer than 1 (one index tuple per element).
  A dynamic-slice of size 1 there, a scatter with that dimension among its `inserted_window_dims`,
  and a dynamic-update-slice whose update is 1 wide there count the same way.
- An element-wise gather **into** the K/V: one (of any other operand) whose values a returned K/V
  buffer holds as they are, followed back from the buffer through views, re-layouts, concatenations,
  selects, converts, broadcasts and the updates of scatters / dynamic-update-slices: the form issue
  46 found in the old prefill write (`torch.gather(new, 2, index)`, the index expanded over every
  slot and D: B x heads x slots x D index tuples per buffer).

The bounds (issue 46, "Done when"; `GraphBytes.failures`): K/V written <= 1.05 x the new positions'
bytes; the decode that returns ids returns <= 16 bytes a row; no element-wise gather or scatter over
the K/V, and none into it. A ring prefill longer than its ring is labelled and exempt from the write
bound only: its ring keeps the newest `slots` of the chunk's tokens, rewritten from D-wide rows of the
chunk (`ExplicitKV._write`).

    PJRT_DEVICE=CPU .venv-xla/bin/python -m gemma4lab.tools.graph_bytes --json graph_bytes.json

prints the markdown table, writes the JSON and exits 1 when a row breaks a bound.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gemma4lab.tools import hlo_audit
from gemma4lab.tools.hlo_audit import (
    CONTEXT,
    EXPERT,
    IDS_BYTES_PER_ROW,
    KV,
    RELAYOUT_OPS,
    VERIFY_DRAFTS,
    VIEW_OPS,
    WEIGHT,
    WRITE_OPS,
    Instruction,
    array_dims,
    entry_instructions,
)
from gemma4lib.models.variants import VARIANTS

log = logging.getLogger(__name__)

WRITE_SLACK = 1.05  # K/V written <= this x the new positions' bytes
BUCKETS = (8, 16)  # the prefill buckets audited: the tiny fixtures' sliding window (8) and twice it
BATCHES = (1, 4)
JOIN_BATCH = 4  # the batch whose K/V the one-row join writes one row of
# the CI's variants: one dense, the MoE (the XLA lane's CI subset); `--all` audits every variant
CI_VARIANTS = (
    next(v.name for v in VARIANTS.values() if not v.is_moe),
    next(v.name for v in VARIANTS.values() if v.is_moe),
)
READS = frozenset({"gather", "dynamic-slice"})


@dataclass(frozen=True)
class KVAccess:
    """The gathers and scatters of one HLO module over its K/V buffers (module docstring)."""

    gather_elements: int
    scatter_elements: int
    elementwise: tuple[str, ...]  # "gather %g.1 of f32[4,1,8,16]{3,2,1,0}: slice 1 along D (16)"
    elementwise_into: tuple[str, ...] = ()  # element-wise gathers whose values are written into the K/V


def elements(type_text: str) -> int:
    return math.prod(array_dims(type_text))


def minor_dimension(type_text: str) -> int:
    """The minor-most dimension of an array type, from its layout (`{3,2,1,0}` -> 3; none: the last)."""
    layout = re.search(r"\]\{(\d+)", type_text)
    return int(layout.group(1)) if layout else len(array_dims(type_text)) - 1


def _ints(attrs: str, key: str) -> list[int]:
    match = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(x) for x in match.group(1).split(",") if x] if match else []


def _elementwise_read(ins: Instruction, operand: str) -> str | None:
    """A gather / dynamic-slice of `operand` (its type) taking 1 element along its minor dimension."""
    minor, dims = minor_dimension(operand), array_dims(operand)
    key = "slice_sizes" if ins.opcode == "gather" else "dynamic_slice_sizes"
    sizes = _ints(ins.attrs, key) or list(array_dims(ins.type))
    if dims[minor] > 1 and sizes[minor] == 1:
        return f"{ins.opcode} %{ins.name} of {operand}: slice 1 along D ({dims[minor]})"
    return None


def kv_access(hlo_text: str, kv_params: Collection[int], kv_outputs: int = 0) -> KVAccess:
    """Gather / scatter elements over the K/V entry parameters `kv_params` (by parameter number), the
    element-wise ones (module docstring), and the element-wise gathers into the K/V returned as the
    last `kv_outputs` outputs (`_gathers_into`). HLO text defines every value before its uses."""
    instructions = entry_instructions(hlo_text)
    types = {ins.name: ins.type for ins in instructions}
    kv: set[str] = set()
    gathered = scattered = 0
    elementwise = []
    for ins in instructions:
        if ins.parameter_number in kv_params:
            kv.add(ins.name)
            continue
        if not ins.operands or ins.operands[0] not in kv:
            continue
        operand = types[ins.operands[0]]
        minor, dims = minor_dimension(operand), array_dims(operand)
        if ins.opcode in VIEW_OPS or ins.opcode in RELAYOUT_OPS:
            kv.add(ins.name)
        elif ins.opcode in READS:
            gathered += elements(ins.type)
            if (found := _elementwise_read(ins, operand)) is not None:
                elementwise.append(found)
        elif ins.opcode in WRITE_OPS:
            kv.add(ins.name)  # the updated buffer: later reads and writes of it are over the K/V
            update = types[ins.operands[WRITE_OPS[ins.opcode]]]
            scattered += elements(update)
            if ins.opcode == "scatter":
                one_wide = minor in _ints(ins.attrs, "inserted_window_dims")
            else:
                one_wide = array_dims(update)[minor] == 1
            if dims[minor] > 1 and one_wide:
                elementwise.append(f"{ins.opcode} %{ins.name} into {operand}: 1 wide along D ({dims[minor]})")
    into = _gathers_into(instructions, kv_outputs, kv)
    return KVAccess(gathered, scattered, tuple(elementwise), into)


# what carries values into a returned K/V buffer unchanged: operand positions followed back from it
CARRIES = {"select": (1, 2), "scatter": (0, 2), "dynamic-update-slice": (0, 1), "convert": (0,), "broadcast": (0,)}


def _gathers_into(instructions: Sequence[Instruction], kv_outputs: int, kv: set[str]) -> tuple[str, ...]:
    """The element-wise gathers (not over the K/V: `kv` names those) whose values the last
    `kv_outputs` outputs of the root tuple hold as they are (followed back through views, re-layouts,
    concatenations, selects, converts, broadcasts and the updates of scatters / dynamic-update-slices)."""
    by_name = {ins.name: ins for ins in instructions}
    root = next(ins for ins in instructions if ins.root)
    todo = list(root.operands[len(root.operands) - kv_outputs :]) if kv_outputs else []
    seen, found = set(todo), []
    while todo:
        ins = by_name.get(todo.pop())
        if ins is None:
            continue
        if ins.opcode in READS:
            gather = _elementwise_read(ins, by_name[ins.operands[0]].type)
            if ins.operands[0] not in kv and gather is not None:
                found.append(gather)
            continue
        if ins.opcode in VIEW_OPS or ins.opcode in RELAYOUT_OPS:
            positions: Sequence[int] = (0,)
        elif ins.opcode == "concatenate":
            positions = range(len(ins.operands))
        else:
            positions = CARRIES.get(ins.opcode, ())
        for i in positions:
            if ins.operands[i] not in seen:
                seen.add(ins.operands[i])
                todo.append(ins.operands[i])
    return tuple(sorted(found))


@dataclass
class GraphBytes:
    """One graph's row of the table (bytes of one execution; the module docstring defines each)."""

    variant: str
    graph: str  # prefill | decode | decode_ids | verify | verify_ids | draft | draft_ids | row_join
    batch: int  # rows of its K/V buffers (a join: the batch it joins)
    tokens: int  # query tokens per row: the bucket, 1 for decode and draft, k + 1 for verify
    ring: bool  # sliding layers as rings of the window's slots
    weight_bytes_read: int
    kv_bytes_read: int
    kv_bytes_written: int
    new_positions_bytes: int
    bytes_returned: int
    gather_elements: int
    scatter_elements: int
    elementwise: list[str] = field(default_factory=list)  # element-wise gathers / scatters over the K/V
    elementwise_into: list[str] = field(default_factory=list)  # element-wise gathers written into the K/V
    ring_longer: bool = False  # a ring prefill longer than its ring: the write bound does not apply
    hidden_row_bytes: int = 0  # the hidden state a row hands the next draft (verify_ids, draft_ids)

    def failures(self) -> list[str]:
        """The bounds this row breaks (empty: it holds them all)."""
        out = []
        if not self.ring_longer and self.kv_bytes_written > WRITE_SLACK * self.new_positions_bytes:
            out.append(
                f"writes {self.kv_bytes_written:,} K/V bytes for {self.new_positions_bytes:,} new "
                f"(bound {WRITE_SLACK} x)"
            )
        if self.ids_bound is not None and self.bytes_returned > self.ids_bound * self.batch:
            out.append(f"returns {self.bytes_returned:,} bytes for {self.batch} rows (bound {self.ids_bound} a row)")
        out += [f"element-wise over the K/V: {e}" for e in self.elementwise]
        out += [f"element-wise into the K/V: {e}" for e in self.elementwise_into]
        return out

    @property
    def ids_bound(self) -> int | None:
        """Bytes a row of an ids graph may return: a decode's `IDS_BYTES_PER_ROW`; a greedy verify's
        verdict (k + 2 int32) and a draft's argmax (one), each with the one hidden state the next draft
        starts from; None for a graph that returns logits."""
        ids = {"decode_ids": IDS_BYTES_PER_ROW, "verify_ids": 4 * (self.tokens + 1), "draft_ids": 4}
        return ids[self.graph] + self.hidden_row_bytes if self.graph in ids else None

    @property
    def rows(self) -> int:
        """The rows the call computes (a join: its one row of the batch)."""
        return 1 if self.graph == "row_join" else self.batch

    @property
    def label(self) -> str:
        what = {"prefill": f"prefill {self.tokens}", "row_join": f"row join {self.tokens}"}
        ids = {"decode_ids": "decode → ids", "verify_ids": "verify → verdict", "draft_ids": "draft → ids"}
        text = what.get(self.graph, ids.get(self.graph, self.graph))
        if self.graph.startswith("verify"):
            text += f" ({self.tokens} tokens)"
        return text + (", ring" if self.ring else "")


def new_positions_bytes(kv_shapes: Sequence[Sequence[int]], rows: int, tokens: int, element_bytes: int) -> int:
    """Bytes of `tokens` new positions of `rows` rows in every K/V buffer `[B, heads, slots, D]`."""
    return sum(rows * tokens * s[1] * s[3] * element_bytes for s in kv_shapes)


def graph_row(variant: str, name: str, graph: Any, ring: bool) -> GraphBytes:
    """Lower one graph (on the XLA device already) with its example inputs and make its row."""
    inputs_before_kv = getattr(graph, "num_inputs", None) or graph.inputs_before_kv
    device = next(graph.parameters()).device
    tensors = [t.to(device) for t in graph.example_inputs()]
    inputs, kv = tensors[:inputs_before_kv], tensors[inputs_before_kv:]
    audit = hlo_audit.audit_graph(graph, inputs, kv, f"{variant} {name}")
    kv_params = [p.number for p, role in zip(audit.params, audit.roles, strict=True) if role == KV]
    writes = bool(getattr(graph, "writes_kv", True))
    access = kv_access(audit.hlo_text, kv_params, len(kv) if writes else 0)
    kind = re.sub(r"\d+$", "", name).replace("row_prefill", "row_join")
    tokens, batch = graph.shape.tokens, kv[0].shape[0]
    rows = 0 if not writes else 1 if kind == "row_join" else batch
    shapes = [tuple(t.shape) for t in kv]
    return GraphBytes(
        variant=variant,
        graph=kind,
        batch=batch,
        tokens=tokens,
        ring=ring,
        weight_bytes_read=audit.read(WEIGHT, EXPERT),
        kv_bytes_read=audit.read(KV),
        kv_bytes_written=audit.kv_written,
        new_positions_bytes=new_positions_bytes(shapes, rows, tokens, kv[0].element_size()),
        bytes_returned=audit.returned,
        gather_elements=access.gather_elements,
        scatter_elements=access.scatter_elements,
        elementwise=list(access.elementwise),
        elementwise_into=list(access.elementwise_into),
        ring_longer=writes and tokens > min(s[2] for s in shapes),
        hidden_row_bytes=_hidden_row_bytes(graph) if kind in ("verify_ids", "draft_ids") else 0,
    )


def _hidden_row_bytes(graph: Any) -> int:
    """Bytes of the one hidden state a row of `graph` returns for the next draft (0 when it returns none)."""
    width = getattr(graph, "backbone", None)  # the draft graph's projected hidden: the target's width
    if width is None:
        width = graph.model.config.hidden_size if graph.returns_hidden else 0
    return int(width) * torch.empty((), dtype=graph.dtype).element_size()


def graph_sets(model: Any, batch: int) -> list[tuple[bool, Any, tuple[str, ...]]]:
    """(ring, graph set, the graphs of it audited) at `batch` rows: the plain port's graphs over
    full-length buffers (the join at `JOIN_BATCH` only), its prefills over ring buffers, and
    drafting's verify and draft over the assistant's layout (a seeded random tiny assistant)."""
    from gemma4lib.device.build import graph_set
    from gemma4lib.models.assistant import LoadedAssistant, build_tiny_assistant, read_layers

    form = model.variant.expert_forms[0]
    common = dict(batch=batch, context_length=CONTEXT, inplace=False, decode_experts=form)
    plain = graph_set(
        model, ring=False, prefill_buckets=BUCKETS, row_prefill=batch == JOIN_BATCH, chooses=True, **common
    )
    ring = graph_set(model, ring=True, prefill_buckets=BUCKETS, **common)
    assistant = LoadedAssistant(build_tiny_assistant(model.config, model.variant), "tiny", read_layers(model.layout))
    drafting = graph_set(
        model,
        ring=False,
        prefill_buckets=(),
        draft_tokens=VERIFY_DRAFTS,
        hidden=True,
        assistant=assistant,
        chooses=True,
        **common,
    )
    return [
        (False, plain, tuple(name for name, _ in plain)),
        (True, ring, tuple(f"prefill{b}" for b in BUCKETS)),
        (False, drafting, ("verify", "verify_ids", "draft", "draft_ids")),
    ]


def audit_rows(model: Any, batches: Sequence[int] = BATCHES, device: Any = None) -> list[GraphBytes]:
    """Every graph's row for `model` (a tiny `LoadedModel`) at each batch size."""
    import torch_xla

    from gemma4lib.backends.xla import to_device

    rows = []
    for batch in batches:
        for ring, graphs, names in graph_sets(model, batch):
            named = graphs.named()
            on_device = to_device({n: named[n] for n in names}, device or torch_xla.device())
            for name, graph in on_device.items():
                rows.append(graph_row(model.variant.name, name, graph, ring))
                log.info("%s: %s", name, rows[-1])
    return rows


def table_json(rows: Sequence[GraphBytes], variants: Sequence[str]) -> dict[str, Any]:
    return {
        "command": "PJRT_DEVICE=CPU .venv-xla/bin/python -m gemma4lab.tools.graph_bytes"
        + (" --all" if set(variants) != set(CI_VARIANTS) else ""),
        "models": "tiny fixtures (hlo_audit._tiny), fp32",
        "context_length": CONTEXT,
        "prefill_buckets": list(BUCKETS),
        "draft_tokens": VERIFY_DRAFTS,
        "bounds": {"kv_written_over_new": WRITE_SLACK, "ids_bytes_per_row": IDS_BYTES_PER_ROW},
        "rows": [{**asdict(r), "failures": r.failures()} for r in rows],
    }


def format_table(rows: Sequence[GraphBytes]) -> str:
    """Markdown: one row per graph and batch."""
    head = (
        "| variant | graph | B | weights read | K/V read | K/V written | new positions | written / new "
        "| returned to host | per row | K/V gather elements | K/V scatter elements "
        "| element-wise over / into K/V | bounds |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ratio = f"{r.kv_bytes_written / r.new_positions_bytes:.2f}" if r.new_positions_bytes else "–"
        bounds = "; ".join(r.failures()) or ("ok (ring over its window: no write bound)" if r.ring_longer else "ok")
        lines.append(
            f"| {r.variant} | {r.label} | {r.batch} | {r.weight_bytes_read:,} | {r.kv_bytes_read:,} "
            f"| {r.kv_bytes_written:,} | {r.new_positions_bytes:,} | {ratio} | {r.bytes_returned:,} "
            f"| {r.bytes_returned // r.rows:,} | {r.gather_elements:,} | {r.scatter_elements:,} "
            f"| {len(r.elementwise)} / {len(r.elementwise_into)} | {bounds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemma4lab.tools.graph_bytes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    parser.add_argument("--all", action="store_true", help=f"every variant (default: {', '.join(CI_VARIANTS)})")
    parser.add_argument("--verbose", action="store_true", help="log each graph's row")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    torch.set_num_threads(1)
    variants = tuple(VARIANTS) if args.all else CI_VARIANTS
    rows = [row for name in variants for row in audit_rows(hlo_audit._tiny(name))]
    sys.stdout.write(format_table(rows) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table_json(rows, variants), f, indent=1)
            f.write("\n")
    bad = [r for r in rows if r.failures()]
    for r in bad:
        log.error("%s %s, batch %d: %s", r.variant, r.label, r.batch, "; ".join(r.failures()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
