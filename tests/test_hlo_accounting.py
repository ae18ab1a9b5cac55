"""The H100 static profile's instrument (jaxpaged/static_profile/): launch, copy and byte accounting of
optimized HLO text, the thunk-sequence cross-check and the occupancy arithmetic.

The first tests read hand-written HLO whose every launch and byte is known, so they run in
milliseconds with nothing but the standard library. The last compiles a real program for an H100
in a child process and is skipped when the toolchain (scripts/install_h100_toolchain.sh) is absent.
"""

import json
import subprocess
import sys

import pytest

from jaxpaged.static_profile.hlo_accounting import BufferOverride, account
from jaxpaged.static_profile.ptxas_report import occupancy
from jaxpaged.static_profile.target import H100, h100_env, toolchain_dir
from jaxpaged.static_profile.thunks import count_thunks, parse_thunk_metadata, parse_thunk_sequence

F32 = 4
X = 128 * 256 * F32  # bytes of one f32[128,256]

# A loop of 5 known trips over (i, x, w, acc): per trip two fusions (x*w, then a row sum), a copy of
# the product back into the carry and the induction-variable increment. Before it, a fill of acc
# with zeros.
LOOP_HLO = """HloModule loop, is_scheduled=true

%fused_mul (p0: f32[128,256], p1: f32[128,256]) -> f32[128,256] {
  %p0 = f32[128,256]{1,0} parameter(0)
  %p1 = f32[128,256]{1,0} parameter(1)
  ROOT %m = f32[128,256]{1,0} multiply(%p0, %p1)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_sum (q0: f32[128,256]) -> f32[128] {
  %q0 = f32[128,256]{1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %r = f32[128]{0} reduce(%q0, %zero), dimensions={1}, to_apply=%add
}

%fused_inc (i0: s32[]) -> s32[] {
  %i0 = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %n = s32[] add(%i0, %one)
}

%fused_fill () -> f32[128] {
  %c = f32[] constant(0)
  ROOT %b = f32[128]{0} broadcast(%c), dimensions={}
}

%fused_lt (c0: s32[]) -> pred[] {
  %c0 = s32[] parameter(0)
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%c0, %five), direction=LT
}

%body (t: (s32[], f32[128,256], f32[128,256], f32[128])) -> (s32[], f32[128,256], f32[128,256], f32[128]) {
  %t = (s32[], f32[128,256]{1,0}, f32[128,256]{1,0}, f32[128]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[128,256]{1,0} get-tuple-element(%t), index=1
  %w = f32[128,256]{1,0} get-tuple-element(%t), index=2
  %mul = f32[128,256]{1,0} fusion(%x, %w), kind=kLoop, calls=%fused_mul
  %sum = f32[128]{0} fusion(%mul), kind=kInput, calls=%fused_sum
  %cp = f32[128,256]{1,0} copy(%mul)
  %inc = s32[] fusion(%i), kind=kLoop, calls=%fused_inc
  ROOT %out = (s32[], f32[128,256]{1,0}, f32[128,256]{1,0}, /*index=3*/f32[128]{0}) tuple(%inc, %cp, %w, %sum)
}

%cond (ct: (s32[], f32[128,256], f32[128,256], f32[128])) -> pred[] {
  %ct = (s32[], f32[128,256]{1,0}, f32[128,256]{1,0}, f32[128]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%ct), index=0
  ROOT %lt_fusion = pred[] fusion(%ci), kind=kLoop, calls=%fused_lt
}

ENTRY %main (x.1: f32[128,256], w.1: f32[128,256]) -> f32[128] {
  %x.1 = f32[128,256]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = f32[128,256]{1,0} parameter(1), metadata={op_name="w"}
  %c0 = s32[] constant(0)
  %fill = f32[128]{0} fusion(), kind=kLoop, calls=%fused_fill
  %init = (s32[], f32[128,256]{1,0}, f32[128,256]{1,0}, f32[128]{0}) tuple(%c0, %x.1, %w.1, %fill)
  %loop = (s32[], f32[128,256]{1,0}, f32[128,256]{1,0}, f32[128]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"},"known_init_step":{"init":"0","step":"1"}}
  ROOT %res = f32[128]{0} get-tuple-element(%loop), index=3
}
"""


