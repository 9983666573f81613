"""A downstream user's ``mypy --strict`` over opttree and megatron-core, from the wheels.

The opttree wheel and the stub wheel (``stubs/``, distribution opttree-stubs-megatron) are
built with ``pip wheel --no-deps`` (hatchling, fetched from PyPI by pip's build isolation
unless this lane has it), and installed with ``--no-deps`` into a fresh virtual
environment. mypy then checks a small module written here that imports opttree and
megatron-core's optimizer types, with no ``mypy_path`` and no ``ignore_missing_imports``:
what it resolves comes from that environment's packages alone, as for a user who ran
``pip install "opttree[megatron]"``.

Installing torch (gigabytes) into each new environment would make the test take minutes,
so the third-party packages come from this lane instead, read-only: a folder of symbolic
links to the lane's installed files of torch, attrs, megatron-core, mypy,
emerging-optimizers (where installed) and of what they require (their metadata's
``Requires-Dist``, markers evaluated, extras left out), named on ``sys.path`` by a
``.pth`` file in the new environment's site-packages. The folder links nothing else: not
the lane's editable opttree (the repository's ``src``), not ``stubs/`` (which the lane
never installs). The test asserts as much from inside the new environment, and from the
files mypy reports it parsed: opttree's come from the installed wheel, megatron's from
``megatron-stubs`` in it, none from the repository.

A deliberate type error in a second module must be reported, so that the check can fail.
The test is skipped, saying why, only where the wheels cannot be built because pip
cannot get hatchling (offline).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import opttree

REPO = Path(__file__).resolve().parent.parent

REPOSITORY_CODE = (REPO / "src", REPO / "stubs")
"""What the downstream check must not see. (The lanes' virtual environments are folders of
the repository too, which the third-party links point into.)"""

ROOTS = ("torch", "attrs", "megatron-core", "mypy", "emerging-optimizers")
"""The distributions the downstream check needs importable (the last where installed)."""

DOWNSTREAM = '''
"""A training script's use of opttree and megatron-core's optimizer types."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, ParamKey, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import ParamGroupOverride
from megatron.core.transformer.module import MegatronModule

import opttree


def config() -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=3e-4,
        min_lr=3e-5,
        weight_decay=0.1,
        clip_grad=1.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        overlap_param_gather=True,
    )


def build(model_chunks: list[MegatronModule]) -> MegatronOptimizer:
    no_decay: ParamGroupOverride = {"wd_mult": 0.0}
    return get_megatron_optimizer(
        config(), model_chunks, config_overrides={ParamKey(name="*.bias"): no_decay}, use_gloo_process_groups=False
    )


def restart(optimizer: MegatronOptimizer, model_state: dict[str, torch.Tensor]) -> float:
    saved = optimizer.state_dict()
    report = opttree.reset(optimizer, keep_loss_scale=True)
    optimizer.load_state_dict(saved)
    optimizer.reload_model_params()
    optimizer.reload_model_params(state_dict=dict(model_state))
    print(opttree.describe(optimizer, group=parallel_state.get_data_parallel_group()))
    group = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    ranks: int = torch.distributed.get_world_size(group) * parallel_state.get_tensor_model_parallel_world_size()
    scale: torch.Tensor = optimizer.get_loss_scale()
    return float(scale.item()) * ranks + report.tensors_zeroed


class LoraChain:
    """The README's own wrapper, with a typed children function over it."""

    def __init__(self) -> None:
        self.optimizers: dict[str, torch.optim.Optimizer] = {}

    def items(self) -> list[tuple[str, torch.optim.Optimizer]]:
        return list(self.optimizers.items())


class ExpertChain(MegatronOptimizer):
    """An abstract wrapper base (MegatronOptimizer's abstract methods are left so), which a
    wrapper kind is registered for once, for all its subclasses."""

    experts: list[MegatronOptimizer]


def register() -> None:
    opttree.register_wrapper(LoraChain, children=lambda chain: chain.items())
    opttree.register_wrapper(ExpertChain, children=lambda chain: enumerate_experts(chain.experts))
    opttree.register_schema(
        "my_pkg.optim.Rprop",
        opttree.StateSchema(fill={"step_size": lambda group, defaults: group["lr"]}, step=opttree.StepLocation.PER_PARAMETER),
    )


def enumerate_experts(experts: list[MegatronOptimizer]) -> list[tuple[str, MegatronOptimizer]]:
    return [(f"expert{i}", expert) for i, expert in enumerate(experts)]


def thin(optimizer: torch.optim.Optimizer) -> int:
    pruned = opttree.prune(optimizer, torch.tensor(0.5))
    return pruned.tensors_zeroed + opttree.scale(optimizer, torch.tensor(0.5), keys=["exp_avg"]).tensors_zeroed
