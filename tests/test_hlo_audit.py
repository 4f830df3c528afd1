"""The HLO byte audit's parser and rules, on small hand-written HLO (no torch_xla needed).

The lowered graphs themselves are audited in the XLA lane (`tests/test_xla_lane.py`).
"""

from __future__ import annotations

import pytest

from gemma4lab.tools.hlo_audit import (
    AuditRow,
    array_dims,
    audit_hlo,
    entry_instructions,
    format_table,
    gather_slices_contiguous,
    kv_bytes_written,
    parse_instruction,
    type_bytes,
)


def module(body: str, params: str = "") -> str:
    """An HLO module with a scalar add computation (as torch_xla emits them) and `body` as ENTRY."""
    return f"""HloModule IrToHlo.99, entry_computation_layout={{()->()}}

%AddComputation.5 (x.6: f32[], y.7: f32[]) -> f32[] {{
  %x.6 = f32[] parameter(0)
  %y.7 = f32[] parameter(1)
  ROOT %add.8 = f32[] add(f32[] %x.6, f32[] %y.7)
}}

ENTRY %IrToHlo.99 ({params}) -> f32[] {{
{body}
}}
"""


def by_number(text: str, **kwargs):
    return {p.number: p for p in audit_hlo(text, **kwargs)}


def test_types_and_sizes():
    assert type_bytes("f32[16,64,32]{2,1,0}") == 16 * 64 * 32 * 4
    assert type_bytes("bf16[3,5]{1,0}") == 30
    assert type_bytes("pred[7]{0}") == 7
    assert type_bytes("s64[]") == 8
    assert type_bytes("(f32[1,1,64]{2,1,0}, f32[])") == 64 * 4 + 4
    assert type_bytes("f32[<=10,2]{1,0}") == 80  # a bounded dynamic dim counts at its bound
    assert array_dims("f32[2,3]{1,0}") == (2, 3) and array_dims("f32[]") == ()
    with pytest.raises(ValueError, match="element type"):
        type_bytes("q7[2]")


def test_parse_instruction_with_tuples_comments_and_attributes():
    ins = parse_instruction(
        "  ROOT %tuple.9 = (f32[2]{0}, /*index=1*/f32[2,3]{1,0}) tuple(f32[2]{0} %r.3, /*index=1*/f32[2,3]{1,0} %p0.1)"
    )
    assert (ins.name, ins.opcode, ins.root) == ("tuple.9", "tuple", True)
    assert ins.operands == ("r.3", "p0.1")
    ins = parse_instruction(
        "  %gather.7 = f32[4,64,32]{2,1,0} gather(f32[16,64,32]{2,1,0} %p0.1, "
        "s64[4,1]{1,0} %c.2), offset_dims={1,2}, collapsed_slice_dims={0}, "
        "start_index_map={0}, index_vector_dim=1, slice_sizes={1,64,32}"
    )
    assert ins.opcode == "gather" and ins.operands == ("p0.1", "c.2")
    assert ins.attrs.startswith("offset_dims={1,2}") and ins.type == "f32[4,64,32]{2,1,0}"
    ins = parse_instruction("  %p3.12 = f32[8,64]{1,0} parameter(3)")
    assert ins.parameter_number == 3
    # an all-reduce whose to_apply names a computation: not an operand
    ins = parse_instruction(
        "  %all-reduce.4 = (f32[1,64]{1,0}, f32[]) all-reduce("
        "f32[1,64]{1,0} %a.1, f32[] %t.2), replica_groups={{0,1}}, "
        "constrain_layout=true, "
        "to_apply=%AddComputation.5"
    )
    assert ins.opcode == "all-reduce" and ins.operands == ("a.1", "t.2")
    assert parse_instruction("}") is None and parse_instruction("") is None


def test_only_the_entry_computation_counts():
    text = module("  %p0.1 = f32[4]{0} parameter(0)\n  ROOT %n.2 = f32[4]{0} negate(f32[4]{0} %p0.1)", "p0.1: f32[4]")
    names = [i.name for i in entry_instructions(text)]
    assert names == ["p0.1", "n.2"]  # the add computation's parameters are not entry parameters
    with pytest.raises(ValueError, match="ENTRY"):
        entry_instructions("HloModule m\n")


