"""Count what one call of a compiled program does on the GPU, from its optimized HLO text.

    acc = account(compiled.as_text(), override=BufferOverride(entry_param=2, bytes_read=kv_live))
    acc.num_launches, acc.num_copies, acc.copy_bytes, acc.hbm_bytes, acc.by_kind()

Every instruction that XLA:GPU turns into work on the stream is one `Launch`, with `count` = how
many times it runs per program call (the product of the `known_trip_count`s of the while loops
around it). Kinds:

    kernel  a fusion or unfused op compiled to one kernel (a fill of a constant is one too)
    pallas  a Triton custom call (Pallas)                       gemm  a cuBLAS / cuDNN custom call
    collective  an all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute (its
            start op; the done op is free): HBM bytes as any kernel, its payload (`bytes_written`)
            what crosses NVLink (floors.py)
    copy    a device-to-device copy: `copy`, `copy-start`, a "dynamic_slice_fusion" (XLA emits a
            memcpy of the slice out, or of the update in), a loop fusion that only copies a
            parameter in the same layout or takes a contiguous static slice of one
            (fusions.is_memcpy), the input copy of a sort (XLA sorts in the output buffer)

HBM bytes of a launch = operands read + results written, by shape and dtype, at the top level
only (what happens inside a fusion stays in registers/shared memory), with these exceptions, each
read from the fused computation, never guessed:
  * an operand that the fusion only slices (slice, dynamic-slice, gather) counts the slices' bytes;
  * an in-place update (the fusion's root is a dynamic-update-slice or scatter whose target is a
    fusion parameter) reads nothing of the target and writes only the update. Invariant relied on:
    in XLA:GPU's optimized HLO such a fusion shares its target's buffer; where sharing was
    impossible, copy insertion already put an explicit `copy` before it, which is counted as a copy;
  * the override buffer (`BufferOverride`): one entry parameter and every value that aliases it
    (through bitcasts, tuples, while-loop carries, in-place updates, custom-call output aliasing)
    counts `bytes_read` once per launch that reads it whole (however many operands carry it),
    `bytes_written` per custom call that writes it through an output alias. A visible slice of it
    still counts the slice; a `copy` of it counts its full size twice (that copy is real, and is
    what this tool exists to catch).

Launch counts: the dumped thunk sequence is what the runtime issues, so it is the ground truth;
the HLO is needed for bytes. Run thunks.cross_check(accounting, dump_dir) whenever a dump exists:
it found every rule above that is not obvious (see thunks.py), and will find the next one.

A while loop without `known_trip_count` is counted once, with a warning. A conditional counts its
branch with the most launches (an upper bound), with a warning. Figures are estimates of traffic
and launches, not measurements.
"""

import dataclasses

from jaxpaged.static_profile.aliases import alias_set, called, entry_param_number  # noqa: F401 (re-exported)
from jaxpaged.static_profile.fusions import (
    dot_flops,
    dynamic_slice_memcpy_bytes,
    in_place_updates,
    is_memcpy,
    param_read_bytes,
    through_views,
)
from jaxpaged.static_profile.hlo_text import Computation, Instr, Module, parse_module

# Opcodes that never become work on the stream: views, tuple plumbing, scheduling markers.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all",
         "add-dependency", "domain", "copy-done", "send-done", "recv-done", "async-done", "async-update",
         "all-reduce-done", "all-gather-done", "collective-permute-done"}
_GEMM_TARGETS = ("__cublas", "__cudnn")
COLLECTIVES = {"all-reduce", "all-reduce-start", "all-gather", "all-gather-start", "reduce-scatter", "all-to-all",
               "collective-permute", "collective-permute-start", "ragged-all-to-all"}
_TRITON_TARGET = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class BufferOverride:
    """Count one big buffer (the KV pool, entry parameter `entry_param`) by what kernels really touch."""

    entry_param: int | tuple[int, ...]  # a tuple: several parameters that together are the buffer
    bytes_read: int  # per launch that reads the buffer whole (not through a visible slice)
    bytes_written: int = 0  # per custom call whose output aliases the buffer (extent not in the HLO)


@dataclasses.dataclass(frozen=True)
class Launch:
    computation: str
    name: str  # the HLO instruction (thunk profile annotation)
    kind: str  # kernel | pallas | gemm | copy
    count: int  # runs per program call
    bytes_read: int  # per run
    bytes_written: int  # per run
    flops: int = 0  # per run: 2*M*N*K of every dot inside (0 where none)
    touches_override: bool = False
    detail: str = ""  # fusion kind / custom-call target / Pallas kernel name and grid

    @property
    def hbm_bytes(self) -> int:
        return self.count * (self.bytes_read + self.bytes_written)


