"""Read XLA:GPU's dump of a compiled program: the thunk sequence (what the runtime really issues),
and cross-check the HLO accounting against it.

A dump dir (`compile_for_h100(..., dump_dir=...)`) holds, per module `module_NNNN.<name>`:
    *.sm_9.0a_gpu_after_optimizations.txt          the optimized HLO (= compiled.as_text())
    *.thunk_sequence_after_thunk_passes.txt         the final thunks (with CUDA-graph kCommandBuffer)
    *.thunk_sequence.txt                            the thunks before those passes
    *.thunk_metadata.txt                            thunk_id -> profile_annotation (HLO instruction)
    *.ptx                                           one PTX module per kernel (Pallas/Triton included)

A thunk line reads `006: kCustomKernel [deps] gemm_fusion_dot grid: [4096, 1, 1] threads: [64, 1, 1]
shared_memory: 768 bytes`; nested thunks (while condition/body, command buffers, dynamic-slice
fusions) are indented under their parent. The thunk text carries no trip counts: a kWhile's count
comes from its HLO instruction's `known_trip_count`, found through the metadata annotation.

What the cross-check found (tests/test_hlo_accounting.py compiles two programs, scan_probe.py four
variants of a 28-layer decode step; all agree launch for launch, per HLO instruction):
  * a while loop with a known trip count runs its body N times and its condition never (XLA's
    WhileThunk skips the condition then); the thunk text has no trip count, the HLO has;
  * a `__custom_fusion` "dynamic_slice_fusion" is a kDynamicSliceFusion around one kCopy: a memcpy
    of the slice out (a scanned weight) or of the update in (a scan's stacked output);
  * a loop fusion that only takes a contiguous static slice of a parameter is a kCopy too (the
    first version of the accounting called these kernels: 140 launches off on an unrolled model);
  * a fill (broadcast of a constant) is a kernel, not a memset; a sort is a kCopy of its input
    plus the sort kernel; cuBLAS calls are kCublasLtMatmul thunks with no grid;
  * kCommandBuffer (a CUDA graph) is only a container: its kernels each still run; it changes how
    many launches the host issues (`host_launches`).
The HLO stays the source of bytes (the thunks carry no shapes); the thunks are the source of grid,
threads and dynamic shared memory of each kernel.
"""

import dataclasses
import glob
import os
import re

from jaxpaged.static_profile.hlo_accounting import Accounting
from jaxpaged.static_profile.hlo_text import parse_module

_LINE = re.compile(r"^(\s*)(\d+):\s+(k\w+)\s*\[[^\]]*\]\s*(.*)$")
_LAUNCH = re.compile(r"(\S+)\s+grid:\s*\[([\d,\s]+)\]\s*threads:\s*\[([\d,\s]+)\]\s*shared_memory:\s*(\d+)")
_CONTAINERS = {"kSequential", "kCommandBuffer", "kDynamicSliceFusion"}  # children each run once
_COPIES = {"kCopy", "kDeviceToDeviceCopy", "kCopyDone", "kDeviceToHostCopy", "kHostToDeviceCopy"}
_MEMSETS = {"kMemset32BitValue", "kMemzero"}
_LIBRARY = {"kGemm", "kCublasLtMatmul", "kCuDnn", "kConvolution", "kFft", "kNorm", "kTriangularSolve",
            "kCholesky", "kCustomCall"}  # library calls: kernels whose thunk line has no grid


@dataclasses.dataclass
class Thunk:
    id: int
    kind: str
    text: str  # the rest of the line: kernel name, grid, threads, shared memory
    children: list["Thunk"] = dataclasses.field(default_factory=list)
    group: str = ""  # a kWhile / kConditional: the group ("condition", "body", "true_branch", ...) being read
    in_group: str = ""  # which group of its parent this thunk sits in

    @property
    def launch(self) -> tuple[str, tuple[int, ...], tuple[int, ...], int] | None:
        """(kernel name, grid, threads per block, dynamic shared memory bytes) of a kernel thunk."""
        m = _LAUNCH.search(self.text)
        if not m:
            return None
        dims = lambda s: tuple(int(x) for x in s.split(","))
        return m.group(1), dims(m.group(2)), dims(m.group(3)), int(m.group(4))