def test_gather_straight_from_a_parameter_reads_the_gathered_slices():
    """The single-device selective experts, as the lane's HLO shows them."""
    text = module("""\
  %p0.1 = f32[16,64,32]{2,1,0} parameter(0)
  %p1.2 = s64[4,1]{1,0} parameter(1)
  ROOT %gather.3 = f32[4,64,32]{2,1,0} gather(f32[16,64,32]{2,1,0} %p0.1, s64[4,1]{1,0} %p1.2), \
offset_dims={1,2}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, \
slice_sizes={1,64,32}""")
    p = by_number(text)
    assert p[0].bytes == 16 * 64 * 32 * 4
    assert p[0].read_bytes == 4 * 64 * 32 * 4 and not p[0].flagged
    assert p[0].partial_ops == ["gather f32[4,64,32]"]
    assert p[1].read_bytes == p[1].bytes == 32  # the indices: read whole (gather operand 1)


def test_reshape_before_gather_is_still_a_partial_read():
    """A row-parallel shard seen per expert through a view: reshape moves no bytes."""
    text = module("""\
  %p0.1 = f32[64,64]{1,0} parameter(0)
  %p1.2 = s64[4,1]{1,0} parameter(1)
  %reshape.3 = f32[2,32,64]{2,1,0} reshape(f32[64,64]{1,0} %p0.1)
  ROOT %gather.4 = f32[4,32,64]{2,1,0} gather(f32[2,32,64]{2,1,0} %reshape.3, \
s64[4,1]{1,0} %p1.2), offset_dims={1,2}, collapsed_slice_dims={0}, start_index_map={0}, \
index_vector_dim=1, slice_sizes={1,32,64}""")
    p = by_number(text)[0]
    # k=4 slices of a 2-expert shard: the gather reads 4 slices (repeats count), more than held
    assert p.read_bytes == 4 * 32 * 64 * 4 > p.bytes and not p.flagged


def test_transpose_of_a_whole_parameter_before_a_gather_is_flagged():
    """The rank graph's old down-projection gather: view + permute, then gather (torch_xla wrote
    `transpose(reshape(param))` with a permuted layout)."""
    text = module("""\
  %p0.1 = f32[64,64]{1,0} parameter(0)
  %p1.2 = s64[4,1]{1,0} parameter(1)
  %reshape.3 = f32[64,2,32]{2,1,0} reshape(f32[64,64]{1,0} %p0.1)
  %transpose.4 = f32[2,64,32]{2,0,1} transpose(f32[64,2,32]{2,1,0} %reshape.3), dimensions={1,0,2}
  ROOT %gather.5 = f32[4,64,32]{2,1,0} gather(f32[2,64,32]{2,0,1} %transpose.4, \
s64[4,1]{1,0} %p1.2), offset_dims={1,2}, collapsed_slice_dims={0}, start_index_map={0}, \
index_vector_dim=1, slice_sizes={1,64,32}""")
    p = by_number(text)[0]
    assert p.flagged and p.read_bytes == p.bytes
    assert p.relayouts == ["transpose %transpose.4 -> gather %gather.5"]


@pytest.mark.parametrize(
    "operand,slices,contiguous",
    [
        ("f32[16,64,32]{2,1,0}", "{1,64,32}", True),  # one expert of [E, H, I]
        ("f32[128,32]{1,0}", "{1,32}", True),  # one row
        ("f32[16]{0}", "{1}", True),
        ("f32[8,4]{1,0}", "{2,4}", True),  # two whole rows
        ("f32[8,4]{1,0}", "{2,2}", False),
        ("f32[64,2,32]{2,1,0}", "{64,1,32}", False),  # one expert of [H, E, I]: 64 runs
        ("f32[2,64,32]{2,0,1}", "{1,64,32}", False),  # the same, as a permuted layout
        ("f32[4,1,8]", "{1,1,8}", True),  # no layout written: row-major
    ],
)
def test_gather_slice_contiguity(operand, slices, contiguous):
    attrs = f"offset_dims={{1}}, slice_sizes={slices}"
    assert gather_slices_contiguous(operand, attrs) is contiguous