'''

BROKEN = '''
"""Errors mypy must report: in megatron-core's stubbed types, and in opttree's own."""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig

import opttree


def by_rank(rank: int) -> list[tuple[str, MegatronOptimizer]]:
    return []


def broken(optimizer: MegatronOptimizer) -> None:
    opttree.register_wrapper(MegatronOptimizer, children=by_rank)  # E: misc
    OptimizerConfig(clip_grad="1.0")  # E: arg-type
    OptimizerConfig(lr=1e-3, learning_rate=1e-3)  # E: call-arg
    report: int = opttree.reset(optimizer)  # E: assignment
    size: str = parallel_state.get_data_parallel_world_size()  # E: assignment
    print(report, size)
'''

CONFIG = "[mypy]\nstrict = True\nwarn_unreachable = True\n"
"""The downstream mypy configuration: strict, and nothing else (no mypy_path, nothing ignored)."""


def in_repository_code(path: Path) -> bool:
    return any(path.is_relative_to(folder) for folder in REPOSITORY_CODE)


def requirement_closure(roots: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``roots`` name and, recursively, those they require."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a marker-free requirement this platform's wheel does not pull in
        seen[name] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(seen.values())


def top_level_entries(dist: importlib.metadata.Distribution) -> set[str]:
    """The names a distribution installed directly in site-packages (packages, modules,
    its .dist-info), from its RECORD; not its scripts or .pth files."""
    names = set()
    for file in dist.files or []:
        parts = Path(str(file)).parts
        if parts and parts[0] != ".." and not parts[0].endswith(".pth") and parts[0] != "__pycache__":
            names.add(parts[0])
    return names


def run(command: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def build_wheels(out: Path) -> tuple[Path, Path]:
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out)]
    if importlib.util.find_spec("hatchling") is not None:
        command.append("--no-build-isolation")
    done = run(command + [str(REPO), str(REPO / "stubs")], cwd=out)
    if done.returncode != 0:
        log = done.stdout + done.stderr
        if "install build dependencies" in log or "No matching distribution found for hatchling" in log:
            pytest.skip(f"cannot build the wheels: pip cannot install hatchling for build isolation:\n{log[-1500:]}")
        pytest.fail(f"pip wheel failed:\n{log}")
    (main,) = out.glob("opttree-*.whl")
    (stubs,) = out.glob("opttree_stubs_megatron-*.whl")
    return main, stubs


@dataclasses.dataclass(frozen=True)
class Downstream:
    python: Path
    """The fresh environment's interpreter."""
    site: Path
    """Its site-packages, where the wheels are installed."""
    third_party: Path
    """The folder of links to the lane's third-party packages."""
    code: Path
    """The downstream code and its mypy.ini."""
    main_wheel: Path
    """The built opttree wheel."""
    stub_wheel: Path
    """The built opttree-stubs-megatron wheel."""


@pytest.fixture(scope="module")
def downstream(tmp_path_factory: pytest.TempPathFactory) -> Downstream:
    root = tmp_path_factory.mktemp("downstream")
    (root / "dist").mkdir()
    main, stubs = build_wheels(root / "dist")

    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet"]
    done = run(install + [str(main), str(stubs)], cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root).stdout.strip())

    third_party = root / "third_party"
    third_party.mkdir()
    for dist in requirement_closure(ROOTS):
        if canonicalize_name(dist.metadata["Name"]) == "opttree":
            continue
        for name in top_level_entries(dist):
            source = Path(str(dist.locate_file(name)))
            if source.exists() and not (third_party / name).exists():
                (third_party / name).symlink_to(source)
    (site / "lane-third-party.pth").write_text(f"{third_party}\n")

    code = root / "code"
    code.mkdir()
    (code / "mypy.ini").write_text(CONFIG)
    (code / "training.py").write_text(textwrap.dedent(DOWNSTREAM).lstrip())
    (code / "broken.py").write_text(textwrap.dedent(BROKEN).lstrip())
    return Downstream(python, site, third_party, code, main, stubs)


def test_the_stub_distribution_is_partial_and_versioned_with_opttree() -> None:
    stubs_project = tomllib.loads((REPO / "stubs" / "pyproject.toml").read_text())["project"]
    assert stubs_project["version"] == opttree.__version__
    assert (REPO / "stubs" / "megatron" / "py.typed").read_text() == "partial\n"
    assert (REPO / "stubs" / "emerging_optimizers" / "py.typed").read_text() == "partial\n"


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")]


def required_with(requirements: list[Requirement], extra: str) -> set[str]:
    """The distributions a ``pip install`` with ``extra`` ("" for none) pulls in directly."""
    return {
        canonicalize_name(r.name)
        for r in requirements
        if r.marker is None or r.marker.evaluate({"extra": extra})
    }


def test_the_core_wheel_requires_torch_and_attrs_alone(downstream: Downstream) -> None:
    """``pip install opttree`` pulls no megatron-core, which would install the PyPI package
    over a fork's ``megatron/``; ``opttree[megatron]`` adds it and the stubs, pinned to
    opttree's version."""
    requirements = wheel_requirements(downstream.main_wheel)
    assert required_with(requirements, "") == {"torch", "attrs"}
    assert required_with(requirements, "megatron") == {"torch", "attrs", "megatron-core", "opttree-stubs-megatron"}
    (stubs,) = [r for r in requirements if canonicalize_name(r.name) == "opttree-stubs-megatron"]
    assert str(stubs.specifier) == f"=={opttree.__version__}"
    assert wheel_requirements(downstream.stub_wheel) == []


def test_the_stub_wheel_holds_the_stub_packages_alone(downstream: Downstream) -> None:
    names = zipfile.ZipFile(downstream.stub_wheel).namelist()
    packages = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert packages == {"megatron-stubs", "emerging_optimizers-stubs"}
    stub_files = [name for name in names if not name.split("/")[0].endswith(".dist-info")]
    assert all(name.endswith((".pyi", "/py.typed")) for name in stub_files), stub_files
    assert "megatron-stubs/core/optimizer/optimizer.pyi" in names


def test_the_environment_sees_the_wheels_not_the_repository(downstream: Downstream) -> None:
    probe = """
import importlib.util, json, sys
print(json.dumps({
    "path": sys.path,
    "opttree": importlib.util.find_spec("opttree").origin,
    "torch": importlib.util.find_spec("torch").origin,
    "mypy": importlib.util.find_spec("mypy").origin,
    "megatron": list(importlib.util.find_spec("megatron").submodule_search_locations),
}))
"""
    done = run([str(downstream.python), "-c", probe], cwd=downstream.code)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    site = downstream.site
    assert Path(seen["opttree"]) == site / "opttree" / "__init__.py"
    assert (site / "opttree" / "py.typed").is_file()
    assert (site / "megatron-stubs" / "py.typed").read_text() == "partial\n"
    assert (site / "megatron-stubs" / "core" / "optimizer" / "optimizer_config.pyi").is_file()
    assert str(downstream.third_party) in seen["path"]
    for entry in seen["path"]:
        where = (downstream.code / entry).resolve()  # "" is the working directory
        assert where != REPO and not in_repository_code(where), f"{entry} on sys.path"
    linked = {p.name for p in downstream.third_party.iterdir()}
    assert {"torch", "attr", "attrs", "megatron", "mypy"} <= linked
    assert not [name for name in linked if name.startswith(("opttree", "__editable__", "_opttree"))]
    assert all(Path(p).is_relative_to(downstream.third_party) for p in (seen["torch"], seen["mypy"], *seen["megatron"]))


def mypy(downstream: Downstream, module: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cache = downstream.code / ".mypy_cache"
    command = [str(downstream.python), "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", str(cache), *extra, module]
    return run(command, cwd=downstream.code)


def test_mypy_strict_passes_downstream_code_from_the_wheels(downstream: Downstream) -> None:
    done = mypy(downstream, "training.py", "--verbose")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "Success: no issues found in 1 source file" in done.stdout

    # The file of each module mypy read: "Parsing <path> (<module>)" in its log, or, where
    # the cache had it, "Metadata fresh for <module>: file <path>".
    parsed = {module: Path(path) for path, module in re.findall(r"Parsing (\S+) \((\S+)\)", done.stderr)}
    parsed.update((module, Path(path)) for module, path in re.findall(r"Metadata fresh for (\S+): file (\S+)", done.stderr))
    site = downstream.site
    opttree_files = {m: p for m, p in parsed.items() if m == "opttree" or m.startswith("opttree.")}
    megatron_files = {m: p for m, p in parsed.items() if m == "megatron" or m.startswith("megatron.")}
    assert "opttree" in opttree_files and "megatron.core.optimizer.optimizer_config" in megatron_files
    assert all(p.is_relative_to(site / "opttree") for p in opttree_files.values()), opttree_files
    assert all(p.is_relative_to(site / "megatron-stubs") for p in megatron_files.values()), megatron_files
    seen_in_repository = [p for p in parsed.values() if in_repository_code((downstream.code / p).resolve())]
    assert seen_in_repository == []


def test_mypy_reports_the_deliberate_errors(downstream: Downstream) -> None:
    done = mypy(downstream, "broken.py")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    lines = (downstream.code / "broken.py").read_text().splitlines()
    expected = {(n, m.group(1)) for n, line in enumerate(lines, 1) if (m := re.search(r"# E: (\S+)", line))}
    reported = {(int(n), c) for n, c in re.findall(r"^broken\.py:(\d+): error: .*\[([a-z-]+)\]$", done.stdout, re.M)}
    assert len(expected) == 5
    assert reported == expected, done.stdout