def test_loop_launches_and_bytes_are_exact():
    acc = account(LOOP_HLO)
    runs = {l.name: (l.kind, l.count, l.bytes_read, l.bytes_written) for l in acc.launches}
    assert runs == {
        "fill": ("kernel", 1, 0, 128 * F32),  # a fill is a kernel (XLA emitted no memset for one)
        "mul": ("kernel", 5, 2 * X, X),  # reads x and w, writes the product
        "sum": ("kernel", 5, X, 128 * F32),
        "cp": ("copy", 5, X, X),
        "inc": ("kernel", 5, 4, 4),
    }  # the condition (lt_fusion) never runs: the trip count is known
    assert (acc.num_launches, acc.num_kernels, acc.num_copies) == (21, 16, 5)
    assert acc.copy_bytes == 5 * 2 * X
    assert acc.hbm_bytes == 128 * F32 + 5 * (3 * X + X + 128 * F32 + 2 * X + 8)
    assert acc.warnings == []


def test_unknown_trip_count_counts_once_and_warns():
    acc = account(LOOP_HLO.replace('"known_trip_count":{"n":"5"},', ""))
    assert {l.name: l.count for l in acc.launches}["mul"] == 1
    assert {l.name for l in acc.launches} >= {"lt_fusion"}
    assert acc.warnings == ["loop: no known_trip_count; body and condition counted once"]


def test_nested_loops_multiply_trip_counts():
    inner = LOOP_HLO.split("ENTRY")[0]
    outer = inner + """
%obody (ot: (s32[], f32[128,256], f32[128,256], f32[128])) -> (s32[], f32[128,256], f32[128,256], f32[128]) {
  %ot = (s32[], f32[128,256]{1,0}, f32[128,256]{1,0}, f32[128]{0}) parameter(0)
  ROOT %iw = (s32[], f32[128,256]{1,0}, f32[128,256]{1,0}, f32[128]{0}) while(%ot), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}

ENTRY %main (x.1: (s32[], f32[128,256], f32[128,256], f32[128])) -> (s32[], f32[128,256], f32[128,256], f32[128]) {
  %x.1 = (s32[], f32[128,256]{1,0}, f32[128,256]{1,0}, f32[128]{0}) parameter(0)
  ROOT %ow = (s32[], f32[128,256]{1,0}, f32[128,256]{1,0}, f32[128]{0}) while(%x.1), condition=%cond, body=%obody, backend_config={"known_trip_count":{"n":"3"}}
}
"""
    acc = account(outer)
    assert {l.name: l.count for l in acc.launches} == {"mul": 15, "sum": 15, "cp": 15, "inc": 15}


# A Pallas (Triton) kernel whose MLIR bytecode string holds text that looks like attributes, and a
# cuBLASLt GEMM whose result tuple ends with its scratch workspace.
CUSTOM_CALL_HLO = """HloModule cc, is_scheduled=true

ENTRY %main (q.1: bf16[64,512], a.1: bf16[64,512], b.1: bf16[512,256]) -> (bf16[64,512], bf16[64,256]) {
  %q.1 = bf16[64,512]{1,0} parameter(0)
  %a.1 = bf16[64,512]{1,0} parameter(1)
  %b.1 = bf16[512,256]{1,0} parameter(2)
  %pc = bf16[64,512]{1,0} custom-call(%q.1), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI, backend_config={debug = false, grid_x = 4 : i32, grid_y = 2 : i32, grid_z = 1 : i32, ir = "ML\\EFR\\0D calls=%evil body=%evil name = \\22x\\22 PADDING""" + "x" * 300 + """", name = "decode_kernel", num_stages = 2 : i32, num_warps = 4 : i32}
  %g = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(%a.1, %b.1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %gr = bf16[64,256]{1,0} get-tuple-element(%g), index=0
  ROOT %r = (bf16[64,512]{1,0}, bf16[64,256]{1,0}) tuple(%pc, %gr)
}
"""