def test_gather_along_an_inner_dimension_is_flagged():
    """`w.view(H, E, I)[:, ids]`: XLA transposes the whole weight to canonicalise this gather."""
    text = module("""\
  %p0.1 = f32[64,64]{1,0} parameter(0)
  %p1.2 = s64[4,1]{1,0} parameter(1)
  %reshape.3 = f32[64,2,32]{2,1,0} reshape(f32[64,64]{1,0} %p0.1)
  ROOT %gather.4 = f32[64,4,32]{2,1,0} gather(f32[64,2,32]{2,1,0} %reshape.3, \
s64[4,1]{1,0} %p1.2), offset_dims={0,2}, collapsed_slice_dims={1}, start_index_map={1}, \
index_vector_dim=1, slice_sizes={64,1,32}""")
    p = by_number(text)[0]
    assert p.flagged and p.read_bytes == p.bytes and p.relayouts == []
    assert p.strided_gathers == ["gather %gather.4 of f32[64,2,32]{2,1,0}: {64,1,32}"]


def test_transpose_into_a_dot_is_folded_not_flagged():
    """torch_xla writes every F.linear weight as transpose + dot."""
    text = module("""\
  %p0.1 = f32[8,64]{1,0} parameter(0)
  %p1.2 = f32[1,64]{1,0} parameter(1)
  %transpose.3 = f32[64,8]{0,1} transpose(f32[8,64]{1,0} %p0.1), dimensions={1,0}
  ROOT %dot.4 = f32[1,8]{1,0} dot(f32[1,64]{1,0} %p1.2, f32[64,8]{0,1} %transpose.3), \
lhs_contracting_dims={1}, rhs_contracting_dims={0}""")
    p = by_number(text)
    assert p[0].read_bytes == p[0].bytes and not p[0].flagged and p[0].whole_ops == ["dot"]
    assert p[1].read_bytes == p[1].bytes


def test_copy_into_anything_but_a_dot_is_flagged_above_the_size_floor():
    body = """\
  %p0.1 = f32[64,64]{1,0} parameter(0)
  %p1.2 = f32[2,2]{1,0} parameter(1)
  %copy.3 = f32[64,64]{0,1} copy(f32[64,64]{1,0} %p0.1)
  %t.4 = f32[2,2]{1,0} transpose(f32[2,2]{1,0} %p1.2), dimensions={1,0}
  %n.5 = f32[2,2]{1,0} negate(f32[2,2]{1,0} %t.4)
  ROOT %a.6 = f32[64,64]{1,0} add(f32[64,64]{0,1} %copy.3, f32[64,64]{0,1} %copy.3)"""
    p = by_number(module(body))
    assert p[0].flagged and p[0].read_bytes == p[0].bytes
    assert not p[1].flagged and p[1].relayouts  # re-laid out, but 16 bytes: below the floor
    assert by_number(module(body), min_flag_bytes=16)[1].flagged


def test_whole_use_wins_and_partial_uses_add_up():
    text = module("""\
  %p0.1 = f32[10,8]{1,0} parameter(0)
  %p1.2 = f32[10,8]{1,0} parameter(1)
  %p2.3 = s64[] parameter(2)
  %p3.4 = f32[10,8]{1,0} parameter(3)
  %c.5 = s64[] constant(0)
  %ds.6 = f32[2,8]{1,0} dynamic-slice(f32[10,8]{1,0} %p0.1, s64[] %p2.3, s64[] %c.5), \
dynamic_slice_sizes={2,8}
  %sl.7 = f32[3,8]{1,0} slice(f32[10,8]{1,0} %p0.1), slice={[0:3], [0:8]}
  %sl.8 = f32[1,8]{1,0} slice(f32[10,8]{1,0} %p1.2), slice={[0:1], [0:8]}
  %b.9 = f32[10,8]{1,0} negate(f32[10,8]{1,0} %p1.2)
  ROOT %t.10 = (f32[2,8]{1,0}, f32[3,8]{1,0}, f32[1,8]{1,0}, f32[10,8]{1,0}) \
tuple(f32[2,8]{1,0} %ds.6, f32[3,8]{1,0} %sl.7, f32[1,8]{1,0} %sl.8, f32[10,8]{1,0} %b.9)""")
    p = by_number(text)
    assert p[0].read_bytes == (2 + 3) * 8 * 4  # two partial reads
    assert p[1].read_bytes == p[1].bytes  # one partial, one whole: whole
    assert p[3].read_bytes == 0 and p[3].whole_ops == []  # an unused parameter reads nothing