@dataclasses.dataclass
class Accounting:
    launches: list[Launch]
    warnings: list[str]

    def _total(self, attr: str, kinds=None) -> int:
        return sum(getattr(l, attr) * (1 if attr in ("count", "hbm_bytes") else l.count)
                   for l in self.launches if kinds is None or l.kind in kinds)

    @property
    def num_launches(self) -> int:  # every kernel and copy on the stream
        return self._total("count")

    @property
    def num_kernels(self) -> int:
        return self._total("count", ("kernel", "pallas", "gemm", "collective"))

    @property
    def num_copies(self) -> int:
        return self._total("count", ("copy",))

    @property
    def copy_bytes(self) -> int:  # read + written by the copies
        return self._total("hbm_bytes", ("copy",))

    @property
    def hbm_bytes(self) -> int:
        return self._total("hbm_bytes")

    @property
    def flops(self) -> int:
        return self._total("flops")

    def by_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for l in self.launches:
            row = out.setdefault(l.kind, {"launches": 0, "hbm_bytes": 0})
            row["launches"] += l.count
            row["hbm_bytes"] += l.hbm_bytes
        return out

    def pallas_kernels(self) -> list[Launch]:
        return [l for l in self.launches if l.kind == "pallas"]


def account(hlo_text: str, override: BufferOverride | None = None) -> Accounting:
    module = parse_module(hlo_text)
    params = () if override is None else (override.entry_param if isinstance(override.entry_param, tuple)
                                           else (override.entry_param,))
    aliases = set().union(*(alias_set(module, p) for p in params))  # several: a quantized pool's values + scales
    acc = Accounting([], [])
    _walk(module, module.entry_computation, 1, override, aliases, acc)
    return acc


def _walk(module: Module, comp: Computation, count: int, override, aliases, acc: Accounting) -> None:
    for instr in comp.instrs.values():
        op = instr.opcode
        if op in _FREE:
            continue
        if op == "while":
            trips = instr.known_trip_count
            if trips is None:
                acc.warnings.append(f"{instr.name}: no known_trip_count; body and condition counted once")
                _walk(module, module.computations[called(instr, "condition")], count, override, aliases, acc)
            # With a known trip count XLA:GPU runs the body `trips` times and never the condition.
            _walk(module, module.computations[called(instr, "body")], count * (trips or 1), override, aliases, acc)
        elif op == "conditional":
            branches = []
            for name in instr.calls:
                sub = Accounting([], acc.warnings)
                _walk(module, module.computations[name], count, override, aliases, sub)
                branches.append(sub.launches)
            acc.launches += max(branches, key=lambda ls: sum(l.count for l in ls))
            acc.warnings.append(f"{instr.name}: conditional; counted its branch with the most launches")
        elif op in ("call", "async-start"):
            for name in instr.calls:
                _walk(module, module.computations[name], count, override, aliases, acc)
        else:
            acc.launches += _launches(module, comp, instr, count, override, aliases)


def _launches(module, comp, instr: Instr, count, override, aliases) -> list[Launch]:
    """What one non-control instruction puts on the stream: one launch, or a sort's copies + kernel."""
    fused = module.computations[instr.calls[0]] if instr.opcode == "fusion" else None
    sort = through_views(fused, fused.root) if fused else instr
    if sort.opcode != "sort":
        return [_launch(module, comp, instr, count, override, aliases)]
    # XLA:GPU sorts in place in the output buffer: first a memcpy of each sorted input that is a
    # buffer (an iota made inside the fusion is not), then the sort kernel(s) over the outputs.
    inputs = [through_views(fused, o) for o in sort.operands] if fused else [comp.instrs[o] for o in sort.operands]
    copies = [Launch(comp.name, instr.name, "copy", count, i.shape.nbytes, i.shape.nbytes, detail="sort input")
              for i in inputs if i.opcode == "parameter" or not fused]
    n = sort.shape.nbytes
    return copies + [Launch(comp.name, instr.name, "kernel", count, n, n,
                            detail="sort (a long sort may take several kernels: see the thunks)")]