def test_custom_calls_pallas_and_gemm():
    acc = account(CUSTOM_CALL_HLO)
    pallas, gemm = acc.launches
    assert (pallas.kind, pallas.bytes_read, pallas.bytes_written) == ("pallas", 64 * 512 * 2, 64 * 512 * 2)
    assert pallas.detail == "decode_kernel grid=(4, 2, 1) num_warps=4"
    assert (gemm.kind, gemm.detail) == ("gemm", "__cublas$lt$matmul")
    assert gemm.bytes_read == 64 * 512 * 2 + 512 * 256 * 2
    assert gemm.bytes_written == 64 * 256 * 2  # not the s8 workspace
    assert gemm.flops == 2 * 64 * 256 * 512
    assert [l.name for l in acc.pallas_kernels()] == ["pc"]


# The KV pool (entry parameter 1, 8 pages x 1024 x 128 bf16 = 2 MiB) rides a 4-trip loop. Per
# trip: an in-place scatter of 16 rows into it, a Pallas kernel reading it whole, a Pallas kernel
# writing it through an output alias, and a dynamic-slice fusion copying one page out of it.
# Before the loop, one full copy of it (what donation bugs look like).
KV = 8 * 1024 * 128 * 2
PAGE = 1024 * 128 * 2
KV_HLO = """HloModule kv, is_scheduled=true

%fused_scatter (s0: bf16[8,1024,128], s1: s32[16,2], s2: bf16[16,1,1,128]) -> bf16[8,1024,128] {
  %s0 = bf16[8,1024,128]{2,1,0} parameter(0)
  %s1 = s32[16,2]{1,0} parameter(1)
  %s2 = bf16[16,1,1,128]{3,2,1,0} parameter(2)
  ROOT %sc = bf16[8,1024,128]{2,1,0} scatter(%s0, %s1, %s2), update_window_dims={1,2,3}, inserted_window_dims={}, scatter_dims_to_operand_dims={0,1}, index_vector_dim=1, to_apply=%assign
}

%assign (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  ROOT %y = bf16[] parameter(1)
}

%fused_page (d0: bf16[8,1024,128], d1: s32[]) -> bf16[1,1024,128] {
  %d0 = bf16[8,1024,128]{2,1,0} parameter(0)
  %d1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,1024,128]{2,1,0} dynamic-slice(%d0, %d1, %z, %z), dynamic_slice_sizes={1,1024,128}
  ROOT %dcp = bf16[1,1024,128]{2,1,0} copy(%ds)
}

%body (t: (s32[], bf16[8,1024,128], s32[16,2], bf16[16,1,1,128])) -> (s32[], bf16[8,1024,128], s32[16,2], bf16[16,1,1,128]) {
  %t = (s32[], bf16[8,1024,128]{2,1,0}, s32[16,2]{1,0}, bf16[16,1,1,128]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %kv = bf16[8,1024,128]{2,1,0} get-tuple-element(%t), index=1
  %slots = s32[16,2]{1,0} get-tuple-element(%t), index=2
  %new = bf16[16,1,1,128]{3,2,1,0} get-tuple-element(%t), index=3
  %write = bf16[8,1024,128]{2,1,0} fusion(%kv, %slots, %new), kind=kInput, calls=%fused_scatter
  %rows = bf16[8192,128]{1,0} bitcast(%write)
  %attn = bf16[16,128]{1,0} custom-call(%rows), custom_call_target="__gpu$xla.gpu.triton", backend_config={grid_x = 16 : i32, name = "attn", num_warps = 4 : i32}
  %kv2 = bf16[8,1024,128]{2,1,0} custom-call(%write, %new), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{}: (0, {})}, backend_config={grid_x = 1 : i32, name = "kv_append", num_warps = 4 : i32}
  %page = bf16[1,1024,128]{2,1,0} fusion(%kv2, %i), kind=kCustom, calls=%fused_page, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_slice_fusion","kernel_index":0}}}
  ROOT %out = (s32[], bf16[8,1024,128]{2,1,0}, s32[16,2]{1,0}, bf16[16,1,1,128]{3,2,1,0}) tuple(%i, %kv2, %slots, %new)
}

%cond (ct: (s32[], bf16[8,1024,128], s32[16,2], bf16[16,1,1,128])) -> pred[] {
  %ct = (s32[], bf16[8,1024,128]{2,1,0}, s32[16,2]{1,0}, bf16[16,1,1,128]{3,2,1,0}) parameter(0)
  ROOT %f = pred[] constant(false)
}

ENTRY %main (x.1: s32[16,2], kv.1: bf16[8,1024,128], n.1: bf16[16,1,1,128]) -> bf16[8,1024,128] {
  %x.1 = s32[16,2]{1,0} parameter(0)
  %kv.1 = bf16[8,1024,128]{2,1,0} parameter(1)
  %n.1 = bf16[16,1,1,128]{3,2,1,0} parameter(2)
  %c0 = s32[] constant(0)
  %kvc = bf16[8,1024,128]{2,1,0} copy(%kv.1)
  %init = (s32[], bf16[8,1024,128]{2,1,0}, s32[16,2]{1,0}, bf16[16,1,1,128]{3,2,1,0}) tuple(%c0, %kv.1, %x.1, %n.1)
  %loop = (s32[], bf16[8,1024,128]{2,1,0}, s32[16,2]{1,0}, bf16[16,1,1,128]{3,2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %res = bf16[8,1024,128]{2,1,0} get-tuple-element(%loop), index=1
}
"""


