"""Parse XLA's optimized HLO text (`compiled.as_text()`) into computations and instructions.

Pure text, standard library only: the accounting tests run in milliseconds without jax.

What this reads (one instruction per line, as XLA prints a scheduled module):

    %name = <shape> <opcode>(<operands>), attr=..., backend_config=...
    ROOT %name = (s32[], bf16[4,8]{1,0}) tuple(%a, %b)

A computation starts at column 0 with `%name (params) -> shape {` or `ENTRY %name ...{` and ends
at a `}` line. Everything else at column 0 (HloModule, FileNames, StackFrames tables) is skipped.
Invariant: instructions keep their printed order, which for a scheduled module is execution order.
"""

import dataclasses
import json
import re

# Bits per element. Sub-byte types are packed by XLA:GPU, so bytes = ceil(elements * bits / 8).
_BITS = {"pred": 8, "token": 0, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
         "tf32": 32, "e8m0fnu": 8}
_INT = re.compile(r"^[su](\d+)$")
_FLOAT = re.compile(r"^f(\d+)e\d+m\d+\w*$")  # f8e4m3fn, f8e5m2, f4e2m1fn, f6e3m2fn, ...
_LEAF = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_COMMENT = re.compile(r"/\*.*?\*/")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")


def dtype_bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    m = _INT.match(dtype) or _FLOAT.match(dtype)
    if m:
        return int(m.group(1))
    raise ValueError(f"unknown HLO element type {dtype!r}; add its width to hlo_text._BITS")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of a (possibly tuple) shape: `bf16[4,4096,512]{2,1,0}`."""

    dtype: str
    dims: tuple[int, ...]
    layout: str  # minor-to-major as printed, e.g. "2,1,0" ("" for scalars / when absent)

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return -(-self.num_elements * dtype_bits(self.dtype) // 8)


@dataclasses.dataclass(frozen=True)
class Shape:
    leaves: tuple[Leaf, ...]  # flattened in tuple order; one leaf for an array shape
    is_tuple: bool

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)


def parse_shape(text: str) -> Shape:
    leaves = []
    for dtype, dims, layout in _LEAF.findall(_COMMENT.sub("", text)):
        # `<=8` marks a bounded dynamic dimension: the buffer is sized by the bound.
        sizes = tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        leaves.append(Leaf(dtype, sizes, layout.strip("{}").split(":")[0]))
    if not leaves and text.strip() not in ("()", ""):
        raise ValueError(f"cannot read HLO shape {text!r}")
    return Shape(tuple(leaves), text.lstrip().startswith("("))


@dataclasses.dataclass
class Instr:
    name: str
    shape: Shape
    opcode: str
    operands: list[str]  # instruction names in the same computation (a parameter's: [] )
    attrs: str  # the rest of the line after the operand list, long strings blanked
    raw_operands: str  # e.g. "0" for parameter(0)
    is_root: bool = False

    def attr(self, pattern: str) -> str | None:
        m = re.search(pattern, self.attrs)
        return m.group(1) if m else None

    @property
    def calls(self) -> list[str]:
        """Computations this instruction runs: fusion body, loop body/condition, branches, to_apply."""
        names = []
        for key in ("calls", "body", "condition", "to_apply", "true_computation", "false_computation"):
            names += re.findall(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        for group in re.findall(r"\b(?:branch_computations|calls)=\{([^}]*)\}", self.attrs):
            names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
        return names

    @property
    def parameter_number(self) -> int:
        return int(self.raw_operands.strip())

    @property
    def tuple_index(self) -> int:
        return int(self.attr(r"\bindex=(\d+)"))

    @property
    def known_trip_count(self) -> int | None:
        n = self.attr(r'"known_trip_count":\{"n":"(\d+)"\}')
        return int(n) if n is not None else None

    @property
    def fusion_kind(self) -> str | None:
        return self.attr(r"\bkind=(k\w+)")

    @property
    def backend_kind(self) -> str | None:
        """fusion_backend_config.kind, e.g. __triton_gemm, __custom_fusion, __dynamic_slice_fusion."""
        return self.attr(r'"fusion_backend_config":\{"kind":"([^"]+)"')

    @property
    def custom_fusion_name(self) -> str | None:
        return self.attr(r'"custom_fusion_config":\{"name":"([^"]+)"')

    @property
    def custom_call_target(self) -> str | None:
        return self.attr(r'custom_call_target="([^"]*)"')

    @property
    def output_to_operand_aliasing(self) -> list[tuple[tuple[int, ...], int]]:
        """[(output shape index, operand number)] from `output_to_operand_aliasing={{0}: (2, {})}`."""
        body = self.attr(r"output_to_operand_aliasing=\{(.*?\})\s*\)\s*\}") or ""
        pairs = re.findall(r"\{([\d,\s]*)\}:\s*\((\d+),", body + ")")
        return [(tuple(int(i) for i in out.split(",") if i.strip()), int(op)) for out, op in pairs]

    def mlir_attr(self, key: str) -> str | None:
        """A key of an MLIR-dictionary backend_config (Triton custom calls): `grid_x = 4 : i32`."""
        return self.attr(rf"\b{key} = (\"[^\"]*\"|[-\w.]+)")

    def json_backend_config(self) -> dict:
        raw = self.attr(r"backend_config=(\{.*\})\s*$")
        try:
            return json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            return {}


@dataclasses.dataclass
class Computation:
    name: str
    is_entry: bool
    instrs: dict[str, Instr]  # in printed (= scheduled) order
    root: str = ""

    def parameters(self) -> dict[int, Instr]:
        return {i.parameter_number: i for i in self.instrs.values() if i.opcode == "parameter"}

    def users(self, name: str) -> list[Instr]:
        return [i for i in self.instrs.values() if name in i.operands]


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group that opens at text[start] == '('."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parentheses in HLO line: {text[:200]!r}")


def parse_instruction(line: str) -> Instr:
    # Triton custom calls carry their MLIR bytecode as one huge string: blank every long string
    # so that nothing inside it can look like an attribute.
    line = _STRING.sub(lambda m: m.group(0) if len(m.group(0)) < 256 else '""', line)
    line = _COMMENT.sub("", line)
    head = _HEAD.match(line)
    if not head:
        raise ValueError(f"not an HLO instruction line: {line[:200]!r}")
    pos = head.end()
    if line[pos] == "(":
        end = _balanced(line, pos)
    else:
        end = line.index(" ", pos)
    shape = parse_shape(line[pos:end])
    m = re.compile(r"\s*([\w\-$]+)\(").match(line, end)
    if not m:
        raise ValueError(f"no opcode after the shape in HLO line: {line[:200]!r}")
    close = _balanced(line, m.end() - 1)
    raw_operands = line[m.end():close - 1]
    opcode = m.group(1)
    operands = [] if opcode in ("parameter", "constant", "iota") else re.findall(r"%([\w.\-]+)", raw_operands)
    return Instr(head.group(2), shape, opcode, operands, line[close:], raw_operands, bool(head.group(1)))


def parse_module(text: str) -> Module:
    computations: dict[str, Computation] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m:
                current = Computation(m.group(2), bool(m.group(1)), {})
                computations[current.name] = current
                if current.is_entry:
                    entry = current.name
            continue
        if line.startswith("}"):
            current = None
        elif line.strip():
            instr = parse_instruction(line)
            current.instrs[instr.name] = instr
            if instr.is_root:
                current.root = instr.name
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text() of the whole module")
    for comp in computations.values():
        if not comp.root and comp.instrs:
            comp.root = list(comp.instrs)[-1]
    return Module(computations, entry)
