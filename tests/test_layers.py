"""Issue 20, items 4 and 5: cast_core and tasks show their layers. Read from the import statements
(no module is imported): no server framework, command line or plotting library under cast_core/,
nothing from the orchestration folders, and only the arrows between cast_core's folders that
cast_core/__init__.py allows; every module of tasks/ in one of its three subpackages, and only
the arrows between them that tasks/__init__.py allows (store <- stages <- reporting)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "cast_core"
FORBIDDEN = ("argparse", "matplotlib", "http.server", "socketserver", "starlette", "uvicorn",
             "fastapi", "flask", "tasks", "flows", "benchmarks")
SUBPACKAGES = ("csg", "shapes", "backbones", "scorers")
# folder -> the cast_core folders it may import ("top": the top-level modules)
ALLOWED = {
    "top": {"csg"},
    "csg": set(),
    "shapes": {"top", "csg"},
    "backbones": {"top", "csg", "shapes"},
    "scorers": {"top", "csg", "shapes"},
}
# the only modules of another folder that an adapter layer reaches into
ALLOWED_MODULES = {("backbones", "shapes"): {"cast_core.shapes.world"},
                   ("scorers", "shapes"): {"cast_core.shapes.verifier"}}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in SUBPACKAGES else "top"


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, lazy) of every absolute import in `path`; lazy = inside a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, inner) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, inner))
            visit(child, inner)

    visit(tree, False)
    return found


FILES = sorted(CORE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_server_command_line_plot_or_orchestration_import(path):
    bad = [m for m, _ in _imports(path)
           if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_arrows_between_cast_core_folders(path):
    rel = path.relative_to(CORE)
    source = rel.parts[0] if len(rel.parts) > 1 else "top"
    for module, lazy in _imports(path):
        if module.split(".")[0] != "cast_core":
            continue
        target = _folder(module)
        if target == source:
            continue
        assert target in ALLOWED[source], f"{rel}: {source} may not import {module}"
        allowed = ALLOWED_MODULES.get((source, target))
        assert allowed is None or module in allowed, f"{rel}: {source} may not import {module}"
        if (source, target) == ("scorers", "shapes"):
            assert lazy and rel.name == "registry.py", f"{rel}: {module} only lazily, in registry"


TASKS = ROOT / "tasks"
TASK_FOLDERS = ("store", "stages", "reporting")
# tasks folder -> the tasks folders it may import
TASKS_ALLOWED = {
    "store": set(),
    "stages": {"store"},
    "reporting": {"store", "stages"},
}
TASK_FILES = sorted(TASKS.rglob("*.py"))


def test_every_tasks_module_is_in_a_subpackage():
    loose = [p.name for p in TASKS.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules directly under tasks/: {loose}; place each in {TASK_FOLDERS}"
    folders = sorted(p.name for p in TASKS.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(TASK_FOLDERS)
    assert all((TASKS / f / "__init__.py").exists() for f in TASK_FOLDERS)


@pytest.mark.parametrize("path", TASK_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_arrows_between_tasks_folders(path):
    rel = path.relative_to(TASKS)
    source = rel.parts[0] if len(rel.parts) > 1 else "top"
    for module, _ in _imports(path):
        parts = module.split(".")
        assert parts[0] not in ("flows", "benchmarks"), f"tasks/{rel} imports {module}"
        if parts[0] != "tasks":
            continue
        assert len(parts) > 1 and parts[1] in TASK_FOLDERS, \
            f"tasks/{rel}: import {module} names no subpackage of tasks"
        target = parts[1]
        if target == source:
            continue
        assert target in TASKS_ALLOWED.get(source, set()), \
            f"tasks/{rel}: {source} may not import {module}"