def parse_thunk_sequence(text: str) -> list[Thunk]:
    roots: list[Thunk] = []
    stack: list[tuple[int, Thunk]] = []  # (indent, thunk) of the open ancestors
    for line in text.splitlines():
        label = line.strip()
        if label in ("condition:", "body:"):
            # "condition:" follows its kWhile's line; "body:" belongs to the innermost kWhile still
            # reading its condition (a while nested in a condition has already switched to body).
            whiles = [t for _, t in stack if t.kind == "kWhile" and (label == "condition:" or t.group == "condition")]
            if whiles:
                whiles[-1].group = label[:-1]
            continue
        if re.fullmatch(r"\w*branch\w*:", label):
            # "true_branch:", "false_branch:", "branch_0:": printed indented past their kConditional.
            indent = len(line) - len(line.lstrip())
            conds = [t for i, t in stack if t.kind == "kConditional" and i < indent] or \
                [t for _, t in stack if t.kind == "kConditional"]
            if conds:
                conds[-1].group = label[:-1]
            continue
        m = _LINE.match(line)
        if not m:
            continue
        indent, thunk = len(m.group(1)), Thunk(int(m.group(2)), m.group(3), m.group(4).strip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if stack:
            parent = stack[-1][1]
            parent.children.append(thunk)
            thunk.in_group = parent.group
        else:
            roots.append(thunk)
        stack.append((indent, thunk))
    return roots


def parse_thunk_metadata(text: str) -> dict[int, str]:
    """thunk_id -> profile annotation (the HLO instruction name)."""
    pairs = re.findall(r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)', text)
    return {int(i): name for name, i in pairs}


@dataclasses.dataclass
class ThunkCount:
    kernels: int = 0
    copies: int = 0
    memsets: int = 0
    host_launches: int = 0  # what the host issues: a kCommandBuffer (CUDA graph) counts once
    command_buffers: int = 0  # kCommandBuffer runs (CUDA graphs launched) per program call
    ops_in_command_buffers: int = 0  # kernels, copies and memsets captured in them
    per_instruction: dict = dataclasses.field(default_factory=dict)  # HLO name -> runs
    kernel_launch_dims: dict = dataclasses.field(default_factory=dict)  # HLO name -> Thunk.launch
    unknown_kinds: set = dataclasses.field(default_factory=set)


def count_thunks(thunks: list[Thunk], annotations: dict[int, str], hlo_text: str) -> ThunkCount:
    module = parse_module(hlo_text)
    trips = {i.name: i.known_trip_count for c in module.computations.values() for i in c.instrs.values()
             if i.opcode == "while"}

    def visit(ts: list[Thunk], n: int, in_graph: bool, owner: str | None, out: ThunkCount) -> None:
        for t in ts:
            name = owner or annotations.get(t.id)  # inside a dynamic-slice fusion: the fusion's
            if t.kind == "kWhile":
                trip = trips.get(annotations.get(t.id, ""))
                for child in t.children:
                    runs = (0 if trip is not None else 1) if child.in_group == "condition" else (trip or 1)
                    visit([child], n * runs, in_graph, None, out)
            elif t.kind == "kConditional":  # as the HLO accounting: the branch with most launches
                branches = []
                for group in dict.fromkeys(c.in_group for c in t.children):
                    branches.append(ThunkCount())
                    visit([c for c in t.children if c.in_group == group], n, in_graph, None, branches[-1])
                if branches:
                    _merge(out, max(branches, key=lambda b: b.kernels + b.copies + b.memsets))
            elif t.kind in _CONTAINERS:
                if t.kind == "kCommandBuffer" and not in_graph:
                    out.host_launches += n
                    out.command_buffers += n
                # A dynamic-slice fusion's inner copy is annotated with the fused `copy`: it is the fusion's.
                visit(t.children, n, in_graph or t.kind == "kCommandBuffer",
                      name if t.kind == "kDynamicSliceFusion" else None, out)
            else:
                if t.kind in _COPIES:
                    out.copies += n
                elif t.kind in _MEMSETS:
                    out.memsets += n
                else:
                    if t.launch is None and t.kind not in _LIBRARY:
                        out.unknown_kinds.add(t.kind)
                    out.kernels += n
                    if t.launch and name:
                        out.kernel_launch_dims[name] = t.launch
                if not in_graph:
                    out.host_launches += n
                else:
                    out.ops_in_command_buffers += n
                if name and n:
                    out.per_instruction[name] = out.per_instruction.get(name, 0) + n

    out = ThunkCount()
    visit(thunks, 1, False, None, out)
    return out


def _merge(into: ThunkCount, part: ThunkCount) -> None:
    into.kernels += part.kernels
    into.copies += part.copies
    into.memsets += part.memsets
    into.host_launches += part.host_launches
    into.command_buffers += part.command_buffers
    into.ops_in_command_buffers += part.ops_in_command_buffers
    for name, runs in part.per_instruction.items():
        into.per_instruction[name] = into.per_instruction.get(name, 0) + runs
    into.kernel_launch_dims |= part.kernel_launch_dims
    into.unknown_kinds |= part.unknown_kinds


@dataclasses.dataclass
class DumpFiles:
    hlo: str
    thunk_sequence: str
    thunk_metadata: str
    ptx: list[str]


def find_dump_files(dump_dir: str) -> DumpFiles:
    """The files of the one module in `dump_dir` (an error if none or several were compiled there)."""
    hlos = sorted(glob.glob(os.path.join(dump_dir, "*gpu_after_optimizations.txt")))
    if len(hlos) != 1:
        raise ValueError(f"{dump_dir} holds {len(hlos)} optimized modules; dump each compile to a fresh dir")
    prefix = hlos[0].split(".sm_")[0]
    seq = prefix + ".thunk_sequence_after_thunk_passes.txt"
    if not os.path.exists(seq):
        seq = prefix + ".thunk_sequence.txt"
    return DumpFiles(hlos[0], seq, prefix + ".thunk_metadata.txt", sorted(glob.glob(prefix + ".*.ptx")))


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def count_dumped_thunks(dump_dir: str) -> ThunkCount:
    """The thunk count of the one module in `dump_dir` (CUDA graphs included: `command_buffers`)."""
    files = find_dump_files(dump_dir)
    return count_thunks(parse_thunk_sequence(read_text(files.thunk_sequence)),
                        parse_thunk_metadata(read_text(files.thunk_metadata)), read_text(files.hlo))


def cross_check(acc: Accounting, dump_dir: str) -> list[str]:
    """Differences between the HLO accounting and the dumped thunks; [] when they agree."""
    counted = count_dumped_thunks(dump_dir)
    problems = []
    for label, hlo_n, thunk_n in (("kernels", acc.num_kernels, counted.kernels),
                                  ("copies", acc.num_copies, counted.copies),
                                  ("memsets", sum(l.count for l in acc.launches if l.kind == "memset"), counted.memsets)):
        if hlo_n != thunk_n:
            problems.append(f"{label}: HLO accounting {hlo_n}, thunk sequence {thunk_n}")
    hlo_per: dict[str, int] = {}
    for l in acc.launches:
        hlo_per[l.name] = hlo_per.get(l.name, 0) + l.count
    for name in sorted(set(hlo_per) | set(counted.per_instruction)):
        if hlo_per.get(name, 0) != counted.per_instruction.get(name, 0):
            problems.append(f"{name}: HLO {hlo_per.get(name, 0)} runs, thunks {counted.per_instruction.get(name, 0)}")
    if counted.unknown_kinds:
        problems.append(f"thunk kinds read as kernels without launch dims: {sorted(counted.unknown_kinds)}")
    return problems
