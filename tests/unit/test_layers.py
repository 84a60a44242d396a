"""The package's layers hold: every module sits in a declared layer (titanlite.LAYERS), imports only from its
own layer or below, at the top of the module (function-level imports only where they buy start-up time, each
with its reason), and no import cycle joins two modules. The checker is tested on planted faults too."""

from __future__ import annotations

import ast
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import titanlite

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "titanlite"
# Where a function-level titanlite import is allowed: the command line, whose commands import their modules
# (and so torch) only when they run, and the launcher, which imports `titanlite check` only for --check (the
# tools that launch without it do not pay for the model code). Each such import says why on its line ("# lazy: ...").
LAZY_MODULES = {"titanlite.commands.cli", "titanlite.commands.launch"}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the titanlite module it imports
    path: Path
    line: int
    text: str
    in_function: bool

    def where(self) -> str:
        return f"{self.path.relative_to(self.path.parents[len(self.module.split('.')) - 1])}:{self.line}: {self.text}"


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under `root` (a folder holding titanlite/), by dotted name."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(root: Path) -> list[Import]:
    """Every import of a titanlite module in the package, with where it is and whether a function holds it.
    `from P import name` counts as an import of P.name when that is a module, else of P."""
    known = modules(root)
    found = []
    for module, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node, in_function in _walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    found.append(Import(module, target, path, node.lineno, lines[node.lineno - 1].strip(), in_function))
    return found


def _walk(tree: ast.AST, in_function: bool = False):
    for node in ast.iter_child_nodes(tree):
        yield node, in_function
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(node, inside)


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer, where) of a module, from titanlite.LAYERS: the longest `where` that contains it ("*" is any one
    name); None for the package root or an undeclared module."""
    parts = module.split(".")[1:]
    found = None
    for layer, where, _ in titanlite.LAYERS:
        pattern = where.split(".")
        inside = len(parts) >= len(pattern) and all(p in ("*", n) for p, n in zip(pattern, parts))
        # The longest `where` wins, and of two as long the one with fewer "*" (models.common over models.*).
        better = found is None or _rank(pattern) > _rank(found[1].split("."))
        if module.startswith(PACKAGE + ".") and inside and better:
            found = (layer, where)
    return found


def _rank(pattern: list[str]) -> tuple[int, int]:
    return len(pattern), -pattern.count("*")


def layer_violations(root: Path) -> list[str]:
    """One line per problem: a module in no declared layer, an import from a higher layer, a function-level
    import where it is not allowed or without its reason."""
    problems = [
        f"{path.relative_to(root)}: in no layer of titanlite.LAYERS"
        for module, path in modules(root).items()
        if module != PACKAGE and layer_of(module) is None
    ]
    for imp in imports(root):
        mine, theirs = layer_of(imp.module), layer_of(imp.target)
        if imp.module == PACKAGE or theirs is None and imp.target != PACKAGE:
            problems.append(f"{imp.where()}  (imports {imp.target}, which is in no layer)")
        elif mine is not None and theirs is not None and theirs[0] > mine[0]:
            problems.append(f"{imp.where()}  (layer {mine[0]}, {mine[1]}, imports layer {theirs[0]}, {theirs[1]})")
        if imp.in_function and (imp.module not in LAZY_MODULES or "# lazy:" not in imp.text):
            problems.append(f"{imp.where()}  (a function-level import: move it to the top of the module)")
    return list(dict.fromkeys(problems))  # one line per import statement, whatever it names


def cycles(root: Path) -> list[str]:
    """Each import cycle between modules, as the chain of imports that closes it (one line per import)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports(root):
        if imp.target != imp.module:
            edges.setdefault(imp.module, {}).setdefault(imp.target, imp)
    found, seen_sets = [], set()
    for start in sorted(edges):
        chain = _path_back(edges, start)
        if chain is not None and frozenset(i.module for i in chain) not in seen_sets:
            seen_sets.add(frozenset(i.module for i in chain))
            found.append(
                " -> ".join(i.module for i in chain) + f" -> {start}\n    " + "\n    ".join(i.where() for i in chain)
            )
    return found


def _path_back(edges: dict[str, dict[str, Import]], start: str) -> list[Import] | None:
    """The shortest chain of imports from `start` back to itself (breadth first), or None."""
    frontier, came = [start], {start: None}
    while frontier:
        nxt = []
        for module in frontier:
            for target, imp in edges.get(module, {}).items():
                if target == start:
                    chain = [imp]
                    while came[chain[0].module] is not None:
                        chain.insert(0, came[chain[0].module])
                    return chain
                if target not in came:
                    came[target] = imp
                    nxt.append(target)
        frontier = nxt
    return None


def test_every_module_imports_only_from_its_layer_or_below():
    problems = layer_violations(REPO)
    assert not problems, "imports that break the layers (titanlite/__init__.py's LAYERS):\n" + "\n".join(problems)


def test_no_import_cycle():
    found = cycles(REPO)
    assert not found, "import cycles:\n" + "\n".join(found)