def test_dynamic_update_slice_into_a_kv_buffer_reads_none_of_it():
    """An in-place update of a K/V buffer (decode's write) is state handed back, not a read of it."""
    text = module("""\
  %p0.1 = f32[1,1,64,8]{3,2,1,0} parameter(0)
  %p1.2 = f32[1,1,1,8]{3,2,1,0} parameter(1)
  %p2.3 = s64[] parameter(2)
  %c.4 = s64[] constant(0)
  ROOT %dus.5 = f32[1,1,64,8]{3,2,1,0} dynamic-update-slice(f32[1,1,64,8]{3,2,1,0} %p0.1, \
f32[1,1,1,8]{3,2,1,0} %p1.2, s64[] %c.4, s64[] %c.4, s64[] %p2.3, s64[] %c.4)""")
    p = by_number(text)[0]
    assert p.bytes == 64 * 8 * 4 and p.read_bytes == 0 and not p.flagged


def row(**overrides) -> AuditRow:
    base = dict(
        variant="26b-a4b",
        form="selective",
        tp=2,
        rank=1,
        hlo_params=10,
        weights_read=100,
        experts_read=40,
        experts_size=80,
        kv_read=8,
        other_read=4,
        roofline_weights=180.0,
        roofline_kv=16.0,
        replicated_weights=24,
        replicated_kv=0,
        expected_delta=-4,
        flagged=[],
        flagged_experts=[],
    )
    base.update(overrides)
    return AuditRow(**base)


def test_audit_row_compares_rank_sums_with_the_roofline():
    good = row()
    assert good.weights_delta == 2 * 100 - 180 - 24 == -4 and good.kv_delta == 0 and good.ok
    assert not row(weights_read=101).ok  # one byte more than the roofline explains
    assert not row(kv_read=9).ok
    flagged = row(
        flagged=["model.layers.0.experts.down.weight"], flagged_experts=["model.layers.0.experts.down.weight"]
    )
    assert not flagged.ok
    # the dense form reads every expert weight anyway: a re-layout there is not the selective bug
    assert row(form="dense", flagged=["x"], flagged_experts=["x"]).ok
    table = format_table([good, row(tp=1, rank=None, replicated_weights=0, weights_read=176)])
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "rank 1 of TP=2" in lines[2] and "| decode |" in lines[3]


def test_audit_table_names_the_expert_split():
    """The MoE rank graphs are audited in both splits; the table says which one a row is."""
    inner = row(expert_split="intermediate", experts_read=20)
    whole = row(expert_split="experts")
    lines = format_table([inner, whole, row(expert_split=None)]).splitlines()
    assert "| selective, intermediate split |" in lines[2]
    assert "| selective, expert split |" in lines[3]
    assert "| selective |" in lines[4]
    from gemma4lab.tools.hlo_audit import TENSOR_PARALLEL

    moe = {(tp, form, split) for variant, tp, form, split in TENSOR_PARALLEL if variant == "26b-a4b"}
    assert {(tp, form, "intermediate") for tp in (2, 8) for form in ("dense", "selective")} <= moe
    assert (8, "selective", "experts") in moe  # the first form stays audited next to it


def test_kv_bytes_written_counts_a_scatters_updates_and_a_rewrite_whole():
    """Output 1 is a scatter of 8 x 16 floats into parameter 0 behind an identity transpose: it writes
    its updates; output 2 is a select over all of parameter 1: it rewrites the buffer; output 0 (the
    logits) is not asked about."""
    kv, up = "f32[3,1,64,16]", "f32[1,1,8,16]"
    body = f"""  %p0 = {kv} parameter(0)
  %p1 = {kv} parameter(1)
  %i = s64[1,1,8,3] parameter(2)
  %u = {up} parameter(3)
  %m = pred[3,1,64,16] parameter(4)
  %s = {kv} scatter({kv} %p0, s64[1,1,8,3] %i, {up} %u), update_window_dims={{3}}, to_apply=%AddComputation.5
  %t = {kv} transpose({kv} %s), dimensions={{0,1,2,3}}
  %w = {kv} select(pred[3,1,64,16] %m, {kv} %p1, {kv} %p0)
  ROOT %out = ({up}, {kv}, {kv}) tuple({up} %u, {kv} %t, {kv} %w)"""
    text = module(body)
    assert kv_bytes_written(text, [1]) == 8 * 16 * 4
    assert kv_bytes_written(text, [2]) == 3 * 64 * 16 * 4
    assert kv_bytes_written(text, [1, 2]) == 8 * 16 * 4 + 3 * 64 * 16 * 4