def test_kv_override_follows_the_buffer_through_the_loop():
    live = 3 * 1024 * 128 * 2  # the caller knows only 3 pages hold live tokens
    appended = 16 * 128 * 2
    acc = account(KV_HLO, BufferOverride(entry_param=1, bytes_read=live, bytes_written=appended))
    runs = {l.name: (l.kind, l.count, l.bytes_read, l.bytes_written, l.touches_override) for l in acc.launches}
    new_rows = 16 * 128 * 2
    assert runs == {
        "kvc": ("copy", 1, KV, KV, True),  # a real full copy: never overridden
        "write": ("kernel", 4, 16 * 2 * 4 + new_rows, new_rows, True),  # in place: indices + rows in, rows out
        "attn": ("pallas", 4, live, 16 * 128 * 2, True),  # reads the KV whole: the override
        "kv2": ("pallas", 4, live + new_rows, appended, True),  # kv_append: writes through its alias
        "page": ("copy", 4, PAGE, PAGE, True),  # a visible slice: the slice's bytes
    }


def test_without_override_the_kv_counts_whole():
    runs = {l.name: l for l in account(KV_HLO).launches}
    assert runs["attn"].bytes_read == KV
    assert runs["kv2"].bytes_written == KV
    assert not any(l.touches_override for l in runs.values())


def test_override_of_a_missing_parameter_says_what_to_do():
    with pytest.raises(ValueError, match="entry_param=7 is not a parameter"):
        account(KV_HLO, BufferOverride(entry_param=7, bytes_read=0))


def test_contiguous_slice_fusion_is_a_memcpy_and_a_strided_one_a_kernel():
    # Layer 3 of stacked weights [28,1024,2048]: one contiguous run, which XLA emits as a kCopy.
    # Columns 0..1023 of every row: strided, a kernel. Both read and write only the slice.
    hlo = """HloModule s, is_scheduled=true

%layer_slice (p: bf16[28,1024,2048]) -> bf16[1,1024,2048] {
  %p = bf16[28,1024,2048]{2,1,0} parameter(0)
  ROOT %s = bf16[1,1024,2048]{2,1,0} slice(%p), slice={[3:4], [0:1024], [0:2048]}
}

%column_slice (q: bf16[28,1024,2048]) -> bf16[28,1024,1024] {
  %q = bf16[28,1024,2048]{2,1,0} parameter(0)
  ROOT %c = bf16[28,1024,1024]{2,1,0} slice(%q), slice={[0:28], [0:1024], [0:1024]}
}

ENTRY %main (w.1: bf16[28,1024,2048]) -> (bf16[1,1024,2048], bf16[28,1024,1024]) {
  %w.1 = bf16[28,1024,2048]{2,1,0} parameter(0)
  %layer = bf16[1,1024,2048]{2,1,0} fusion(%w.1), kind=kLoop, calls=%layer_slice
  %cols = bf16[28,1024,1024]{2,1,0} fusion(%w.1), kind=kLoop, calls=%column_slice
  ROOT %t = (bf16[1,1024,2048]{2,1,0}, bf16[28,1024,1024]{2,1,0}) tuple(%layer, %cols)
}
"""
    layer, cols = account(hlo).launches
    assert (layer.kind, layer.bytes_read, layer.bytes_written) == ("copy", 1024 * 2048 * 2, 1024 * 2048 * 2)
    assert (cols.kind, cols.bytes_read, cols.bytes_written) == ("kernel", 28 * 1024 * 1024 * 2, 28 * 1024 * 1024 * 2)


