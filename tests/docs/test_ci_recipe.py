"""The CI recipe installs as written on a fresh machine, and what it installs works.

The install steps are read from the CI tutorial (the GitHub Actions step and the wheel recipe)
and run, unchanged, with bash in a fresh virtual environment next to a copy of the repository
(`./kvcanary`, as a CI job checks it out). The environment has no pip and no network of its
own: it sees the dependencies this test process already has (every installed distribution but
kvcanary itself, through a `.pth` file) and pip is told to use no index, so nothing downloads.
Then, from a directory outside the repository, the installed `kvcanary` command runs and the
installed pytest plugin collects the built-in suite.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import yaml
from docs_pages import DOCS, ROOT

pytestmark = pytest.mark.slow

TUTORIAL = DOCS / "tutorials" / "ci.md"
PACKAGES = ("canaries", "tenants", "harness", "reports", "reference_engine")
NOT_IN_A_CHECKOUT = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__", "*.so",
    ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "kvcanary-runs",
)  # fmt: skip


def titled_block(title: str) -> str:
    """The tutorial's code block titled `title`."""
    match = re.search(rf'^```bash title="{title}"\n(.*?)^```', TUTORIAL.read_text(), re.M | re.S)
    assert match, f"the CI tutorial has a block titled {title!r}"
    return match.group(1)


def github_install_step() -> str:
    """The `run` of the GitHub Actions workflow's `install kvcanary` step."""
    text = TUTORIAL.read_text()
    workflow = next(
        yaml.safe_load(block)
        for block in re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)
        if "jobs:" in block
    )
    (job,) = workflow["jobs"].values()
    (step,) = [step for step in job["steps"] if step.get("name") == "install kvcanary"]
    return str(step["run"])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CI job's working directory: the repository checked out as `./kvcanary`."""
    root = tmp_path_factory.mktemp("ci-job")
    shutil.copytree(ROOT, root / "kvcanary", symlinks=True, ignore=NOT_IN_A_CHECKOUT)
    return root


def fresh_environment(where: Path) -> dict[str, str]:
    """A new virtual environment without pip or network: the environment variables that make
    `python` (and pip, through the shared packages) be its own."""
    env_dir = where / "venv"
    venv.create(env_dir, with_pip=False)
    shared = where / "shared-packages"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("kvcanary", "__editable__")) and entry.suffix != ".pth":
            (shared / entry.name).symlink_to(entry)
    purelib = sysconfig.get_paths(vars={"base": str(env_dir), "platbase": str(env_dir)})
    Path(purelib["purelib"], "shared-packages.pth").write_text(f"{shared}\n")
    pip_conf = where / "pip.conf"
    pip_conf.write_text("[global]\nno-index = true\nno-build-isolation = false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}",
        PIP_CONFIG_FILE=str(pip_conf),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return env


def run(command: str | list[str], cwd: Path, env: dict[str, str]) -> str:
    args = ["bash", "-euo", "pipefail", "-c", command] if isinstance(command, str) else command
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def check_installed(where: Path, env: dict[str, str]) -> None:
    """The installed command and plugin work from a directory outside the repository."""
    outside = where / "elsewhere"
    outside.mkdir()
    assert "usage: kvcanary" in run(["kvcanary", "--help"], outside, env)
    located = run(
        ["python", "-c", "import kvcanary.harness.cli as m; print(m.__file__)"], outside, env
    )
    assert Path(located.strip()).is_relative_to(where / "venv"), located
    assert not Path(located.strip()).resolve().is_relative_to(ROOT), located
    collected = run(
        ["python", "-m", "pytest", "-p", "no:cacheprovider", "--kvcanary-suite", "--co", "-q"],
        outside,
        env,
    )
    assert len(re.findall(r"^kvcanary::test_\d_", collected, re.M)) == 9, collected


def test_the_github_install_step_installs_kvcanary_from_a_checkout(workspace: Path) -> None:
    where = workspace / "from-checkout"
    where.mkdir()
    env = fresh_environment(where)
    run(github_install_step(), workspace, env)
    check_installed(where, env)


def test_the_wheel_recipe_builds_a_complete_wheel_that_installs(workspace: Path) -> None:
    where = workspace / "from-wheel"
    where.mkdir()
    env = fresh_environment(where)
    run(titled_block("install from a wheel"), workspace, env)
    (wheel,) = (workspace / "dist").glob("kvcanary-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [
        path.relative_to(workspace / "kvcanary")
        for package in PACKAGES
        for path in (workspace / "kvcanary" / package).rglob("*")
        if path.is_file() and path.suffix not in (".c", ".h") and "__pycache__" not in path.parts
    ]
    assert shipped
    missing = [str(path) for path in shipped if f"kvcanary/{path}" not in names]
    assert not missing, "the wheel follows the kvcanary/ links to every file"
    check_installed(where, env)


def test_the_checkout_recipe_is_the_github_step() -> None:
    assert titled_block("install from a checkout").strip() == github_install_step().strip()
