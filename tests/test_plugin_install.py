"""The plugin apart from the lab: ``pip install .`` brings only what ``fairseq-train --user-dir
mlmha_fairseq`` needs, and the lab's commands, run without their libraries, say in one line to
install ``mlmha_fairseq[lab]``.

Proved against a real environment, not by hiding imports: a virtual environment (no pip) that
sees only torch, fairseq-fixed, the runtime dependencies their metadata declare and the plugin's
own ``[project] dependencies``, each found with importlib.metadata and linked from this
environment, plus this source tree's package. fairseq-train and fairseq-generate run there.
"""
import ast
import importlib.metadata
import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path
from typing import List, NamedTuple

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from fairseq_helpers import hypotheses_and_references, run_fairseq, train_args
from mlmha_fairseq.errors import LAB_EXTRA, LAB_PACKAGES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mlmha_fairseq"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
DEPENDENCIES = [Requirement(text) for text in PROJECT["dependencies"]]
# What the plugin needs beside its declared dependencies: pyproject.toml leaves torch and
# fairseq to scripts/setup_venv.sh (see its comment); fairseq brings hydra and omegaconf, its API.
NOT_DECLARED = ("torch", "fairseq-fixed")
FAIRSEQ_IMPORTS = {"torch", "fairseq", "hydra", "omegaconf"}
# The lab's libraries must be missing there; COMET (requirements-comet.txt) too.
ABSENT = sorted(LAB_PACKAGES) + ["comet"]
SEPARATE_TREES = ("..", "__pycache__")  # RECORD entries outside site-packages (scripts), caches


def module_file(name):
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imported_names(name, tree):
    """Absolute names of every import in a module, function-level ones included (they run too)."""
    package = name if module_file(name).name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # submodules, where they are


def plugin_modules():
    """The package's modules that ``fairseq-train --user-dir`` loads: the package and what it
    imports, and every module of models/ and tasks/ (fairseq imports those folders' files), each
    with the top-level names of the other libraries it imports."""
    todo = [PACKAGE] + [f"{PACKAGE}.{folder}.{path.stem}" for folder in ("models", "tasks")
                        for path in (ROOT / PACKAGE / folder).glob("*.py") if path.stem != "__init__"]
    found = {}
    while todo:
        name = todo.pop()
        if name in found or module_file(name) is None:
            continue
        found[name] = set()
        for imported in imported_names(name, ast.parse(module_file(name).read_text(encoding="utf-8"))):
            parts = imported.split(".")
            if parts[0] == PACKAGE:
                todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            elif parts[0] not in sys.stdlib_module_names:
                found[name].add(parts[0])
    return found


def import_names(distribution):
    return {name for name, owners in importlib.metadata.packages_distributions().items()
            if canonicalize_name(distribution) in map(canonicalize_name, owners)}


def test_the_plugin_imports_only_fairseq_torch_and_its_declared_dependencies():
    allowed = FAIRSEQ_IMPORTS.union(*(import_names(requirement.name) for requirement in DEPENDENCIES))
    modules = plugin_modules()
    assert f"{PACKAGE}.models.slot_transformer" in modules and f"{PACKAGE}.errors" in modules
    assert not any(name.startswith(f"{PACKAGE}.{lab}") for name in modules
                   for lab in ("cli", "corpus", "evaluation", "experiments"))
    outside = {name: sorted(imports - allowed) for name, imports in modules.items() if imports - allowed}
    assert not outside, f"plugin modules import libraries the plugin does not declare: {outside}"


def test_the_lab_extra_installs_every_lab_library_and_analysis_is_its_alias():
    extras = PROJECT["optional-dependencies"]
    lab = {canonicalize_name(Requirement(text).name) for text in extras["lab"]}
    assert {canonicalize_name(name) for name in LAB_PACKAGES.values()} <= lab
    assert [Requirement(text) for text in extras["analysis"]] == [Requirement(LAB_EXTRA)]
    declared = {canonicalize_name(requirement.name) for requirement in DEPENDENCIES}
    assert not declared & lab, "a lab library among the plugin's dependencies"


