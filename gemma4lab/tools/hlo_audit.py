"""HLO byte audit: which bytes of its parameters a lowered decode graph reads per execution.

The roofline (`roofline.decode_bytes`) says what a decode step *should* read, from shapes. This
module reads what the program handed to the compiler *does* read, from its HLO text, so the two
can be put side by side: a graph that reads a whole expert shard where the roofline counts k
gathered slices, or that copies a weight every step, shows up as a difference, not as a guess.

Two halves:

- `audit_hlo(text)`: pure text, no torch_xla. Per parameter of the ENTRY computation, its bytes and
  the bytes the program reads of it. The rules are deliberately simple (pre-optimisation HLO, as
  torch_xla emits it and neuronx-cc receives it):

  * Uses are followed through `reshape`/`bitcast` (same bytes, new shape) and transposes that move
    no dimension (torch_xla emits them), and through other `transpose`s and `copy` (a re-layout,
    remembered on the path).
  * A `gather` or `dynamic-slice` that takes the parameter as its data operand (operand 0), or a
    static `slice` of it, reads its *output* size: the slices it fetches, repeats included (a
    gather of k rows reads k rows, even when fewer distinct rows exist).
  * A `dot` reads the parameter whole. A transpose on the way to a dot is not a copy: compilers
    fold it into the dot's contracting dimensions (XLA's TransposeFolding; torch_xla writes every
    `F.linear` weight that way).
  * A `scatter` or `dynamic-update-slice` *into* the parameter (its operand 0) reads none of it:
    the result is the same buffer updated in place (the device aliases the K/V to their outputs),
    whose uses are followed as the parameter's (its re-layouts unflagged: state, not a weight). The
    root tuple reads nothing: an output that is a parameter, or an update of one, is state handed
    back, not read.
  * Any other use (elementwise, broadcast, a scatter's updates, a collective) reads it whole.
  * A parameter that reaches anything but a dot through a `transpose` or `copy` is *flagged*
    (when it holds at least `min_flag_bytes`): the re-layout touches every byte of it each
    execution — for an expert shard, a full copy per step where k slices were meant — and its
    read counts whole.
  * So is one gathered in slices that are not contiguous in its layout (a gather along an inner
    dimension, e.g. `w[:, ids]`): XLA canonicalises such a gather by transposing the whole operand
    first (XLA:CPU's optimised HLO shows the transpose and a copy of the whole weight).

  A parameter read by several uses counts whole if any use reads it whole, else the sum of its
  partial reads.

- `audit_graph(...)` and the variant helpers (need torch_xla, imported on use): lower a tiny
  variant's decode graph — single device, or one rank of its tensor-parallel rank graph with
  `XlaLoweringCollectives` — without executing it, name each HLO parameter from the module's own
  tensors, and set the figures next to `roofline.decode_bytes` for the same model, expert form
  and TP degree. `audit_verify` does the same for drafting's verify graph (k + 1 tokens) against
  `mtp_roofline.verify_bytes`.

    PJRT_DEVICE=CPU .venv-xla/bin/python -m gemma4lab.tools.hlo_audit   # the markdown table

Exit status 1 when a graph's audited bytes differ from the roofline's or a selective graph
re-lays-out an expert weight. What every graph (prefill, verify, draft, the join too) writes into the
K/V, returns to the host and gathers over the K/V is `graph_bytes`' table, built on `audit_graph`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gemma4lib.models.variants import VARIANTS

log = logging.getLogger(__name__)

# bytes per element of HLO primitive types (s4/u4 pack two per byte)
DTYPE_BYTES: dict[str, float] = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
}
VIEW_OPS = frozenset({"reshape", "bitcast"})  # same bytes, another shape
RELAYOUT_OPS = frozenset({"transpose", "copy"})  # may move every byte
PARTIAL_OPS = frozenset({"gather", "dynamic-slice", "slice"})  # read their output's size
FOLDED_INTO = frozenset({"dot"})  # a transpose feeding these is folded, not materialised

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction of the entry computation: `name = type opcode(operands), attrs`."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    root: bool = False

    @property
    def parameter_number(self) -> int | None:
        if self.opcode != "parameter":
            return None
        return int(self.operands[0]) if self.operands else None


@dataclass
class ParamRead:
    """What one execution reads of one entry parameter."""

    number: int  # parameter(N)
    name: str  # its HLO name
    type: str  # e.g. "f32[16,64,32]{2,1,0}"
    bytes: int  # its whole size
    read_bytes: int  # what the program reads of it per execution (see the module docstring)
    partial_ops: list[str] = field(default_factory=list)  # "gather f32[4,64,32]" ...
    whole_ops: list[str] = field(default_factory=list)  # opcodes that read it whole
    relayouts: list[str] = field(default_factory=list)  # "transpose %t.1 -> gather %g.2"
    strided_gathers: list[str] = field(default_factory=list)  # gathers of non-contiguous slices
    flagged: bool = False  # re-laid out (not into a dot) or strided-gathered, and big enough

    @property
    def shape(self) -> tuple[int, ...]:
        return array_dims(self.type)


def array_dims(type_text: str) -> tuple[int, ...]:
    """Dimensions of an array type (`f32[2,<=3]{1,0}` -> (2, 3)); () for a scalar."""
    match = _ARRAY.search(type_text)
    if match is None:
        raise ValueError(f"not an HLO array type: {type_text!r}")
    dims = match.group(2).replace("<=", "").strip()
    return tuple(int(d) for d in dims.split(",")) if dims else ()


def type_bytes(type_text: str) -> int:
    """Bytes of an HLO type; a tuple type counts all its elements (its layouts are ignored)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(type_text):  # layouts ({1,0}) hold no brackets
        if dtype not in DTYPE_BYTES:
            if dtype == "token":
                continue
            raise ValueError(f"unknown HLO element type {dtype!r} in {type_text!r}")
        count = 1
        for d in dims.replace("<=", "").split(","):
            if d.strip():
                count *= int(d)
        total += count * DTYPE_BYTES[dtype]
    return int(total)


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start` (any of ([{ nested)."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i
    raise ValueError(f"unbalanced brackets in HLO: {text[start : start + 80]!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas outside any brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current))
    return [p.strip() for p in parts]


def parse_instruction(line: str) -> Instruction | None:
    """One instruction line, or None for anything else (braces, comments, blank lines)."""
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    root, name, rest = bool(match.group(1)), match.group(2), match.group(3).strip()
    # the type: a tuple "( ... )" or one token "f32[2,3]{1,0}"
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
    else:
        end = rest.index(" ") if " " in rest else len(rest)
    type_text, rest = rest[:end], rest[end:].strip()
    opcode_match = re.match(r"([a-z][a-z0-9\-]*)\(", rest)
    if opcode_match is None:
        return None
    open_at = opcode_match.end() - 1
    close_at = _closing(rest, open_at)
    operands = tuple(_operand_name(p) for p in _split_top(rest[open_at + 1 : close_at]))
    attrs = rest[close_at + 1 :].lstrip(", ").strip()
    return Instruction(name, type_text, opcode_match.group(1), operands, attrs, root)


def _operand_name(text: str) -> str:
    """`f32[2]{0} %x.1` -> `x.1`; a literal (`parameter(3)`'s 3) stays as written."""
    token = text.split()[-1] if text.split() else text
    return token[1:] if token.startswith("%") else token


def entry_instructions(hlo_text: str) -> list[Instruction]:
    """The instructions of the ENTRY computation, in order."""
    lines = hlo_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ENTRY")), None)
    if start is None:
        raise ValueError("no ENTRY computation in this HLO text")
    out = []
    for line in lines[start + 1 :]:
        if line.strip() == "}":
            break
        instruction = parse_instruction(line)
        if instruction is not None:
            out.append(instruction)
    return out


Users = dict[str, list[tuple[Instruction, int]]]  # name -> (instruction, operand position)


def audit_hlo(hlo_text: str, *, min_flag_bytes: int = 1024) -> list[ParamRead]:
    """Per entry parameter (by parameter number): its bytes and the bytes one execution reads.

    `min_flag_bytes`: smaller parameters are never flagged (re-laying out a norm vector or a
    [1, 1, 64] tensor is noise, not a weight copy).
    """
    instructions = entry_instructions(hlo_text)
    by_name = {ins.name: ins for ins in instructions}
    types = {ins.name: ins.type for ins in instructions}
    users: Users = {}
    for ins in instructions:
        for position, operand in enumerate(ins.operands):
            if operand in by_name:
                users.setdefault(operand, []).append((ins, position))
    reads = []
    for ins in instructions:
        number = ins.parameter_number
        if number is None:
            continue
        read = ParamRead(number, ins.name, ins.type, type_bytes(ins.type), 0)
        partial, whole = _follow(ins.name, (), users, read, types)
        copied = bool(read.relayouts or read.strided_gathers)
        read.flagged = copied and read.bytes >= min_flag_bytes
        if whole or copied:
            read.read_bytes = read.bytes
        else:
            read.read_bytes = partial
        reads.append(read)
    return sorted(reads, key=lambda r: r.number)


def _follow(
    name: str,
    path: tuple[Instruction, ...],
    users: Users,
    read: ParamRead,
    operand_types: dict[str, str],
    state: bool = False,
) -> tuple[int, bool]:
    """Walk the uses of `name` (an alias of the parameter): (partial bytes, read whole?). `state`: past
    an in-place update (device state, the K/V): its re-layouts on the way to attention are not
    flagged, they copy no weight."""
    partial, whole = 0, False
    for user, position in users.get(name, ()):
        if user.opcode in VIEW_OPS or _identity(user):
            p, w = _follow(user.name, path, users, read, operand_types, state)
        elif user.opcode in RELAYOUT_OPS:
            p, w = _follow(user.name, path if state else path + (user,), users, read, operand_types, state)
        elif user.opcode in WRITE_OPS and position == 0:  # updated in place: the same buffer after
            p, w = _follow(user.name, path, users, read, operand_types, True)
        elif user.opcode == "tuple" and user.root:  # an output: state handed back (aliased), not read
            p, w = 0, False
        elif user.opcode in PARTIAL_OPS and position == 0:
            p, w = type_bytes(user.type), False
            read.partial_ops.append(f"{user.opcode} {user.type.split('{')[0]}")
            _note_relayouts(read, path, user)
            operand_type = operand_types[name]
            if user.opcode == "gather" and not state and not gather_slices_contiguous(operand_type, user.attrs):
                read.strided_gathers.append(
                    f"gather %{user.name} of {operand_type}: {_attr(user.attrs, 'slice_sizes')}"
                )
        elif user.opcode in FOLDED_INTO:
            p, w = 0, True
            read.whole_ops.append(user.opcode)
        else:
            p, w = 0, True
            read.whole_ops.append(user.opcode)
            _note_relayouts(read, path, user)
        partial += p
        whole = whole or w
    return partial, whole


def _attr(attrs: str, key: str) -> str:
    match = re.search(rf"\b{key}=(\{{[^}}]*\}})", attrs)
    return match.group(1) if match else ""


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.strip("{}").split(",") if x.strip()]


def gather_slices_contiguous(operand_type: str, attrs: str) -> bool:
    """Whether each slice a gather takes is one contiguous run of its operand's memory.

    In the operand's layout (major to minor) the slice must be 1 along the leading dimensions, then
    any size along one, then whole along every dimension after it: `{1,64,32}` of `[16,64,32]` is
    contiguous; `{64,1,32}` of `[64,2,32]` (the expert dimension inside) is 64 separate runs.
    """
    dims = array_dims(operand_type)
    sizes = _int_list(_attr(attrs, "slice_sizes"))
    if len(sizes) != len(dims):
        raise ValueError(f"gather slice_sizes {sizes} do not match its operand {operand_type}")
    layout = re.search(r"\]\{([\d,]*)", operand_type)
    minor_to_major = _int_list(layout.group(1)) if layout and layout.group(1) else list(reversed(range(len(dims))))
    started = False  # past the leading 1s: every dimension from the next one on must be whole
    for d in reversed(minor_to_major):  # major to minor
        if started and sizes[d] != dims[d]:
            return False
        if sizes[d] != 1:
            started = True
    return True


def _note_relayouts(read: ParamRead, path: tuple[Instruction, ...], user: Instruction) -> None:
    for r in path:
        note = f"{r.opcode} %{r.name} -> {user.opcode} %{user.name}"
        if note not in read.relayouts:
            read.relayouts.append(note)


# ---- lowering the decode graphs (needs torch_xla) ------------------------------------------------

WEIGHT, EXPERT, BUFFER, KV = "weight", "expert", "buffer", "kv"
INPUT, CONSTANT = "input", "constant"
RANK = "rank"  # the rank graph's int32 rank parameter: its identity, not a model weight
RANK_PARAM = "spmd_rank.rank"


class XlaLoweringCollectives:
    """Collectives for *lowering* one rank's graph under torch_xla, never for running it.

    `all_reduce` and `all_gather` emit XLA's own `all-reduce` / `all-gather` ops over the replica
    group {0..tp-1}, with the shapes a real rank sees (an all-gather multiplies its dimension by
    `tp`), so the HLO is the one a TP compiler receives. On this one-device CPU client the graph
    cannot execute (XLA:CPU would wait for ranks that do not exist); only its HLO text is taken.
    `xm.all_reduce` is a no-op clone in a one-device world unless ``XLA_ALWAYS_ALLREDUCE`` is set:
    it is set around each call.
    """

    def __init__(self, tp: int):
        self.world_size = tp
        self.groups = [list(range(tp))]

    def all_reduce(self, x):
        import torch_xla.core.xla_model as xm

        with _env("XLA_ALWAYS_ALLREDUCE", "1"):
            return xm.all_reduce(xm.REDUCE_SUM, x, groups=self.groups)

    def all_gather(self, x, dim: int):
        import torch_xla.core.xla_model as xm

        # pin_layout=False: the direct all-gather op (the pinned form is emulated with all-reduce)
        return xm.all_gather(x, dim % x.dim(), groups=self.groups, pin_layout=False)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@dataclass
class GraphAudit:
    """One lowered decode graph: its HLO parameters, named and sorted by role."""

    label: str
    params: list[ParamRead]
    roles: list[str]  # per parameter: weight | expert | rank | buffer | kv | input | constant
    names: list[str | None]  # the module's name for it, where it has one
    hlo_text: str = ""
    returned: int = 0  # bytes of the outputs that go to the host (all but the K/V, which stay)
    kv_written: int = 0  # bytes one execution writes into the K/V buffers (`kv_bytes_written`)

    def read(self, *roles: str) -> int:
        return sum(p.read_bytes for p, r in zip(self.params, self.roles, strict=True) if r in roles)

    def size(self, *roles: str) -> int:
        return sum(p.bytes for p, r in zip(self.params, self.roles, strict=True) if r in roles)

    def flagged(self, *roles: str) -> list[str]:
        """Names of the flagged parameters (of `roles`, or all)."""
        return [
            n or p.name
            for p, r, n in zip(self.params, self.roles, self.names, strict=True)
            if p.flagged and (not roles or r in roles)
        ]


def audit_graph(graph: Any, inputs: Sequence[Any], kv: Sequence[Any], label: str) -> GraphAudit:
    """Trace `graph(*inputs, *kv)` on the XLA device (`graph` and tensors already there) and audit
    the HLO of its outputs; nothing is executed."""
    import torch
    import torch_xla

    device = str(inputs[0].device)
    _reset_collective_token(device)
    with torch.no_grad():
        outputs = graph(*inputs, *kv)
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    text = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    _reset_collective_token(device)
    # the graph's device data, in the order the lowering made them entry parameters
    ids, tensors = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs)
    params = audit_hlo(text)
    if len(params) != len(ids):
        raise RuntimeError(f"{label}: {len(params)} HLO parameters but {len(ids)} device data")
    for p, t in zip(params, tensors, strict=True):  # the order must agree, or every name below is wrong
        if p.shape != tuple(t.shape):
            raise RuntimeError(f"{label}: parameter {p.number} is {p.type}, device data {tuple(t.shape)}")
    tensor_id = torch_xla._XLAC._xla_get_tensor_id
    known: dict[int, tuple[str, str]] = {}
    for name, t in graph.named_parameters():
        role = RANK if name == RANK_PARAM else EXPERT if ".experts." in name else WEIGHT
        known[tensor_id(t)] = (role, name)
    for name, t in graph.named_buffers():
        known.setdefault(tensor_id(t), (BUFFER, name))
    for i, t in enumerate(kv):
        known[tensor_id(t)] = (KV, f"kv[{i}]")
    for i, t in enumerate(inputs):
        known[tensor_id(t)] = (INPUT, f"input[{i}]")
    roles, names = [], []
    for i in ids:
        role, name = known.get(i, (CONSTANT, None))
        roles.append(role)
        names.append(name)
    # the functional graph returns its K/V after the rest; the draft graph reads them and returns none
    kv_outputs = len(kv) if getattr(graph, "writes_kv", True) else 0
    host = outputs[: len(outputs) - kv_outputs]
    returned = sum(t.numel() * t.element_size() for t in host)
    written = kv_bytes_written(text, range(len(host), len(outputs))) if kv_outputs else 0
    return GraphAudit(label, params, roles, names, text, returned, written)


# what an in-place update writes: the operand that holds its new values, by opcode
WRITE_OPS = {"scatter": 2, "dynamic-update-slice": 1}


def kv_bytes_written(hlo_text: str, outputs: Sequence[int]) -> int:
    """Bytes one execution writes into the buffers returned at root-tuple positions `outputs` (the
    K/V, aliased to their inputs on the device): an output that is a chain of scatters or
    dynamic-update-slices (through reshapes and identity transposes) back to an entry parameter
    writes their updates; any other output rewrites its whole buffer."""
    instructions = entry_instructions(hlo_text)
    by_name = {ins.name: ins for ins in instructions}
    root = next(ins for ins in instructions if ins.root)
    total = 0
    for position in outputs:
        out = ins = by_name[root.operands[position]]
        written = 0
        while ins.opcode in VIEW_OPS or ins.opcode in WRITE_OPS or _identity(ins):
            if ins.opcode in WRITE_OPS:
                written += type_bytes(by_name[ins.operands[WRITE_OPS[ins.opcode]]].type)
            ins = by_name[ins.operands[0]]
        total += written if ins.opcode == "parameter" else type_bytes(out.type)
    return total


def _identity(ins: Instruction) -> bool:
    """A transpose that keeps every dimension where it is (torch_xla emits them): a view."""
    dims = _int_list(_attr(ins.attrs, "dimensions")) if ins.opcode == "transpose" else None
    return dims is not None and dims == list(range(len(dims)))


def _reset_collective_token(device: str) -> None:
    """Forget the device's pending collective token.

    torch_xla orders collectives by threading a token from each one into the next, and drops it
    only at `torch_xla.sync()`. A lowered-only rank graph is never synced (it cannot run here),
    so without this the next graph's first collective would hang off the previous graph's last
    one, and its HLO would contain both graphs (what `torch_xla.sync()` does, minus running)."""
    import torch_xla

    torch_xla._XLAC._set_all_reduce_token(device, None)


# ---- the variants: decode graphs next to the roofline --------------------------------------------

CONTEXT = 64  # the lane's context length (xla_check.run_variant)
# (variant, expert form): every variant's decode graph, the MoE in both expert forms (`Variant.expert_forms`)
SINGLE = tuple((v.name, form) for v in VARIANTS.values() for form in v.expert_forms)
# (variant, TP, expert form, expert split), from `Variant.audit_tp`: the MoE rank graphs in both
# splits. The intermediate split (each rank a 1/tp slice of every expert; the plan's default) must
# read k / num_experts of a rank's expert bytes when selective; the expert split (E/tp whole experts
# per rank) reads k whole-expert slices per rank, routed there or not.
TENSOR_PARALLEL = tuple((v.name, *row) for v in VARIANTS.values() for row in v.audit_tp)
# (variant, expert form, drafts k): drafting's verify graph (k + 1 tokens) next to
# `mtp_roofline.verify_bytes`; form None: the one drafting picks (`drafting.verify_expert_form`:
# the tiny MoE's 16 experts, top 4, gather fewer bytes than dense at k = 2, more at k = 4)
VERIFY = (
    (next(v.name for v in VARIANTS.values() if not v.is_moe), None, 4),
    *((v.name, form, k) for v in VARIANTS.values() if v.is_moe for form, k in ((None, 4), ("selective", 4), (None, 2))),
)
VERIFY_DRAFTS = 4
# every variant's decode that returns token ids (`GraphSet.decode_ids`), at B = 1 and 4: at most this
# many bytes a row may go to the host (issue 46: a greedy step returns <= 16 bytes a row)
CHOOSES = tuple((v.name, batch) for v in VARIANTS.values() for batch in (1, 4))
IDS_BYTES_PER_ROW = 16


@dataclass
class AuditRow:
    """One decode graph's audited bytes next to the roofline's, for the table and the tests.

    For a rank graph every rank runs the same program on same-shaped weights, so the ranks
    together read `tp` x one rank's bytes. `roofline.decode_bytes(tp=, expert_split=)` counts the
    model once (selective experts: k routed experts' bytes under the intermediate split, `tp` x k
    whole-expert slices under the expert split): what the plan *replicates* — norms,
    router, PLE projections, `layer_scalar`, K/V heads when there are fewer than ranks, the LM
    head when the vocabulary does not divide by `tp` (the tiny models' 810) — is read by every
    rank and is the expected difference, `replicated` (from the rank graph's own parameter sizes,
    not from the HLO). Single device: `replicated` is 0. The rank tensor is not a weight: it is
    counted with the inputs, under `other_read`.

    One known difference, `expected_delta`: the MoE router's `per_expert_scale` [E] is read by a
    gather of the k routed entries (transformers' `per_expert_scale[top_k_index]`), while the
    roofline counts it whole with the router: -(E - k) x dtype bytes per MoE layer, on every rank.
    It is computed from the model's parameters, not from the HLO.
    """

    variant: str
    form: str
    tp: int
    rank: int | None  # the rank lowered (None: the single-device graph)
    hlo_params: int
    weights_read: int  # one rank (or the device): weight + expert parameters
    experts_read: int
    experts_size: int
    kv_read: int
    other_read: int  # rank tensor, buffers (rotary tables, HF's layer_scalar), inputs, constants
    roofline_weights: float  # decode_bytes(...).weights: all ranks together
    roofline_kv: float
    replicated_weights: int
    replicated_kv: int
    expected_delta: int
    flagged: list[str]
    flagged_experts: list[str]
    expert_split: str | None = None  # MoE rank graphs: "intermediate" | "experts"
    batch: int = 1  # rows of the decode graph (its `GraphShape.batch`)
    tokens: int = 1  # query tokens: 1 for decode, k + 1 for drafting's verify graph (`audit_verify`)
    read_form: str | None = None  # the expert form the graph runs, when a batch changes it (`experts.read_form`)
    returned: int = 0  # bytes one call returns to the host (`GraphAudit.returned`)
    chooses: bool = False  # the decode that returns token ids (`DeviceGraph.chooses`)

    @property
    def weights_delta(self) -> float:
        return self.tp * self.weights_read - self.roofline_weights - self.replicated_weights

    @property
    def kv_delta(self) -> float:
        return self.tp * self.kv_read - self.roofline_kv - self.replicated_kv

    @property
    def ok(self) -> bool:
        return (
            self.weights_delta == self.expected_delta
            and self.kv_delta == 0
            and not (self.form == "selective" and self.flagged_experts)
            and (not self.chooses or self.returned <= IDS_BYTES_PER_ROW * self.batch)
        )

    @property
    def graph(self) -> str:
        rows = "" if self.batch == 1 else f", batch {self.batch}"
        if self.rank is not None:
            return f"rank {self.rank} of TP={self.tp}{rows}"
        if self.tokens > 1:
            return f"verify, {self.tokens} tokens"
        return f"decode{' → ids' if self.chooses else ''}{rows}"


def router_scale_unread(model: Any, rows: int = 1) -> int:
    """Bytes of the routers' `per_expert_scale` vectors a decode step does not read: it gathers
    the k routed entries of each (E - k unread per MoE layer; `rows` rows of a batch gather k each,
    E - rows x k, negative once the gathers read more entries than the vector holds). 0 for a dense model."""
    top_k = int(getattr(model.config, "top_k_experts", 0) or 0) * int(rows)
    return sum(
        (p.numel() - top_k) * p.element_size()
        for n, p in model.lm.named_parameters()
        if n.endswith("router.per_expert_scale")
    )


def _tiny(variant: str):
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant

    v = get_variant(variant)
    return build_tiny(v, seed=v.tiny_seed)


def audit_single(
    model: Any, form: str = "dense", device: Any = None, batch: int = 1, chooses: bool = False
) -> tuple[GraphAudit, AuditRow]:
    """The single-device decode graph of `model` (a tiny `LoadedModel`), as `port --backend xla`
    builds it (`device_graphs`); `batch` rows: compared with `batch_roofline.batch_decode_bytes`
    (weights once, selective experts per row, K/V per row). `chooses`: the decode that returns each
    row's token (`GraphSet.decode_ids`): the same bytes read, 4 bytes a row returned."""
    from gemma4lab.inf2.roofline import decode_bytes
    from gemma4lib.device.build import device_graphs

    settings = _settings(model, batch_size=batch, decode_experts=form)
    graphs = device_graphs(model, settings, inplace=False, chooses=chooses)
    graph = _lowered(graphs.decode_ids if chooses else graphs.decode, device)
    name = model.variant.name
    at = f", batch {batch}" if batch > 1 else ""
    audit = audit_graph(graph, *_example_inputs(graph), f"{name} decode{' ids' if chooses else ''} ({form}{at})")
    if batch > 1:
        from gemma4lab.inf2.batch_roofline import batch_decode_bytes

        bb = batch_decode_bytes(model, batch, context_length=CONTEXT, ring=False, experts=form)
        weights, kv_bytes = bb["weights"], bb["kv"]
    else:
        rb = decode_bytes(model, context_length=CONTEXT, ring=False, experts=form)
        weights, kv_bytes = rb.weights, rb.kv
    row = _row(name, form, 1, None, audit, weights, kv_bytes, 0, 0, -router_scale_unread(model, batch))
    row.batch, row.chooses = batch, chooses
    row.read_form = graph.experts_read if graph.experts_read != form else None
    return audit, row


def audit_verify(
    model: Any, form: str | None = None, draft_tokens: int = VERIFY_DRAFTS, device: Any = None
) -> tuple[GraphAudit, AuditRow]:
    """Drafting's verify graph of `model` as `device_graphs` builds it for the assistant
    (`DeviceGraph(..., every_position=True, hidden=True)`: k + 1 tokens, logits and hidden states at
    every position, over the drafted K/V layout), next to `mtp_roofline.verify_bytes` for the same
    expert form (`form` None: the one drafting picks, `drafting.verify_expert_form`). The router's
    `per_expert_scale` is gathered for each of the k + 1 tokens (`router_scale_unread` with the
    tokens as rows)."""
    from gemma4lab.inf2.mtp_roofline import verify_bytes
    from gemma4lib.device.build import device_graph
    from gemma4lib.device.drafting import RoomyLayout, verify_expert_form
    from gemma4lib.device.graph import GraphShape

    k = int(draft_tokens)
    form = verify_expert_form(model.config, k, form)
    layout = RoomyLayout.around(model.layout, k + 1)
    shape = GraphShape(1, k + 1, CONTEXT)
    verify = device_graph(model, shape, form, False, layout=layout, every_position=True, hidden=True)
    graph = _lowered(verify, device)
    name = model.variant.name
    audit = audit_graph(graph, *_example_inputs(graph), f"{name} verify ({form}, {k + 1} tokens)")
    dtype_bytes = model.lm_head.weight.element_size()
    kv_bytes = layout.buffer_bytes(CONTEXT, False, dtype_bytes)
    weights = verify_bytes(model.lm, CONTEXT, k, ring=False, dtype_bytes=dtype_bytes, experts=form) - kv_bytes
    row = _row(name, form, 1, None, audit, weights, kv_bytes, 0, 0, -router_scale_unread(model, k + 1))
    row.tokens = k + 1
    return audit, row


def audit_rank(
    model: Any,
    tp: int,
    form: str = "dense",
    rank: int = 1,
    device: Any = None,
    expert_split: str | None = None,
    batch: int = 1,
) -> tuple[GraphAudit, AuditRow]:
    """Rank `rank` of `model`'s TP rank graph (its shard loaded), lowered with
    `XlaLoweringCollectives`. `expert_split`: the MoE split (default: the plan's). `batch` rows:
    compared with `batch_roofline.batch_decode_bytes(tp=)` (all ranks together, as at batch 1)."""
    from gemma4lab.inf2.roofline import decode_bytes
    from gemma4lib.device.graph import GraphShape
    from gemma4lib.inf2.params import count_params
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.rank_graph import build_rank_graph, load_shard
    from gemma4lib.tp.shard import shard_state_dict

    plan = make_plan(model.config, tp, model.variant, expert_split=expert_split)
    shape = GraphShape(batch, 1, CONTEXT)
    graph = build_rank_graph(model.config, plan, shape, collectives=XlaLoweringCollectives(tp), expert_form=form)
    missing = load_shard(graph, shard_state_dict(model.lm, plan, rank))
    if missing:
        raise RuntimeError(f"rank graph has keys its shard lacks: {missing[:5]}")
    # what the ranks replicate: tp x the rank's non-expert weights (all ranks hold the same shapes)
    # minus the model's device-side non-expert weights; K/V likewise against the model's layout
    rank_nonexpert = sum(
        p.numel() * p.element_size() for n, p in graph.named_parameters() if ".experts." not in n and n != RANK_PARAM
    )
    counts = count_params(model.lm)
    dtype_bytes = model.lm_head.weight.element_size()
    replicated = tp * rank_nonexpert - (counts.lm_head + counts.other) * dtype_bytes
    rank_kv = sum(t.numel() * t.element_size() for t in graph.new_kv())
    if batch > 1:
        from gemma4lab.inf2.batch_roofline import batch_decode_bytes

        bb = batch_decode_bytes(
            model, batch, context_length=CONTEXT, ring=False, experts=form, tp=tp, expert_split=plan.expert_split
        )
        roof_weights, roof_kv = bb["weights"], bb["kv"]
    else:
        rb = decode_bytes(
            model, context_length=CONTEXT, ring=False, experts=form, tp=tp, expert_split=plan.expert_split
        )
        roof_weights, roof_kv = rb.weights, rb.kv
    replicated_kv = tp * rank_kv - int(roof_kv)
    read_form = graph.experts_read
    graph = _lowered(graph, device)
    name = model.variant.name
    split = f", {plan.expert_split} split" if plan.expert_split else ""
    audit = audit_graph(graph, *_example_inputs(graph), f"{name} TP={tp} rank {rank} decode ({form}{split})")
    row = _row(
        name,
        form,
        tp,
        rank,
        audit,
        roof_weights,
        roof_kv,
        replicated,
        replicated_kv,
        -tp * router_scale_unread(model, batch),
    )
    row.expert_split, row.batch = plan.expert_split, batch
    row.read_form = read_form if read_form != form else None
    return audit, row


def _settings(model: Any, **fields: Any) -> Any:
    """The xla port's settings of the audited graphs: the lane's context, full-length buffers."""
    from gemma4lib.settings import PortSettings

    return PortSettings(
        variant=model.variant.name,
        backend="xla",
        context_length=CONTEXT,
        prefill_buckets=(CONTEXT,),
        ring_kv=False,
        **fields,
    )


def _lowered(graph: Any, device: Any) -> Any:
    """`graph` on the XLA device (its own copy: the host model stays where it is)."""
    import torch_xla

    from gemma4lib.backends.xla import to_device

    return to_device({"graph": graph}, device or torch_xla.device())["graph"]


def _example_inputs(graph: Any) -> tuple[list[Any], list[Any]]:
    """The graph's example inputs on its device, split before the K/V: embeds, [ple,] start, length."""
    device = next(graph.parameters()).device
    tensors = [t.to(device) for t in graph.example_inputs()]
    return tensors[: graph.num_inputs], tensors[graph.num_inputs :]


def _row(
    variant: str,
    form: str,
    tp: int,
    rank: int | None,
    audit: GraphAudit,
    roof_w: float,
    roof_kv: float,
    replicated: int,
    replicated_kv: int,
    expected_delta: int,
) -> AuditRow:
    return AuditRow(
        variant=variant,
        form=form,
        tp=tp,
        rank=rank,
        hlo_params=len(audit.params),
        weights_read=audit.read(WEIGHT, EXPERT),
        experts_read=audit.read(EXPERT),
        experts_size=audit.size(EXPERT),
        kv_read=audit.read(KV),
        other_read=audit.read(RANK, BUFFER, INPUT, CONSTANT),
        roofline_weights=roof_w,
        roofline_kv=roof_kv,
        replicated_weights=replicated,
        replicated_kv=replicated_kv,
        expected_delta=expected_delta,
        flagged=audit.flagged(),
        flagged_experts=audit.flagged(EXPERT),
        returned=audit.returned,
    )


def audit_all(
    single: Sequence[tuple[str, str]] = SINGLE,
    tensor_parallel: Sequence[tuple[str, int, str, str | None]] = TENSOR_PARALLEL,
    verify: Sequence[tuple[str, str | None, int]] = VERIFY,
    chooses: Sequence[tuple[str, int]] = CHOOSES,
) -> list[AuditRow]:
    """Every listed decode graph of the tiny variants, and drafting's verify graphs, audited (one
    tiny model per variant)."""
    models: dict[str, Any] = {}
    rows = []
    for variant, form in single:
        model = models.setdefault(variant, _tiny(variant))
        rows.append(audit_single(model, form)[1])
        log.info("audited %s %s: %s", variant, form, rows[-1])
    for variant, tp, form, split in tensor_parallel:
        model = models.setdefault(variant, _tiny(variant))
        rows.append(audit_rank(model, tp, form, expert_split=split)[1])
        log.info("audited %s TP=%d %s (%s split): %s", variant, tp, form, split, rows[-1])
    for variant, form, k in verify:
        model = models.setdefault(variant, _tiny(variant))
        rows.append(audit_verify(model, form, k)[1])
        log.info("audited %s verify %s: %s", variant, form, rows[-1])
    for variant, batch in chooses:
        model = models.setdefault(variant, _tiny(variant))
        rows.append(audit_single(model, VARIANTS[variant].expert_forms[0], batch=batch, chooses=True)[1])
        log.info("audited %s decode -> ids, batch %d: %s", variant, batch, rows[-1])
    return rows


def format_table(rows: Sequence[AuditRow]) -> str:
    """Markdown: per decode graph, the bytes its HLO reads next to `roofline.decode_bytes` (tiny
    fp32 models; a rank graph's "x TP" is all ranks together, as the roofline counts them)."""
    head = (
        "| variant | graph | experts | HLO params | weights read | x TP | roofline weights "
        "| replicated | Δ (expected) | expert weights read / held | K/V read | x TP "
        "| roofline K/V (+ replicated) | other read | returned to host | flagged re-layouts |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        experts = f"{r.experts_read:,} / {r.experts_size:,}" if r.experts_size else "–"
        form = r.form if r.experts_size else "–"
        if r.experts_size and r.read_form:
            form += f" (reads {r.read_form})"
        if r.experts_size and r.expert_split:
            form += f", {'expert' if r.expert_split == 'experts' else r.expert_split} split"
        lines.append(
            f"| {r.variant} | {r.graph} | {form} | {r.hlo_params} "
            f"| {r.weights_read:,} | {r.tp * r.weights_read:,} | {r.roofline_weights:,.0f} "
            f"| {r.replicated_weights:,} | {r.weights_delta:,.0f} ({r.expected_delta:,}) "
            f"| {experts} | {r.kv_read:,} | {r.tp * r.kv_read:,} "
            f"| {r.roofline_kv:,.0f} (+ {r.replicated_kv:,}) | {r.other_read:,} | {r.returned:,} "
            f"| {_names(r.flagged)} |"
        )
    return "\n".join(lines)


def _names(names: Sequence[str], shown: int = 2) -> str:
    if not names:
        return "none"
    more = f" (+{len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemma4lab.tools.hlo_audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true", help="log each graph's row")
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="also audit every decode graph (single-device and ranks) at this batch size",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch

    torch.set_num_threads(1)
    rows = audit_all()
    if args.batch > 1:
        models: dict[str, Any] = {}
        for variant, form in SINGLE:
            rows.append(audit_single(models.setdefault(variant, _tiny(variant)), form, batch=args.batch)[1])
        for variant, tp, form, split in TENSOR_PARALLEL:
            model = models.setdefault(variant, _tiny(variant))
            rows.append(audit_rank(model, tp, form, expert_split=split, batch=args.batch)[1])
    sys.stdout.write(format_table(rows) + "\n")
    bad = [r for r in rows if not r.ok]
    for r in bad:
        log.error(
            "%s %s (%s): weights Δ %s, K/V Δ %s, flagged experts %s",
            r.variant,
            r.graph,
            r.form,
            r.weights_delta,
            r.kv_delta,
            r.flagged_experts,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
