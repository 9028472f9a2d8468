"""What requirements.txt asks of pip (issue 40): on a GPU node whose CUDA torch is installed
already, or after `pip install vllm` (which pins its own torch), `pip install -r
requirements.txt` must keep that torch. So the file names torch with a lower bound the code
needs and no pin; the exact CPU pin lives where CPU installs happen (.ci/run, the README's CPU
line). How it was checked with pip itself is in docs/PAPER_SETUP.md ("Installing on a GPU node")."""
import os

from packaging.requirements import Requirement

from conftest import ROOT


def requirements() -> dict[str, Requirement]:
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        reqs = [Requirement(line.split("#")[0].strip()) for line in f if line.split("#")[0].strip()]
    return {r.name.lower(): r for r in reqs}


def test_requirements_keep_the_torch_a_node_already_has():
    torch = requirements()["torch"].specifier
    assert not any(s.operator in ("==", "===", "~=") for s in torch), torch  # no pin
    for have in ("2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.1"):  # the lent GPU's, CI's, a newer one
        assert torch.contains(have, prereleases=True), (have, torch)
    assert not torch.contains("2.10.0")  # older than the code needs


def test_the_cpu_installs_pin_the_torch_ci_tests():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "pip install -q torch==2.13.0" in ci and \
        "pip install torch==2.13.0 && pip install -r requirements.txt" in readme


def test_the_lesson_stays_within_its_budget():
    """The reader's path (the top-level .py files but evaluate.py and judge.py, and rule_words.py:
    the rule user's word lists, data beside the code that reads them) at most 2,800 lines,
    simulator.py at most 600; train.py a launcher nothing in the project imports (benchmarks run
    it as a process)."""
    import glob
    import re
    path = [f for f in glob.glob(os.path.join(ROOT, "*.py"))
            if os.path.basename(f) not in ("evaluate.py", "judge.py", "rule_words.py")]
    lines = {os.path.basename(f): len(open(f, encoding="utf-8").read().splitlines()) for f in path}
    assert sum(lines.values()) <= 2800, lines
    assert lines["simulator.py"] <= 600
    long = [(os.path.basename(f), n) for f in path for n, line in enumerate(open(f, encoding="utf-8"), 1)
            if len(line.rstrip("\n")) > 120]
    assert not long, long  # the budget is met by simplifying, not by long lines
    code = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "plumbing", "*.py")) + \
        glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
    importers = [f for f in code
                 if re.search(r"^\s*(import train\b|from train import)", open(f, encoding="utf-8").read(), re.M)]
    assert not importers, importers


def project_imports() -> dict:
    """Each module of the project (the top-level files and plumbing/) -> the project modules it
    imports, anywhere in it (a function's own import included), read from the source."""
    import ast
    import glob
    files = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "plumbing", "*.py"))
    names = {os.path.relpath(f, ROOT)[:-3].replace(os.sep, "."): f for f in files}
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}  # from plumbing import models
        graph[name] = sorted(m for m in found if m in names and m != name)
    return graph


def test_the_house_has_no_import_circle_and_the_lesson_imports_no_plumbing():
    """Imports go one way: no circle among the project's modules (plumbing/ included: its leaf
    helpers are in plumbing/files.py, which imports nothing of the project), and no lesson file
    imports plumbing/ (it may take plumbing only as a function argument); the entry points
    train.py and evaluate.py are the launcher's side."""
    graph = project_imports()
    done, path = set(), []

    def visit(node):  # depth first: a node met again on the current path closes a circle
        if node in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        path.append(node)
        for nxt in graph[node]:
            visit(nxt)
        path.pop()
        done.add(node)
    for node in graph:
        visit(node)
    assert graph["plumbing.files"] == []
    lesson = [n for n in graph if "." not in n and n not in ("train", "evaluate")]
    assert {"rule_user", "rule_words", "simulator", "rollout", "grpo", "ppo"} <= set(lesson)
    into = {n: [m for m in graph[n] if m.startswith("plumbing")] for n in lesson}
    assert not any(into.values()), into


def test_ci_lints_the_tree_before_the_tests():
    """pyproject.toml holds the linter's settings (pyflakes, pycodestyle's errors and warnings,
    import order, at 120 characters, no rule ignored for the whole tree) and .ci/run runs it,
    pinned, before the suite: a finding fails CI before any test runs."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        ruff = tomllib.load(f)["tool"]["ruff"]
    assert ruff["line-length"] == 120 and set(ruff["lint"]["select"]) == {"F", "E", "W", "I"}
    assert not ruff["lint"].get("ignore") and not ruff["lint"].get("per-file-ignores"), ruff["lint"]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert "pip install -q ruff==" in ci and ci.index("\nruff check .\n") < ci.index("pytest")
