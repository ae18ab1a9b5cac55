"""The documents a newcomer reads stay true to the code and stay contracts, not diaries.

- README.md's table of engine arguments is the one scripts/engine_args_table.py generates from
  EngineConfig (a field added, removed or re-commented in jaxpaged/config.py shows here).
- DESIGN.md's floor picture lists the floors tests/test_layout.py enforces.
- README.md and DESIGN.md carry no commit hashes and no "stop N" (history goes to CHANGELOG.md and
  the commit messages), and README.md stays short.
- README.md's test command is the one .ci/run runs.
"""

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 220


def _load(relative_path: str, name: str):
    """A module by its path (tests/ and scripts/ are not packages)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_readme_engine_arguments_are_generated_from_engine_config():
    table = _load("scripts/engine_args_table.py", "engine_args_table")
    assert table.readme_table(_read("README.md")) == table.engine_args_markdown(), (
        f"README.md's engine-argument table differs from EngineConfig in jaxpaged/config.py; "
        f"regenerate it with: {table.COMMAND}")


def test_engine_args_table_has_one_row_per_field_with_a_meaning():
    from dataclasses import fields

    from jaxpaged.config import EngineConfig

    rows = _load("scripts/engine_args_table.py", "engine_args_table").engine_args()
    assert [row[0] for row in rows] == [f.name for f in fields(EngineConfig)]
    assert not [row[0] for row in rows if not row[3]], "every EngineConfig field needs a comment saying what it means"


def floor_picture(design_text: str) -> dict[str, int]:
    """DESIGN.md's lines `floor N  name/  what it is` (or `name.py`), inside fenced blocks."""
    floors = {}
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", design_text, flags=re.M | re.S):
        for match in re.finditer(r"^floor (\d+)\s+([a-z_]+)(?:/|\.py)\s", block, flags=re.M):
            name, floor = match.group(2), int(match.group(1))
            assert name not in floors, f"DESIGN.md's floor picture lists {name} twice"
            floors[name] = floor
    return floors


def test_design_floor_picture_is_test_layouts_floors():
    layout = _load("tests/test_layout.py", "test_layout_floors")
    assert floor_picture(_read("DESIGN.md")) == layout.FLOORS, (
        "DESIGN.md's floor picture (lines `floor N  name/  ...`) must list exactly tests/test_layout.py's FLOORS")


def floor_picture_modules(design_text: str) -> dict[str, str]:
    """Each package's text in DESIGN.md's floor picture: its `floor N  name/` line and the
    indented lines that continue it."""
    entries, current = {}, None
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", design_text, flags=re.M | re.S):
        for line in block.splitlines():
            match = re.match(r"^floor \d+\s+([a-z_]+)/\s+(.*)", line)
            if match:
                current = match.group(1)
                entries[current] = match.group(2)
            elif current is not None and line.startswith(" "):
                entries[current] += " " + line.strip()
            else:
                current = None
    return entries


def test_design_floor_picture_names_every_module():
    """Every module of every jaxpaged package is named on its package's lines of the picture: a
    module added or moved without the picture following shows here."""
    entries = floor_picture_modules(_read("DESIGN.md"))
    missing = []
    for package, text in entries.items():
        folder = os.path.join(ROOT, "jaxpaged", package)
        modules = {name[:-3] for name in os.listdir(folder) if name.endswith(".py") and name != "__init__.py"}
        missing += [f"jaxpaged/{package}/{m}.py" for m in sorted(modules - set(re.findall(r"[a-z][a-z0-9_]*", text)))]
    assert not missing, "DESIGN.md's floor picture does not name these modules:\n" + "\n".join(missing)


COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", flags=re.I)
STOP_N = re.compile(r"\bstop\s+\d+", flags=re.I)


def diary_marks(text: str) -> list[str]:
    """Commit hashes (7-40 hex characters alone as a word, with a letter and a digit) and "stop N"."""
    return COMMIT_HASH.findall(text) + STOP_N.findall(text)


def test_readme_and_design_are_contracts_not_diaries():
    for name in ("README.md", "DESIGN.md"):
        assert not diary_marks(_read(name)), (
            f"{name} names commits or stops {diary_marks(_read(name))}: history goes to CHANGELOG.md")


def test_diary_marks_finds_hashes_and_stops():
    assert diary_marks("measured on ad249dc at stop 48") == ["ad249dc", "stop 48"]
    assert diary_marks("7245688a") == ["7245688a"]
    assert not diary_marks("float8_e4m3fn, 2048 pages, abcdefab, 1234567, stop strings, page_size 16")


def test_readme_is_short():
    lines = _read("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to what a newcomer needs (DESIGN.md has the rest)"


def _readme_test_command() -> str:
    readme = _read("README.md")
    section = readme.split("**Set up and run the tests**", 1)[1]
    return re.search(r"```bash\n(.*?)\n```", section, flags=re.S).group(1).strip()


def test_ci_runs_the_readme_test_command():
    """.ci/run spells the README's one line out step by step (pip with -q); each step must be there."""
    ci = _read(".ci/run")
    for step in _readme_test_command().split(" && "):
        if step.startswith("pip install "):
            step = "python -m pip install -q " + step[len("pip install "):]
        assert step in ci, f".ci/run must run the README's test command; it lacks: {step}"