def requirement_closure(roots):
    """The installed distributions ``roots`` need, with what their metadata requires (no
    extras), transitively. One declared but not installed is left out: fairseq-fixed's
    torchaudio, which scripts/setup_venv.sh does not install."""
    closure, todo = {}, list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in closure:
            continue
        try:
            closure[name] = distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in distribution.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return closure


def top_level_entries(distribution):
    """What a distribution installed at the top of site-packages: packages, modules, extension
    files, shared-library folders and its own .dist-info."""
    if distribution.files is None:
        raise AssertionError(f"{distribution.metadata['Name']} has no RECORD: its files are unknown")
    return {file.parts[0] for file in distribution.files
            if file.parts[0] not in SEPARATE_TREES and not file.parts[0].endswith(".pth")}


class PluginEnv(NamedTuple):
    python: List[str]  # its interpreter, isolated: no PYTHONPATH, user site or current directory
    user_dir: Path  # the plugin folder it sees
    lab_command: subprocess.Popen  # a lab command run there, started at once: it overlaps the training


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """A virtual environment with the plugin and what it needs, nothing else."""
    root = tmp_path_factory.mktemp("plugin-env")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root / "venv")
    site = root / "site"
    site.mkdir()
    closure = requirement_closure([*NOT_DECLARED, *(requirement.name for requirement in DEPENDENCIES)])
    assert {"torch", "fairseq-fixed", "numpy"} <= set(closure)
    # a folder that several distributions share (a namespace package) is linked once; whether
    # it brings a lab library along is what test_the_lab_libraries_are_missing_there asks
    entries = {entry: distribution.locate_file(entry)
               for distribution in closure.values() for entry in top_level_entries(distribution)}
    for entry, target in entries.items():
        (site / entry).symlink_to(target)
    (site / PACKAGE).symlink_to(ROOT / PACKAGE, target_is_directory=True)
    python = root / "venv" / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "plugin.pth").write_text(f"{site}\n")
    command = [str(python), "-I"]
    lab_command = subprocess.Popen([*command, "-m", f"{PACKAGE}.cli.build_corpus", "--help"], cwd=root,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    yield PluginEnv(command, site / PACKAGE, lab_command)
    if lab_command.poll() is None:
        lab_command.kill()
        lab_command.communicate()


def test_the_lab_libraries_are_missing_there(plugin_env):
    python, user_dir, _ = plugin_env
    probe = ("import importlib.util; "
             f"print(sorted(n for n in {ABSENT!r} if importlib.util.find_spec(n)))")
    result = subprocess.run([*python, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    assert (user_dir / "__init__.py").is_file()


def test_fairseq_trains_and_decodes_a_mechanism_there(plugin_env, data_bin, tmp_path):
    python, user_dir, _ = plugin_env
    args = train_args(data_bin, tmp_path, "slot_transformer",
                      "--decoder-cross-attention", "multi-layer", "--mlmha-variant", "M-11", max_update=2)
    args[args.index("--user-dir") + 1] = user_dir
    run_fairseq("train", *args, python=python, cwd=tmp_path)
    output = run_fairseq("generate", data_bin, "--user-dir", user_dir, "--path", tmp_path / "checkpoint_last.pt",
                         "--beam", "2", "--cpu", "--max-len-a", "1", "--max-len-b", "5",
                         python=python, cwd=tmp_path).stdout
    hypotheses, references = hypotheses_and_references(output)
    assert len(hypotheses) == len(references) == 16


def test_a_lab_command_there_names_the_lab_extra_in_one_line(plugin_env):
    """build_corpus --help, which imports sacremoses at its top: one line, status 1. fairseq's own
    notice that tensorboardX is missing (not fairseq-fixed's requirement) may precede it."""
    stdout, stderr = plugin_env.lab_command.communicate(timeout=300)
    assert plugin_env.lab_command.returncode == 1
    *before, last = stderr.strip().splitlines()
    assert last == (f"build_corpus.py: error: sacremoses is not installed; the corpus builder, experiment "
                    f"runner and analysis tools need it: pip install '{LAB_EXTRA}'")
    assert all(line.startswith("INFO:fairseq.") for line in before), stderr
    assert not stdout