def test_override_counts_once_per_launch_when_the_buffer_comes_twice():
    # The decode kernel gets the whole buffer as K rows and as V rows: one override, not two.
    hlo = KV_HLO.replace("custom-call(%rows)", "custom-call(%rows, %rows)")
    attn = next(l for l in account(hlo, BufferOverride(1, bytes_read=1000)).launches if l.name == "attn")
    assert attn.bytes_read == 1000


# The thunks XLA dumps for LOOP_HLO, in the format of *.thunk_sequence_after_thunk_passes.txt:
# the loop body's fusions in a CUDA graph (kCommandBuffer), the copy outside it.
LOOP_THUNKS = """001: kCustomKernel [source | next=002 (1)] fill grid: [1, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
002: kWhile [prev=001 (1) | sink ]
condition:
    003: kCustomKernel [source | sink] lt_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer [source | next=006 (1)]
        004: kCustomKernel [source | next=005 (1)] mul grid: [256, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
        005: kCustomKernel [prev=004 (1) | sink] sum grid: [128, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
    006: kCopy [prev=000 (1) | next=007 (1)] kCopy
    007: kCustomKernel [prev=006 (1) | sink] inc grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""
LOOP_METADATA = "".join(f'thunk_metadata {{ thunk_info {{ profile_annotation: "{n}" thunk_id: {i} }} }}\n'
                        for i, n in ((1, "fill"), (2, "loop"), (3, "lt_fusion"), (4, "mul"), (5, "sum"), (6, "cp"),
                                     (7, "inc")))


def test_thunk_sequence_counts_match_the_hlo_accounting():
    counted = count_thunks(parse_thunk_sequence(LOOP_THUNKS), parse_thunk_metadata(LOOP_METADATA), LOOP_HLO)
    acc = account(LOOP_HLO)
    assert (counted.kernels, counted.copies, counted.memsets) == (acc.num_kernels, acc.num_copies, 0)
    assert counted.per_instruction == {l.name: l.count for l in acc.launches}
    assert counted.host_launches == 1 + 5 * 3  # the fill; per trip one graph, the copy, inc
    assert (counted.command_buffers, counted.ops_in_command_buffers) == (5, 5 * 2)  # per trip: one graph of mul, sum
    assert counted.kernel_launch_dims["sum"] == ("sum", (128, 1, 1), (256, 1, 1), 0)


# A conditional: one branch sorts rows (XLA copies the input into the output buffer, then sorts
# there), the other doubles them. Thunks as XLA prints a kConditional: "true_branch:" etc.
COND_HLO = """HloModule c, is_scheduled=true

