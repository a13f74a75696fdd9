"""The module graph: data flows one way (scripts and server -> generate -> chat -> decode -> model -> config and
kernels; quantize and tp act on the model), no cycles, no
project imports hidden inside functions, and a script run as __main__ is never imported a second time."""

import ast
import re
import shutil
import subprocess
import sys

from conftest import ROOT

SOURCES = sorted(ROOT.glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
PROJECT = {path.stem for path in SOURCES}


def project_imports(path) -> tuple[set[str], list[str]]:
    """The project modules a file imports at its top level, and those it imports anywhere else (as 'line: name')."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    imported, nested = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module.split(".")[0]]
        else:
            continue
        for name in (n for n in names if n in PROJECT):
            if id(node) in top:
                imported.add(name)
            else:
                nested.append(f"{node.lineno}: {name}")
    return imported, nested


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph as a path [a, b, ..., a], or None."""
    state = {}  # name -> "open" while on the current path, "done" after

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return path[path.index(other) :] + [other]
            if other not in state and (cycle := visit(other, path + [other])):
                return cycle
        state[name] = "done"
        return None

    return next((c for name in sorted(graph) if name not in state and (c := visit(name, [name]))), None)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for other in graph[todo.pop()] - seen:
            seen.add(other)
            todo.append(other)
    return seen


def test_import_graph_is_acyclic_and_flows_one_way():
    graph, nested = {}, {}
    for path in SOURCES:
        graph[path.stem], inside = project_imports(path)
        if inside:
            nested[path.name] = inside
    assert not nested, f"project imports inside functions: {nested}"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    assert graph["kernels"] == graph["config"] == graph["tokenizer"] == graph["sampling"] == set()
    assert graph["model"] == {"config", "kernels"} and "kernels" in graph["quantize"]
    for module in (
        "kernels",
        "model",
        "quantize",
        "tp",
        "checkpoint",
        "results",
        "decode",
        "chat",
        "engine",
        "api",
        "convert_hf_checkpoint",
        "convert_gguf",
    ):
        assert "generate" not in reachable(graph, module), f"{module} reaches generate.py"
    assert not [name for name, deps in graph.items() if "server" in deps], "server.py is a leaf: nothing imports it"
    for name in ("server", "eval", "benchmark", "bench_server", "speculative_demo", "passkey"):  # as README's tour says
        assert "generate" in graph[name], name
    assert {"quantize", "tp", "model", "decode", "chat"} <= graph["generate"]
    assert {"api", "engine"} <= graph["server"] and "engine" in graph["api"]  # routes -> API objects -> engine


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def test_readme_is_short_and_every_link_resolves():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    for page in [readme, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.is_file(), f"{page.name}: {target} is not a file"
            if anchor:
                assert anchor in heading_anchors(linked.read_text()), f"{page.name}: no heading #{anchor} in {path}"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_a_script_is_imported_once(tiny_checkpoint, tmp_path):
    """python quantize.py runs quantize.py as __main__ only: nothing imports a second copy as 'quantize'."""
    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "tiny") / "model.pth"
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            str(ROOT / "quantize.py"),
            "--checkpoint_path",
            str(checkpoint),
            "--mode",
            "int8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "model" in imported and "checkpoint" in imported  # what importtime reports: the project's modules too
    assert "quantize" not in imported
