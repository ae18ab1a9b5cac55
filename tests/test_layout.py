"""The package layout is the architecture: these tests keep it so.

    floor 0  config.py        engine arguments (no jax)
    floor 1  planner/         host planning: stdlib + numpy, never jax
    floor 1  structured/      structured outputs' host side: stdlib + numpy + llguidance, never jax
    floor 2  ops/             jnp building blocks (attention, KV quantization)
    floor 3  models/          model code, weights, tokenizer
    floor 4  sample/          the sampler, its rows, penalties, logprobs, the per-step StepSampler
    floor 5  device/          step inputs, runner, KV pool, sharding
    floor 6  spec_decode/     speculative decoding: proposers, verifier, the Speculator feature
    floor 6  engine/          the step loop, outputs, beam search, data parallelism
    floor 7  entrypoints/     LLM, the CLI, the server
    floor 7  static_profile/  the step compiled for an H100 without a GPU, and read
    floor 7  baseline/        the dense-cache baseline, and how a run of it or of the engine is measured

A module may import from its own floor or below, never above. `pallas_kernels` is a separate
library and imports nothing of jaxpaged. Within jaxpaged and pallas_kernels no two modules import
each other and no module imports another's private (underscored) names; planner/ never imports
structured/ (structured outputs build on the planner, not the other way); tests never import
benchmarks/. What a test needs lives in jaxpaged/ or tests/.
"""

import ast
import collections
import functools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = {"config": 0, "planner": 1, "structured": 1, "ops": 2, "models": 3, "sample": 4, "device": 5, "spec_decode": 6,
          "engine": 6, "entrypoints": 7, "static_profile": 7, "baseline": 7,
          "rl": 7}
# The package's own __init__ and the two entry names (python -m jaxpaged.generate / .serve) sit on top.
TOP = {"__init__", "generate", "serve"}


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


# Sampling's old homes: thin re-exports of jaxpaged/sample/ kept for one release, for users only.
MOVED_TO_SAMPLE = ("jaxpaged.device.sampler", "jaxpaged.device.sampler_ext", "jaxpaged.device.sampling",
                   "jaxpaged.device.inverse_cdf", "jaxpaged.device.token_state", "jaxpaged.engine.step_sampler",
                   "jaxpaged.engine.logprobs")


def test_nothing_in_the_project_imports_sampling_from_its_old_homes():
    old = [f"{rel} imports {name}" for package in ("jaxpaged", "tests", "benchmarks", "examples", "scripts")
           for rel, path in _modules(package) for name in _imported_modules(path) if name in MOVED_TO_SAMPLE]
    assert not old, "import these from jaxpaged.sample instead:\n" + "\n".join(old)


def test_the_old_sampling_modules_only_re_export_public_names():
    for name in MOVED_TO_SAMPLE:
        path = os.path.join(ROOT, *name.split(".")) + ".py"
        body = ast.parse(open(path).read()).body
        assert isinstance(body[0], ast.Expr) and "this re-export is kept for one release" in body[0].value.value, path
        for node in body[1:]:
            if isinstance(node, ast.ImportFrom):
                assert node.module.startswith("jaxpaged.sample."), f"{path}: imports {node.module}"
                assert not [a.name for a in node.names if a.name.startswith("_")], f"{path}: re-exports a private name"
            else:  # nothing but the imports and __all__: no logic
                assert isinstance(node, ast.Assign) and node.targets[0].id == "__all__", f"{path}: line {node.lineno}"


# ------------------------------------------------------------------ the import graph, module by module

PACKAGES = ("jaxpaged", "pallas_kernels")


def _module_name(rel: str) -> str:
    """`jaxpaged/device/runner.py` -> `jaxpaged.device.runner`; a package's __init__ is the package."""
    return rel[:-3].replace(os.sep, ".").removesuffix(".__init__")


@functools.cache
def _import_graph() -> tuple[dict[str, str], dict[str, set[str]], list[tuple[str, str]]]:
    """(module -> its file, module -> the modules of PACKAGES it imports, [(file, private name
    it imports from another module)]), function-level imports included.

    `from a.b import c` points at module a.b.c when there is one, else at a.b; `import a.b.c` at the
    longest prefix that is a module. A private module (`pallas_kernels/_common.py`) is its package's
    own: importing public names from it is not importing a private name.
    """
    files = {_module_name(rel): rel for package in PACKAGES for rel, _ in _modules(package)}

    def nearest(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {module: set() for module in files}
    private = []
    for module, rel in files.items():
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, rel)).read())):
            if isinstance(node, ast.Import):
                targets = [nearest(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = []
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if submodule in files:
                        targets.append(submodule)
                        continue
                    source = nearest(node.module)
                    targets.append(source)
                    is_dunder = alias.name.startswith("__") and alias.name.endswith("__")
                    if source not in (None, module) and alias.name.startswith("_") and not is_dunder:
                        private.append((rel, f"{node.module}.{alias.name}"))
            else:
                continue
            edges[module] |= {t for t in targets if t is not None and t != module}
    return files, edges, private


def test_no_two_modules_import_each_other():
    files, edges, _ = _import_graph()
    circles = sorted({tuple(sorted((files[a], files[b]))) for a in edges for b in edges[a] if a in edges[b]})
    assert not circles, ("these modules import each other (at module or function level); move what both "
                         "need where it belongs:\n" + "\n".join(f"{a} <-> {b}" for a, b in circles))


def test_no_module_imports_a_private_name_from_another():
    _, _, private = _import_graph()
    assert not private, ("private names imported from another module; make them public or move the code "
                         "that needs them:\n" + "\n".join(f"{rel} imports {name}" for rel, name in private))


def test_the_planner_never_imports_structured_outputs():
    # Directly or through any other module of jaxpaged: structured/ builds on the planner.
    files, edges, _ = _import_graph()
    bad = []
    for start in sorted(m for m in files if m.startswith("jaxpaged.planner")):
        came_from = {start: None}
        queue = collections.deque([start])
        while queue:
            module = queue.popleft()
            if module.startswith("jaxpaged.structured"):
                chain = [module]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                bad.append(" -> ".join(files[m] for m in reversed(chain)))
                break
            for target in sorted(edges[module] - came_from.keys()):
                came_from[target] = module
                queue.append(target)
    assert not bad, "the planner reaches jaxpaged.structured:\n" + "\n".join(bad)
