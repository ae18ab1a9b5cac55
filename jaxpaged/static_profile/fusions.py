"""The anatomy of one fused computation: what it really reads and writes, read from its HLO.

Used by hlo_accounting.py. Every rule here follows from what the fused computation's instructions
do, never from names: a fusion that only slices a parameter reads the slices; a root
dynamic-update-slice / scatter whose target is a parameter updates that parameter in place.
"""

from jaxpaged.static_profile.hlo_text import Computation, Instr, Leaf, Module

_VIEW = {"bitcast", "reshape"}  # inside a fusion: same elements, no traffic of their own


def dynamic_slice_memcpy_bytes(fused: Computation) -> int | None:
    """Bytes XLA's "dynamic_slice_fusion" moves as one memcpy: its `copy` of the slice it takes
    (root copy(dynamic-slice)) or of the update it writes in place (root dynamic-update-slice of
    copy(update)), as the thunks show (kDynamicSliceFusion around one kCopy). None: no copy inside
    (the fusion wraps a library call instead)."""
    copies = [i for i in fused.instrs.values() if i.opcode == "copy"]
    return copies[0].shape.nbytes if len(copies) == 1 else None


def is_memcpy(fused: Computation, root: Instr) -> bool:
    """A loop fusion XLA:GPU emits as a device-to-device memcpy, not a kernel: its root copies a
    parameter keeping element order, or takes a contiguous static `slice` of one (found by the thunk
    cross-check on an unrolled layer loop: `wrapped_slice` fusions of stacked weights are kCopy)."""
    if root.opcode not in ("copy", "slice"):
        return False
    src = fused.instrs[root.operands[0]]
    while src.opcode == "bitcast":
        src = fused.instrs[src.operands[0]]
    if src.opcode != "parameter":
        return False
    if root.opcode == "slice":
        return is_contiguous_slice(fused.instrs[root.operands[0]].shape.leaves[0], root.shape.leaves[0])
    return src.shape.leaves[0].layout == root.shape.leaves[0].layout or len(root.shape.leaves[0].dims) < 2


def is_contiguous_slice(operand: Leaf, result: Leaf) -> bool:
    """The slice is one contiguous run of the operand's memory: walking dims from minor to major,
    every dim is whole up to the first cut one, and every dim more major than that has size 1."""
    order = [int(d) for d in operand.layout.split(",") if d] or list(range(len(operand.dims)))[::-1]
    cut = False
    for dim in order:  # minor to major
        if cut and result.dims[dim] != 1:
            return False
        cut = cut or result.dims[dim] != operand.dims[dim]
    return True


def through_views(comp: Computation, name: str) -> Instr:
    instr = comp.instrs[name]
    while instr.opcode in _VIEW:
        instr = comp.instrs[instr.operands[0]]
    return instr


def in_place_updates(fused: Computation, root: Instr) -> dict[int, int]:
    """Fused parameters updated in place by a root dynamic-update-slice / scatter -> bytes written."""
    leaves = [fused.instrs[o] for o in root.operands] if root.opcode == "tuple" else [root]
    out: dict[int, int] = {}
    for leaf in leaves:
        leaf = through_views(fused, leaf.name)
        if leaf.opcode not in ("dynamic-update-slice", "scatter"):
            continue
        target = through_views(fused, leaf.operands[0])
        if target.opcode != "parameter":
            continue  # not in place: the fusion writes its whole result, counted as such
        n_targets = (len(leaf.operands) - 1) // 2 if leaf.opcode == "scatter" else 1
        updates = leaf.operands[-n_targets:] if leaf.opcode == "scatter" else [leaf.operands[1]]
        out[target.parameter_number] = sum(fused.instrs[u].shape.nbytes for u in updates)
    return out


def param_read_bytes(module: Module, fused: Computation, number: int, in_place: dict[int, int]) -> int | None:
    """Bytes a fused computation reads of its parameter `number`, when less than the whole of it
    is visibly read (only slices / gathers / in-place targets use it); None = read whole."""
    param = fused.parameters()[number]
    frontier, total = [param.name], 0
    while frontier:
        name = frontier.pop()
        for user in fused.users(name):
            first = user.operands[0] == name
            if user.opcode in _VIEW:
                frontier.append(user.name)
            elif user.opcode in ("slice", "dynamic-slice", "gather") and first:
                total += user.shape.nbytes
            elif user.opcode in ("dynamic-update-slice", "scatter") and first and number in in_place:
                continue  # the in-place target: not read
            elif user.opcode == "fusion":  # nested (Triton GEMM) fusion: look inside
                inner = module.computations[user.calls[0]]
                sub = param_read_bytes(module, inner, user.operands.index(name), {})
                if sub is None:
                    return None
                total += sub
            else:
                return None
    return min(total, param.shape.nbytes)


def dot_flops(module: Module, comp: Computation) -> int:
    flops = 0
    for instr in comp.instrs.values():
        if instr.opcode == "dot":
            lhs = comp.instrs[instr.operands[0]].shape.leaves[0].dims
            contracting = [int(d) for d in (instr.attr(r"lhs_contracting_dims=\{([\d,]*)\}") or "").split(",") if d]
            k = 1
            for d in contracting:
                k *= lhs[d]
            flops += 2 * instr.shape.leaves[0].num_elements * k
        elif instr.opcode == "fusion":
            flops += dot_flops(module, module.computations[instr.calls[0]])
    return flops
