"""The optimized HLO text XLA dumps (XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text): one
module's instructions, enough to count its matmuls' FLOPs and its collectives.

Read per device, after SPMD partitioning (`*after_optimizations.txt`), by bench/xla_step.py
and tests/test_xla.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
# Ops that pass one tensor through unchanged in content: a weight stays a weight.
_PASS_THROUGH = {"copy", "bitcast", "transpose", "convert", "reshape", "fusion", "call", "get-tuple-element"}
COLLECTIVES = {"all-gather", "all-gather-start", "all-reduce", "all-reduce-start", "reduce-scatter", "all-to-all",
               "collective-permute", "collective-permute-start", "collective-broadcast"}


def arrays(shape: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of each array in an HLO shape (a tuple has several)."""
    return [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in _ARRAY.findall(shape)]


def nbytes(shape: str) -> int:
    return sum(_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in arrays(shape))


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced: {text[start:start + 80]}")


@dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str
    users: list[str] = field(default_factory=list)


class Hlo:
    """One module's text (XLA's HloModule::ToString): enough of it to count matmuls and collectives."""

    def __init__(self, text: str):
        self.instructions: dict[str, Instruction] = {}
        self.bodies: dict[str, list[str]] = {}  # computation -> its instructions' names
        self.entry = ""
        computation = ""
        for line in text.splitlines():
            if (m := _COMPUTATION.match(line)) is not None:
                computation = m.group(2)
                self.bodies[computation] = []
                if m.group(1):
                    self.entry = computation
                continue
            if (parsed := self._instruction(line.strip(), computation)) is not None:
                self.instructions[parsed.name] = parsed
                self.bodies[computation].append(parsed.name)
        for instruction in self.instructions.values():
            for operand in instruction.operands:
                if operand in self.instructions:
                    self.instructions[operand].users.append(instruction.name)

    @staticmethod
    def _instruction(line: str, computation: str) -> Instruction | None:
        if line.startswith("ROOT "):
            line = line[5:]
        if not line.startswith("%") or " = " not in line:
            return None
        name, rest = line[1:].split(" = ", 1)
        end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
        shape, rest = rest[:end], rest[end:].lstrip()
        paren = rest.find("(")
        if paren < 0:
            return None
        close = _balanced(rest, paren)
        return Instruction(name, shape, rest[:paren], _NAME.findall(rest[paren:close]), rest[close:], computation)

    def runs(self, instruction: Instruction) -> set[str]:
        """The opcodes a fusion or call runs (the CPU backend wraps fusions it parallelises in calls)."""
        if instruction.opcode not in ("fusion", "call"):
            return {instruction.opcode}
        found = set()
        for computation in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", instruction.attrs):
            for name in self.bodies.get(computation, []):
                found |= self.runs(self.instructions[name])
        return found

    def dot_flops(self) -> tuple[int, int]:
        """(2*M*N*K summed over every dot, number of dots); convolutions are not expected here."""
        flops = dots = 0
        for i in self.instructions.values():
            if i.opcode != "dot":
                continue
            lhs = arrays(self.instructions[i.operands[0]].shape)[0][1]
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attrs).group(1)
            k = math.prod(lhs[int(d)] for d in contracting.split(",") if d)
            flops += 2 * math.prod(arrays(i.shape)[0][1]) * k
            dots += 1
        return flops, dots

    def count(self, opcode: str) -> int:
        return sum(1 for i in self.instructions.values() if i.opcode == opcode)

    def _from_sharded_parameter(self, name: str) -> bool:
        """Whether `name` is a sharded entry parameter, or one passed through single-input ops."""
        seen = set()
        while name not in seen:
            seen.add(name)
            i = self.instructions[name]
            if i.opcode == "parameter":
                return i.computation == self.entry and "sharding={devices=" in i.attrs
            inputs = [o for o in i.operands if self.instructions[o].opcode != "constant"]
            if i.opcode not in _PASS_THROUGH or len(inputs) != 1:
                return False
            name = inputs[0]
        return False

    def _only_sliced(self, name: str) -> bool:
        """Whether every user keeps a slice of `name`: an all-reduce then dynamic-slice is a reduce-scatter."""
        users = self.instructions[name].users
        for user in map(self.instructions.get, users):
            if user.opcode == "get-tuple-element":
                if not self._only_sliced(user.name):
                    return False
            elif "dynamic-slice" not in self.runs(user):
                return False
        return bool(users)

    def collectives(self) -> list[tuple[str, int]]:
        """(kind, bytes) of every collective: the kinds FSDP needs, or the opcode of another."""
        found = []
        for i in self.instructions.values():
            if i.opcode not in COLLECTIVES:
                continue
            op = i.opcode.removesuffix("-start")
            if op == "all-gather":
                kind = "all-gather (weights)" if self._from_sharded_parameter(i.operands[0]) else "all-gather (activations)"
                found.append((kind, nbytes(i.shape)))
            elif op == "reduce-scatter":
                found.append(("reduce-scatter", sum(nbytes(self.instructions[o].shape) for o in i.operands)))
            elif op == "all-reduce":
                found.append(("reduce-scatter" if self._only_sliced(i.name) else "all-reduce", nbytes(i.shape)))
            else:
                found.append((op, nbytes(i.shape)))
        return found


def collective_totals(modules) -> dict[str, dict[str, int]]:
    """Per kind (Hlo.collectives), the count and bytes over the modules."""
    totals: dict[str, dict[str, int]] = {}
    for module in modules:
        for kind, size in module.collectives():
            entry = totals.setdefault(kind, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += size
    return totals


def step_graph(dump) -> Hlo:
    """The training step's graph in a dump directory (a pathlib.Path): the last compiled of the
    modules with the most matmuls (an evaluation's forward has fewer; the first step's graph, before
    the optimizer's state exists, has as many)."""
    modules = [Hlo(path.read_text()) for path in sorted(dump.glob("*after_optimizations.txt"))]
    most = max(m.dot_flops()[1] for m in modules)
    return [m for m in modules if m.dot_flops()[1] == most][-1]
