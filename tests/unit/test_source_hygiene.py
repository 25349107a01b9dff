"""Source-tree rules that keep untrusted bytes from executing code.

- No pickle (nor its relatives: marshal, shelve, dill, cloudpickle, joblib),
  and no `multiprocessing` (it pickles every argument and result); the
  verifier sandbox speaks MessagePack to plain subprocesses instead.
- `torch.load` only with `weights_only=True` (torch's restricted unpickler).
- No `eval`/`exec` of message content and no `yaml.load` (only safe_load).

Scans every .py file Flywheel ships or runs (proto, services, bench, tests);
comments and docstrings may mention the words, code may not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.harness import REPO

ROOT = REPO
SCANNED = ("proto", "services", "bench", "tests")
FORBIDDEN_MODULES = {
    "pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve",
    "multiprocessing", "concurrent.futures.process",
}  # fmt: skip
FORBIDDEN_NAMES = {"ProcessPoolExecutor"}


def python_files() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)


def violations(source: str) -> list[str]:
    """What in `source` breaks the rules, as "line: what" strings (pure, tested below)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if _forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _forbidden(node.module):
                found.append(f"{line}: from {node.module} import …")
            found += [f"{line}: {a.name}" for a in node.names if a.name in FORBIDDEN_NAMES]
        elif isinstance(node, ast.Call):
            name = _call_name(node.func)
            if name == "torch.load" and not _kw_true(node, "weights_only"):
                found.append(f"{line}: torch.load without weights_only=True")
            if name in ("yaml.load", "yaml.unsafe_load"):
                found.append(f"{line}: {name} (use yaml.safe_load)")
            if name in ("eval", "exec"):
                found.append(f"{line}: {name}()")
            if name.endswith(("pickle.loads", "pickle.load")):
                found.append(f"{line}: {name}")
    return found


def _forbidden(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in FORBIDDEN_MODULES)


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_call_name(func.value)}.{func.attr}"
    return ""


def _kw_true(call: ast.Call, name: str) -> bool:
    return any(
        k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def test_the_scan_finds_what_it_forbids() -> None:
    bad = (
        "import pickle\nfrom multiprocessing import Pool\nimport torch\n"
        "torch.load('x')\ntorch.load('x', weights_only=False)\n"
        "from concurrent.futures import ProcessPoolExecutor\neval('1')\n"
    )
    found = violations(bad)
    assert len(found) == 6, found
    ok = "import torch\ntorch.load('x', weights_only=True)\n# pickle is mentioned here\n"
    assert violations(ok) == []


# The one exception, by design: the Python tool of multi-turn episodes runs the policy's
# code, only inside a confined tool-sandbox child (ToolPool: memory limit, no sockets or
# subprocesses, killed on timeout), never on message content in a service process.
ALLOWED = {"services/tasks/tools.py": {"exec()", "eval()"}}


def test_no_pickle_multiprocessing_or_unsafe_torch_load_in_the_tree() -> None:
    files = python_files()
    assert len(files) > 50  # the scan really covers the tree
    problems = {}
    for p in files:
        name = str(p.relative_to(ROOT))
        allowed = ALLOWED.get(name, set())
        v = [x for x in violations(p.read_text()) if x.split(": ", 1)[1] not in allowed]
        if v:
            problems[name] = v
    if problems:
        pytest.fail(f"forbidden deserialisation / process pools: {problems}")


# The sandbox is a package of its own (services/sandbox/), below tasks: the walls
# (bubblewrap, seccomp, rlimits, uids) live there and nowhere in services/tasks/, which
# imports the sandbox through its face (`services.sandbox`) only. What would mean walls
# built in tasks: the modules that build them, and the words of bubblewrap's and
# seccomp's own interfaces in code (docstrings and comments may name them).
WALL_MODULES = {"ctypes", "resource", "seccomp", "pyseccomp"}
WALL_WORDS = ("bwrap", "--unshare", "--seccomp", "prctl", "setrlimit", "SECCOMP_", "BPF_", "HBBI")
SECCOMP_ACTIONS = {0x7FFF0000, 0x80000000, 0x00050000}  # RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO


def sandbox_violations(source: str) -> list[str]:
    """What in `source` (a module of services/tasks) builds sandbox walls or reaches past
    the sandbox's face, as "line: what" strings (pure, tested below)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            if name.partition(".")[0] in WALL_MODULES or name.startswith("services.sandbox."):
                found.append(f"{line}: import {name}")
        if isinstance(node, ast.Attribute) and node.attr in ("prctl", "setrlimit", "unshare"):
            found.append(f"{line}: .{node.attr}")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            found += [f"{line}: {w!r}" for w in WALL_WORDS if w in node.value]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            found += [f"{line}: {node.value:#x}"] if node.value in SECCOMP_ACTIONS else []
    return found


def test_the_sandbox_scan_finds_walls_and_reaches_past_the_face() -> None:
    bad = (
        "import ctypes\nfrom services.sandbox.jail import plan\nimport resource\n"
        "argv = ['bwrap', '--unshare-pid']\nlibc.prctl(4, 0)\n"
        "ALLOW = 0x7FFF0000\nop = struct.pack('=HBBI', 6, 0, 0, ALLOW)\n"
    )
    found = sandbox_violations(bad)
    assert len(found) == 8, found
    ok = (
        '"""Runs in bubblewrap (bwrap), under seccomp."""\n'
        "from services.sandbox import ToolPool, VerifierPool\n"
        "# prctl and setrlimit are the sandbox's\n"
    )
    assert sandbox_violations(ok) == []


def test_services_tasks_holds_no_bubblewrap_or_seccomp_code() -> None:
    files = sorted((ROOT / "services" / "tasks").rglob("*.py"))
    assert len(files) > 20  # the scan really covers the package
    problems = {}
    for p in files:
        if v := sandbox_violations(p.read_text()):
            problems[str(p.relative_to(ROOT))] = v
    if problems:
        pytest.fail(f"sandbox walls or sandbox internals in services/tasks: {problems}")