def _launch(module, comp, instr: Instr, count, override, aliases) -> Launch:
    first_alias = next((i for i, o in enumerate(instr.operands) if (comp.name, o) in aliases), None)

    def reads(i: int, nbytes: int) -> int:  # bytes counted for reading operand i
        # The override is per launch: a kernel given the buffer twice (K rows and V rows of one
        # buffer) still reads `bytes_read` in all.
        if (comp.name, instr.operands[i]) in aliases and override is not None:
            return override.bytes_read if i == first_alias else 0
        return nbytes

    touches = any((comp.name, o) in aliases for o in instr.operands) or (comp.name, instr.name) in aliases
    operand_bytes = [comp.instrs[o].shape.nbytes for o in instr.operands]
    mk = lambda kind, r, w, flops=0, detail="": Launch(
        comp.name, instr.name, kind, count, r, w, flops, touches, detail)
    op = instr.opcode
    if op in ("copy", "copy-start"):
        n = operand_bytes[0]
        return mk("copy", n, n, detail=op)
    if op in COLLECTIVES:  # per device: its operand in, its result out (a start op's tuple: the result part)
        leaves = list(instr.shape.leaves)
        written = leaves[-1].nbytes if op.endswith("-start") and instr.shape.is_tuple else instr.shape.nbytes
        return mk("collective", sum(operand_bytes), written, detail=op)
    if op == "custom-call":
        target = instr.custom_call_target or ""
        results = list(instr.shape.leaves)
        if target.startswith(_GEMM_TARGETS) and instr.shape.is_tuple and results[-1].dtype in ("s8", "u8"):
            results = results[:-1]  # cuBLAS/cuDNN scratch workspace, not data
        written = sum(leaf.nbytes for leaf in results)
        for out_index, operand in instr.output_to_operand_aliasing:
            if (comp.name, instr.operands[operand]) in aliases and override is not None:
                leaf = results[out_index[0]] if out_index else results[0]
                written += override.bytes_written - leaf.nbytes
        read = sum(reads(i, n) for i, n in enumerate(operand_bytes))
        if target == _TRITON_TARGET:
            name = (instr.mlir_attr("name") or '"?"').strip('"')
            grid = tuple(int(instr.mlir_attr(f"grid_{a}") or 1) for a in "xyz")
            return mk("pallas", read, written, detail=f"{name} grid={grid} num_warps={instr.mlir_attr('num_warps')}")
        kind = "gemm" if target.startswith(_GEMM_TARGETS) else "kernel"
        return mk(kind, read, written, _custom_call_flops(comp, instr), target)
    if op != "fusion":  # an unfused op (sort, scatter, rng, ...): one kernel over its shapes
        return mk("kernel", sum(reads(i, n) for i, n in enumerate(operand_bytes)), instr.shape.nbytes, detail=op)

    fused = module.computations[instr.calls[0]]
    root = fused.instrs[fused.root]
    detail = instr.backend_kind or instr.fusion_kind or ""
    if instr.custom_fusion_name == "dynamic_slice_fusion" or instr.backend_kind == "__dynamic_slice_fusion":
        moved = dynamic_slice_memcpy_bytes(fused)  # a memcpy of the slice out, or of the update in
        if moved is not None:
            into = through_views(fused, fused.root).opcode == "dynamic-update-slice"
            return mk("copy", moved, moved, detail="dynamic-update-slice fusion" if into else "dynamic-slice fusion")
    if instr.fusion_kind == "kLoop" and is_memcpy(fused, root):
        return mk("copy", instr.shape.nbytes, instr.shape.nbytes, detail=f"{root.opcode} fusion")
    in_place = in_place_updates(fused, root)  # {param number: bytes of the updates written}
    read = 0
    for i, n in enumerate(operand_bytes):
        partial = param_read_bytes(module, fused, i, in_place)
        read += reads(i, n) if partial is None else partial
    written = instr.shape.nbytes - sum(fused.parameters()[p].shape.nbytes for p in in_place) \
        + sum(in_place.values())
    return mk("kernel", read, written, dot_flops(module, fused), detail)


def _custom_call_flops(comp: Computation, instr: Instr) -> int:
    dims = instr.json_backend_config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    if not dims:
        return 0
    lhs = comp.instrs[instr.operands[0]].shape.leaves[0].dims
    k = 1
    for d in dims.get("lhs_contracting_dimensions", []):
        k *= lhs[int(d)]
    return 2 * instr.shape.leaves[0].num_elements * k


