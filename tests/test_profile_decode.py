"""The decode profile's kernel kinds (benchmarks/profile_decode.py): the names AOTInductor's kernels
and extern calls record under, sorted into the table's kinds. Figures only in the recorded JSON."""

from __future__ import annotations

from gemma4lab.benchmarks.profile_decode import KINDS, classify, format_kinds


def test_kernel_names_fall_in_their_kinds():
    assert classify("aoti_torch_cpu_mm_out") == "matmul"
    assert classify("aoti_torch_cpu__linear_pointwise") == classify("mkldnn::_linear_pointwise") == "matmul"
    # a fused kernel that reads a packed product's output is named after it, but is not a product
    assert classify("graph_1_cpp_fused__linear_pointwise_add_index_put_mean_mul_pow_remainder_5") == "kv_writes"
    assert classify("aoti_torch_cpu_bmm_out") == "attention"
    assert classify("graph_0_cpp_fused__softmax__unsafe_view_add_arange_bitwise_and_3") == "attention"
    assert classify("graph_1_cpp_fused__unsafe_view_add_index_put_mean_mul_pow_remainder_7") == "kv_writes"
    assert classify("graph_1_cpp_fused_add_cat_expand_mean_scatter_transpose_2") == "kv_writes"
    assert classify("graph_0_cpp_fused__unsafe_view_add_mean_mul_pow_5") == "norms_elementwise"
    assert classify("aten::clone") == classify("aten::empty_like") == "copies"
    assert classify("something_else") == "overhead"


def test_the_table_has_one_line_per_kind():
    rows = [
        {"kind": k, "ms_per_step": 1.0, "calls_per_step": 2, "bytes_per_step": 0, "gb_s": None, "share_of_gap": 0.1}
        for k in KINDS
    ]
    report = {"model": "m", "graph": "decode", "wall_ms_per_step": 6.0, "tok_s_total": 1.0, "stream_floor_ms": 5.0}
    table = format_kinds({**report, "gap_ms": 1.0, "kinds": rows})
    assert all(f"| {k} |" in table for k in KINDS) and "gap 1.0 ms" in table