%less (a: f32[], b: f32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%sort_rows (p: f32[64,256]) -> f32[64,256] {
  %p = f32[64,256]{1,0} parameter(0)
  ROOT %s = f32[64,256]{1,0} sort(%p), dimensions={1}, to_apply=%less
}

%double (d: f32[64,256]) -> f32[64,256] {
  %d = f32[64,256]{1,0} parameter(0)
  ROOT %m = f32[64,256]{1,0} add(%d, %d)
}

%on_true (t: f32[64,256]) -> f32[64,256] {
  %t = f32[64,256]{1,0} parameter(0)
  ROOT %sorted = f32[64,256]{1,0} fusion(%t), kind=kCustom, calls=%sort_rows
}

%on_false (f: f32[64,256]) -> f32[64,256] {
  %f = f32[64,256]{1,0} parameter(0)
  ROOT %doubled = f32[64,256]{1,0} fusion(%f), kind=kLoop, calls=%double
}

ENTRY %main (flag.1: pred[], x.1: f32[64,256]) -> f32[64,256] {
  %flag.1 = pred[] parameter(0)
  %x.1 = f32[64,256]{1,0} parameter(1)
  ROOT %cond = f32[64,256]{1,0} conditional(%flag.1, %x.1, %x.1), true_computation=%on_true, false_computation=%on_false
}
"""
COND_THUNKS = """001: kConditional [source | sink]
  true_branch:
    002: kCopy [source | next=003 (1)] kCopy
    003: kCustomKernel [prev=002 (1) | sink] sort_rows grid: [64, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
  false_branch:
    004: kCustomKernel [source | sink] doubled grid: [128, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""


def test_conditional_counts_its_biggest_branch_and_a_sort_is_copy_plus_kernel():
    acc = account(COND_HLO)
    rows = 64 * 256 * F32
    assert [(l.name, l.kind, l.bytes_read, l.bytes_written) for l in acc.launches] == [
        ("sorted", "copy", rows, rows), ("sorted", "kernel", rows, rows)]
    assert acc.warnings == ["cond: conditional; counted its branch with the most launches"]
    annotations = {1: "cond", 2: "sorted", 3: "sorted", 4: "doubled"}
    counted = count_thunks(parse_thunk_sequence(COND_THUNKS), annotations, COND_HLO)
    assert (counted.kernels, counted.copies, counted.per_instruction) == (1, 1, {"sorted": 2})


def test_occupancy_arithmetic():
    # 154 registers, 4 warps: 5120 registers per warp -> 12 warps by registers -> 3 blocks.
    assert occupancy(154, 55_296, 128) == (3, 12 / 64, "registers")
    # Shared memory bound: (100 KiB + 1 KiB reserved) per block -> 2 blocks of 256 threads.
    assert occupancy(32, 100 * 1024, 256) == (2, 16 / 64, "smem")
    assert occupancy(32, 0, 1024) == (2, 1.0, "warps")
    assert H100.num_sms == 132 and H100.hbm_bandwidth == 3.35232e12


def test_this_process_cannot_compile_for_h100():
    """The plugin stays out of the normal environment; compile_for_h100 says how to get it."""
    from jaxpaged.static_profile.target import compile_for_h100

    with pytest.raises(RuntimeError, match="run the script with `python -m jaxpaged.static_profile.target SCRIPT`"):
        compile_for_h100(lambda x: x, ())


_PROBE = """
import json, sys, jax, jax.numpy as jnp
from jaxpaged.static_profile.target import compile_for_h100, spec
from jaxpaged.static_profile.hlo_accounting import account
from jaxpaged.static_profile.thunks import cross_check
def f(x, w):  # 3 trips of x <- tanh(x @ w)
    return jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)
def g(emb, ids, xs, flag, w):  # a gather, a scan stacking its outputs, a cond with a sort, fills, a transpose
    def body(c, x):
        c = jnp.tanh(c @ w + x)
        return c, c.sum(-1)
    h, ys = jax.lax.scan(body, emb[ids], xs)
    h = jax.lax.cond(flag > 0, lambda h: h * 2, lambda h: jnp.sort(h, axis=-1), h)
    return h, ys, jnp.zeros((512, 512)), jnp.full((256, 256), 1.5, jnp.bfloat16), jnp.argmax(h, -1), h.T
out = compile_for_h100(f, (spec((256, 512), jnp.float32), spec((512, 512), jnp.float32)), dump_dir=sys.argv[1] + "/f")
acc = account(out.hlo_text)
g_out = compile_for_h100(g, (spec((50000, 256), jnp.float32), spec((64,), jnp.int32), spec((6, 64, 256), jnp.float32),
                             spec((), jnp.int32), spec((256, 256), jnp.float32)), dump_dir=sys.argv[1] + "/g")
print(json.dumps(dict(flops=acc.flops, launches=acc.num_launches, kernels=acc.num_kernels, copies=acc.num_copies,
      copy_bytes=acc.copy_bytes, hbm=acc.hbm_bytes, problems=cross_check(acc, out.dump_dir),
      g_problems=cross_check(account(g_out.hlo_text), g_out.dump_dir),
      per_trip=sorted(l.count for l in acc.launches if l.kind != "copy"), device=str(out.compiled.input_shardings))))
"""


@pytest.mark.skipif(not (toolchain_dir() / "jax_plugins").is_dir(),
                    reason="no H100 toolchain: run scripts/install_h100_toolchain.sh")
def test_compile_for_h100_in_a_child_process(tmp_path):
    run = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "dump")], env=h100_env(), capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["flops"] == 3 * 2 * 256 * 512 * 512  # every matmul the program implies, no more
    assert got["problems"] == []  # the dumped thunks agree with the HLO, launch for launch
    assert got["g_problems"] == []  # also on gathers, stacked scan outputs, a cond, a sort, fills
    assert all(n == 3 for n in got["per_trip"])  # every kernel lives in the loop: nothing hoisted
    # The only copies are the loop's initial carry (x, not donated, and the counter): x's bytes twice + 8.
    assert got["copies"] == 2 and got["copy_bytes"] == 2 * 256 * 512 * 4 + 8
    # Per trip at least: x and w read, x written.
    assert got["hbm"] >= 3 * (2 * 256 * 512 * 4 + 512 * 512 * 4)
    assert "H100" in got["device"] or "cuda" in got["device"].lower()


# Two devices' program: a partial product all-reduced (async start/done), then all-gathered.
COLLECTIVE_HLO = """HloModule tp, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_mul (p0: f32[16,512], p1: f32[16,512]) -> f32[16,512] {
  %p0 = f32[16,512]{1,0} parameter(0)
  %p1 = f32[16,512]{1,0} parameter(1)
  ROOT %m = f32[16,512]{1,0} multiply(%p0, %p1)
}

ENTRY %main (x.1: f32[16,512], y.1: f32[16,512]) -> f32[32,512] {
  %x.1 = f32[16,512]{1,0} parameter(0), metadata={op_name="x"}
  %y.1 = f32[16,512]{1,0} parameter(1), metadata={op_name="y"}
  %mul = f32[16,512]{1,0} fusion(%x.1, %y.1), kind=kLoop, calls=%fused_mul
  %ar-start = f32[16,512]{1,0} all-reduce-start(%mul), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %ar-done = f32[16,512]{1,0} all-reduce-done(%ar-start)
  %ag-start = (f32[16,512]{1,0}, f32[32,512]{1,0}) all-gather-start(%ar-done), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  ROOT %ag-done = f32[32,512]{1,0} all-gather-done(%ag-start)
}
"""


def test_collectives_count_their_payload_and_bus_bytes():
    from jaxpaged.static_profile.floors import bus_bytes

    acc = account(COLLECTIVE_HLO)
    runs = {l.name: (l.kind, l.bytes_read, l.bytes_written, l.detail) for l in acc.launches}
    payload = 16 * 512 * F32
    assert runs["ar-start"] == ("collective", payload, payload, "all-reduce-start")
    assert runs["ag-start"] == ("collective", payload, 2 * payload, "all-gather-start")  # the gathered result only
    assert acc.num_kernels == 3 and acc.num_launches == 3  # the done ops are free
    # NCCL's bus bytes: an all-reduce moves 2 (N-1)/N of its payload, an all-gather (N-1)/N.
    assert bus_bytes("all-reduce-start", 1000, 2) == 1000 and bus_bytes("all-reduce", 1000, 8) == 1750
    assert bus_bytes("all-gather-start", 800, 4) == 600 and bus_bytes("all-reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match="bus-bytes rule"):
        bus_bytes("send", 1, 2)


def test_floors_per_chip_add_the_launch_term():
    from jaxpaged.static_profile.floors import PER_LAUNCH_S, floors
    from jaxpaged.static_profile.target import H200

    assert H200.hbm_bandwidth == 4.8e12 and H200.hbm_bytes == 141_000_000_000 and H200.num_sms == H100.num_sms
    assert H100.hbm_bandwidth == 3_352_320_000_000 and H100.nvlink_bandwidth == H200.nvlink_bandwidth == 450e9
    for target in (H100, H200):
        f = floors(hbm_bytes=6_000_000_000, ideal_bytes=4_800_000_000, launches=500, target=target, nvlink_bytes=9e8)
        bytes_ms = 6e9 / target.hbm_bandwidth * 1e3
        assert f["bytes_floor_ms"] == round(bytes_ms, 4)
        assert f["launch_floor_ms"] == round(bytes_ms + 500 * PER_LAUNCH_S * 1e3, 4)
        assert f["ideal_floor_ms"] == round(4.8e9 / target.hbm_bandwidth * 1e3, 4)
        assert f["nvlink_floor_ms"] == 2.0  # 0.9 GB at 450 GB/s
    assert floors(4_800_000_000, 0, 0, H200)["bytes_floor_ms"] == 1.0