def test_every_function_level_import_says_why():
    """Third-party imports inside functions too: each says why on its line or the line above (an optional
    dependency, a torch version probe, start-up time)."""
    bare = []
    for path in modules(REPO).values():
        lines = path.read_text().splitlines()
        for node, in_function in _walk(ast.parse(path.read_text())):
            if in_function and isinstance(node, (ast.Import, ast.ImportFrom)):
                here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                if "#" not in here and not above.startswith("#") and not above.startswith(("import ", "from ")):
                    bare.append(f"{path.relative_to(REPO)}:{node.lineno}: {here.strip()}")
    assert not bare, "function-level imports without a reason:\n" + "\n".join(bare)


def planted(tmp_path: Path, file: str, line: str) -> Path:
    """A copy of the package with the module-level import `line` added to `file`."""
    root = tmp_path / "copy"
    shutil.copytree(REPO / PACKAGE, root / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    path = root / PACKAGE / file
    path.write_text(path.read_text() + "\n" + line + "\n")  # a module-level import, at the end
    return root


def test_the_checker_finds_a_planted_upward_import(tmp_path):
    root = planted(tmp_path, "models/gpt2/model.py", "from titanlite.engine.trainer import Trainer")
    problems = layer_violations(root)
    assert len(problems) == 1, problems
    assert (
        problems[0].startswith("titanlite/models/gpt2/model.py:")
        and "from titanlite.engine.trainer import Trainer" in problems[0]
    )
    assert "(layer 2, models.*.model, imports layer 4, engine)" in problems[0]
    assert not layer_violations(REPO)


def test_the_checker_finds_a_planted_cycle_and_a_function_level_import(tmp_path):
    root = planted(tmp_path, "base/errors.py", "from titanlite.base.failures import record")
    found = cycles(root)
    assert (
        len(found) == 1 and "titanlite.base.errors -> titanlite.base.failures -> titanlite.base.errors" in found[0]
    ), found
    assert "titanlite/base/errors.py:" in found[0] and "titanlite/base/failures.py:" in found[0]

    path = root / PACKAGE / "engine" / "validator.py"
    path.write_text(
        path.read_text() + "\n\ndef late():\n    from titanlite.components.loss import IGNORE\n    return IGNORE\n"
    )
    problems = layer_violations(root)
    assert any("validator.py" in p and "a function-level import" in p for p in problems), problems


def test_check_and_the_worker_import_none_of_the_optional_heavy_packages(tmp_path):
    """`titanlite check` and a training worker start without transformers, datasets, wandb or matplotlib (seconds of
    start-up each; the commands that use them import them when they run), and a run without compile never imports
    inductor's compiler, torch._inductor.compile_fx (torch.compiler.cudagraph_mark_step_begin, which only
    compile.mode 'reduce-overhead' needs, imports it: seconds per worker); after the run, none of its threads is
    left."""
    import subprocess
    import sys

    heavy = ["transformers", "datasets", "wandb", "matplotlib", "tensorboard", "pyarrow", "torch._inductor.compile_fx"]
    code = (
        "import sys, titanlite.commands.check, titanlite.commands.train, titanlite.commands.launch; "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules)); "
        "from tests.pool import train_job; "
        f"train_job(['--job.dump_folder', {str(tmp_path)!r}, '--training.steps', '1', '--training.seq_len', '32']); "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules)); "
        "import threading; print([t.name for t in threading.enumerate() if t.name.startswith('titanlite')])"
    )
    one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, **one_rank}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "[]", lines[0]  # on import
    assert lines[-2] == "[]", lines[-2]  # after a training step
    assert lines[-1] == "[]", lines[-1]  # and no thread of the run's left (the loader's, building batches ahead)


def test_a_named_folder_outranks_a_wildcard_of_the_same_length():
    # models/common/ is layer 2 (the shared modules), not layer 0 as models.* (a family's torch-free folder) says,
    # but for the torch-free modules it names at layer 0 itself.
    assert layer_of("titanlite.models.common.decoder") == (2, "models.common")
    assert layer_of("titanlite.models.common.decoder_args")[0] == 0
    assert layer_of("titanlite.models.llama3.args") == (0, "models.*")


def test_a_family_is_reached_only_through_the_registry():
    # No module outside a family's folder imports it or names its modules (the registry alone lists the families);
    # code outside titanlite/models/ imports only the generic model modules: common/, the registry, the spec,
    # hf_config and build. Every family is built on models/common/, none on a sibling.
    from titanlite.models.registry import names

    families = set(names())
    generic = {"common", "registry", "spec", "hf_config", "build"}
    problems = []
    for rel, path in modules(REPO).items():
        parts = rel.split(".")
        own = parts[2] if len(parts) >= 3 and parts[1] == "models" else None
        if rel == f"{PACKAGE}.models.registry":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets.append(node.module)
            elif isinstance(node, ast.Import):
                targets.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                targets.extend(re.findall(r"titanlite\.models\.\w+", node.value))
            for target in targets:
                found = re.match(r"titanlite\.models\.(\w+)", target)
                if not found:
                    continue
                name = found.group(1)
                if name in families and name != own:
                    problems.append(f"{path.relative_to(REPO)}:{node.lineno}: {target}")
                elif parts[1] != "models" and name not in generic:
                    problems.append(f"{path.relative_to(REPO)}:{node.lineno}: {target} (not a generic module)")
    assert not problems, "\n".join(problems)
