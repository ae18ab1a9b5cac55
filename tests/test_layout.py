"""The package layout is the architecture: these tests keep it so.

    floor 0  config.py        engine arguments (no jax)
    floor 1  planner/         host planning: stdlib + numpy, never jax
    floor 1  structured/      structured outputs' host side: stdlib + numpy + llguidance, never jax
    floor 2  ops/             jnp building blocks (attention, KV quantization)
    floor 3  models/          model code, weights, tokenizer
    floor 4  device/          step inputs, runner, sampler, KV pool, sharding
    floor 5  engine/          the step loop, outputs, beam search, data parallelism
    floor 6  entrypoints/     LLM, the CLI, the server
    floor 6  static_profile/  the step compiled for an H100 without a GPU, and read
    floor 6  baseline/        the dense-cache baseline, and how a run of it or of the engine is measured

A module may import from its own floor or below, never above. `pallas_kernels` is a separate
library and imports nothing of jaxpaged. Tests never import benchmarks/ (the instrument, not the
product): what a test needs lives in jaxpaged/ or tests/.
"""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = {"config": 0, "planner": 1, "structured": 1, "ops": 2, "models": 3, "device": 4, "spec_decode": 4, "engine": 5,
          "entrypoints": 6, "static_profile": 6, "baseline": 6}
# The package's own __init__ and the two entry names (python -m jaxpaged.generate / .serve) sit on top.
TOP = {"__init__", "generate", "serve"}
MAX_LINES = 400


def _modules(package: str):
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT), path


def _imported_modules(path: str) -> list[str]:
    """Every module an import statement names, function-level imports included."""
    names = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


TOP_FLOOR = max(FLOORS.values()) + 1


def _floor(module_path: str) -> int | None:
    """`jaxpaged/device/runner.py` or `jaxpaged.device.runner` -> its floor; the package itself, its
    __init__'s names (`jaxpaged.LLM`) and the entry modules are the top; None outside jaxpaged."""
    parts = module_path.replace(".py", "").replace(os.sep, ".").split(".")
    if parts[0] != "jaxpaged":
        return None
    if len(parts) < 2 or parts[1] not in FLOORS:
        return TOP_FLOOR
    return FLOORS[parts[1]]


def test_every_subpackage_has_a_floor():
    for entry in os.listdir(os.path.join(ROOT, "jaxpaged")):
        name = entry[:-3] if entry.endswith(".py") else entry
        if entry.startswith("__pycache__") or name in TOP:
            continue
        assert name in FLOORS, f"jaxpaged/{entry} has no floor: add it to FLOORS and to DESIGN.md's picture"


def test_no_module_imports_from_a_higher_floor():
    upward = []
    for rel, path in _modules("jaxpaged"):
        floor = _floor(rel)
        if floor == TOP_FLOOR:
            continue
        for name in _imported_modules(path):
            target = _floor(name)
            if target is not None and target > floor:
                upward.append(f"{rel} (floor {floor}) imports {name} (floor {target})")
    assert not upward, "\n".join(upward)


def test_pallas_kernels_import_nothing_of_jaxpaged():
    bad = [(rel, n) for rel, path in _modules("pallas_kernels") for n in _imported_modules(path)
           if n.split(".")[0] == "jaxpaged"]
    assert not bad


def _loads_benchmarks(node) -> bool:
    """An import statement of `benchmarks`, or a call that loads a module by a name or path naming it."""
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "benchmarks" for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] == "benchmarks"
    if isinstance(node, ast.Call):
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        loaders = {"import_module", "__import__", "spec_from_file_location", "run_path", "SourceFileLoader"}
        return func in loaders and any(isinstance(n, ast.Constant) and isinstance(n.value, str) and
                                       "benchmarks" in n.value for arg in node.args for n in ast.walk(arg))
    return False


def test_no_test_imports_benchmarks():
    bad = [f"{rel}:{node.lineno}" for rel, path in _modules("tests")
           for node in ast.walk(ast.parse(open(path).read())) if _loads_benchmarks(node)]
    assert not bad, "tests import benchmarks/; move what they need into jaxpaged/ or tests/:\n" + "\n".join(bad)


def test_the_planner_never_imports_jax():
    planner = sorted(rel[:-3].replace(os.sep, ".") for package in ("jaxpaged/planner", "jaxpaged/structured")
                     for rel, _ in _modules(package))
    code = ("import sys\n" + "".join(f"import {m.removesuffix('.__init__')}\n" for m in planner)
            + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
            + "assert not bad, bad\nprint(len(sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_no_module_is_longer_than_one_sitting():
    long = [f"{rel}: {n} lines" for package in ("jaxpaged", "pallas_kernels", "benchmarks", "scripts")
            for rel, path in _modules(package) if (n := sum(1 for _ in open(path))) > MAX_LINES]
    assert not long, "split these into one concept per file:\n" + "\n".join(long)
