"""Which values of a compiled program are one entry parameter's buffer (the KV pool).

The buffer keeps its identity through bitcasts, tuples and get-tuple-element, while-loop carries
(init -> body parameter -> body root -> loop result), call/conditional parameters and results, an
in-place update fusion (fusions.in_place_updates) and a custom call's output_to_operand_aliasing.
A `copy` makes a new buffer: it is not followed (it is counted as a full copy instead).
"""

from jaxpaged.static_profile.fusions import in_place_updates
from jaxpaged.static_profile.hlo_text import Computation, Instr, Module, parse_module


def called(instr: Instr, key: str) -> str:
    """The computation named by attribute `key` (body=, condition=) of a while."""
    return instr.attr(rf"\b{key}=%?([\w.\-]+)")


def entry_param_number(hlo_text: str, op_name: str) -> int:
    """The entry parameter that jax named `op_name` (metadata op_name: "kv", "params['w1']"): the
    number a BufferOverride needs. jit drops unused arguments, so do not count positions by hand."""
    entry = parse_module(hlo_text).entry_computation
    names = {n: (p.attr(r'op_name="((?:[^"\\]|\\.)*)"') or "").replace("\\", "") for n, p in entry.parameters().items()}
    found = [n for n, name in names.items() if name == op_name]
    if len(found) != 1:
        raise ValueError(f"{len(found)} entry parameters are named {op_name!r}; the names are {sorted(names.values())}")
    return found[0]


def alias_set(module: Module, entry_param: int) -> set[tuple[str, str]]:
    """(computation, instruction) pairs whose value is entry parameter `entry_param`'s buffer (or an
    element of a tuple holding it, for tuples/loops): propagated to a fixed point."""
    entry = module.entry_computation
    params = entry.parameters()
    if entry_param not in params:
        raise ValueError(f"{entry_param=} is not a parameter of the entry computation "
                         f"(it has {len(params)}); count jit arguments' leaves in flattening order")
    marked: set[tuple[str, str, tuple[int, ...]]] = {(entry.name, params[entry_param].name, ())}
    changed = True
    while changed:
        before = len(marked)
        for comp in module.computations.values():
            for instr in comp.instrs.values():
                _propagate(module, comp, instr, marked)
        changed = len(marked) != before
    return {(c, n) for c, n, _ in marked}


def _propagate(module: Module, comp: Computation, instr: Instr, marked: set) -> None:
    here = lambda name: {p for c, n, p in marked if c == comp.name and n == name}
    op, new = instr.opcode, set()
    if op == "bitcast":
        new = {p for p in here(instr.operands[0]) if p == ()}
    elif op == "tuple":
        new = {(i,) + p for i, o in enumerate(instr.operands) for p in here(o)}
    elif op == "get-tuple-element":
        new = {p[1:] for p in here(instr.operands[0]) if p and p[0] == instr.tuple_index}
    elif op == "while":
        body = module.computations[called(instr, "body")]
        cond = module.computations[called(instr, "condition")]
        carried = here(instr.operands[0]) | {p for c, n, p in marked if c == body.name and n == body.root}
        new = carried
        for sub in (body, cond):
            marked |= {(sub.name, sub.parameters()[0].name, p) for p in carried}
    elif op in ("call", "conditional"):
        for k, name in enumerate(instr.calls):
            sub = module.computations[name]
            args = instr.operands if op == "call" else instr.operands[k + 1:k + 2]
            for i, o in enumerate(args):
                marked |= {(sub.name, sub.parameters()[i].name, p) for p in here(o)}
            new |= {p for c, n, p in marked if c == sub.name and n == sub.root}
    elif op == "fusion":
        fused = module.computations[instr.calls[0]]
        root = fused.instrs[fused.root]
        leaves = [fused.instrs[o] for o in root.operands] if root.opcode == "tuple" else [root]
        for j, leaf in enumerate(leaves):
            target = in_place_updates(fused, leaf)
            for number in target:
                if () in here(instr.operands[number]):
                    new.add((j,) if root.opcode == "tuple" else ())
    elif op == "custom-call":
        for out_index, operand in instr.output_to_operand_aliasing:
            if () in here(instr.operands[operand]):
                new.add(out_index)
    marked |= {(comp.name, instr.name, p) for p in new}
