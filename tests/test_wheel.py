"""The wheel works outside the checkout.

Built from a fresh copy of the project (`pip wheel --no-build-isolation`: this environment's setuptools, no
index), installed with `pip install --no-deps --target` into a fresh directory and run from another fresh directory,
the install first on PYTHONPATH (torch, transformers, ... come from this virtual environment): the wheel holds every
file the code reads at run time, the installed package finds them inside the install (never in the checkout), every
subcommand answers --help, and a short `generate` runs on the native forward with the same tokens as the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from spectrt.runtime.engines import kernels

REPO = Path(__file__).resolve().parent.parent  # the checkout under test: what gets built


def _runtime_files() -> set[str]:
    """Paths (relative to the package) of the checkout's files that the code reads at run time."""
    found = [*(REPO / "triton_repo").rglob("*"), *REPO.glob("bench/*.txt"), *REPO.glob("build/prompts/*.txt"),
             *(REPO / "build" / "answers").rglob("*"), REPO / "runtime" / "engines" / "cpu_kernels.cpp"]
    return {p.relative_to(REPO).as_posix() for p in found if p.is_file() and "__pycache__" not in p.parts}


def _tree(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built in-tree (`pip wheel <project>`) from a copy of the checkout's tracked and unignored files, i.e. a fresh
    clone: setuptools never empties its build folder, so in the checkout itself an earlier build's copy of a file
    would still ship after the package-data rule for it was lost."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    clone = tmp_path_factory.mktemp("clone")
    for name in filter(None, listed):
        if (REPO / name).is_file():  # not a deleted file or a symlinked directory
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    before = _tree(clone / "build")
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(clone), "--no-build-isolation", "--no-deps", "-q",
                    "-w", str(dist)], check=True, cwd=dist)
    # setuptools' build folder is configured away from build/ (our spectrt.build sub-package): nothing lands there
    assert _tree(clone / "build") == before and (clone / ".setuptools-build" / "lib").is_dir()
    (built,) = dist.glob("spectrt-*.whl")
    return built


@pytest.fixture(scope="module")
def install(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    return target


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory, target_dir) -> Path:
    """A working directory outside the checkout whose ./artifacts (the CLI's default) holds the converted target."""
    cwd = tmp_path_factory.mktemp("user")
    (cwd / "artifacts").symlink_to(Path(target_dir).resolve().parent)
    return cwd


def _run(install: Path, cwd: Path, *command: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "SPECTRT_ARTIFACTS"}
    environment.update(PYTHONPATH=str(install), **env)  # the install first, then this venv's site-packages
    result = subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def _python(install: Path, cwd: Path, code: str, **env: str) -> dict:
    """Run `code` (which prints one JSON object last) with the installed package; return that object."""
    return json.loads(_run(install, cwd, sys.executable, "-c", code, **env).stdout.splitlines()[-1])


def test_wheel_ships_every_runtime_file(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        shipped = {n.removeprefix("spectrt/") for n in names if n.startswith("spectrt/")}
        missing = _runtime_files() - shipped
        assert not missing, f"not in the wheel: {sorted(missing)}"
        for name in _runtime_files():
            assert z.read(f"spectrt/{name}") == (REPO / name).read_bytes(), name
    assert {"triton_repo/spectrt/config.pbtxt", "triton_repo/spectrt/1/model.py", "runtime/engines/cpu_kernels.cpp",
            "bench/prompts.txt", "bench/prompts_repetitive.txt", "build/prompts/distill.txt",
            "build/prompts/heldout.txt", "build/answers/smollm2-135m-instruct.json",
            "build/answers/smollm2-135m-instruct.tokens.xz"} <= shipped
    assert not any(n.startswith(("spectrt/tests/", "spectrt/artifacts/", "spectrt/scripts/")) or "__pycache__" in n
                   for n in names)


LOCATE = """
import json, tempfile
from pathlib import Path
import spectrt
from spectrt.build import corpus
from spectrt.runtime.decoding import bench
from spectrt.runtime.serving import client
from spectrt.runtime.engines import kernels
from spectrt.runtime.serving import serve
models = serve.prepare_model_repository(Path(tempfile.mkdtemp()) / "models")
print(json.dumps({
    "package": spectrt.__file__, "repository": str(serve.DEFAULT_REPOSITORY), "supervisor": str(serve.SUPERVISOR),
    "server_repository": str(serve.TritonServer().repository),
    "deployed": sorted(str(p.relative_to(models)) for p in models.rglob("*") if p.is_file()),
    "kernel_source": str(kernels.SOURCE), "native": kernels.native_unavailable(),
    "prompts": [str(p) for p in [*bench.PROMPT_SETS.values(), client.DEFAULT_PROMPTS, corpus.DISTILL_PROMPTS,
                                 corpus.HELDOUT_PROMPTS, *corpus.ANSWERS_DIR.glob("*")]],
}))
"""


def test_installed_package_finds_its_files_inside_the_install(install, elsewhere):
    found = _python(install, elsewhere, LOCATE)
    assert Path(found["package"]).parent == install / "spectrt"  # not the checkout's editable install
    files = [found["repository"], found["supervisor"], found["server_repository"], found["kernel_source"],
             *found["prompts"]]
    for path in map(Path, files):
        assert path.is_relative_to(install / "spectrt") and path.exists(), path
    assert Path(found["repository"]) == install / "spectrt" / "triton_repo"
    assert found["deployed"] == ["spectrt/1/model.py", "spectrt/config.pbtxt"]
    # the native forward builds from the installed source exactly when it does from the checkout (CI: AVX-512)
    assert found["native"] == kernels.native_unavailable()


def test_every_subcommand_answers_help(install, elsewhere):
    script = install / "bin" / "spectrt"
    top = _run(install, elsewhere, str(script), "--help").stdout
    names = _python(install, elsewhere, """
import argparse, json
from spectrt.cli import build_parser
sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
print(json.dumps(sorted(sub.choices)))""")
    assert {"generate", "bench", "profile", "tune", "draft", "quantize", "compare", "engines", "serve",
            "client"} <= set(names)
    assert all(name in top for name in names)
    # each subcommand's --help (one process for all: argparse exits 0 after printing it)
    helps = _python(install, elsewhere, f"""
import contextlib, io, json
from spectrt.cli import main
out = {{}}
for name in {names!r}:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main([name, "--help"])
        except SystemExit as e:
            code = e.code
    out[name] = [code, buf.getvalue()]
print(json.dumps(out))""")
    for name in names:
        code, text = helps[name]
        assert code == 0 and text.startswith(f"usage: spectrt {name}"), (name, code, text[:200])
    assert _run(install, elsewhere, str(script), "generate", "--help").stdout.startswith("usage: spectrt generate")


GENERATE = """
import json
from spectrt.runtime.engines.checkpoint import resolve_target
from spectrt.runtime.decoding.pipeline import Pipeline
pipe = Pipeline(resolve_target(), None, max_seq_len=256)
gen = pipe.generate("Name three colors.", 12, None)
print(json.dumps({"native": pipe.decoder.target.native is not None, "tokens": gen.token_ids}))
"""


def test_generate_from_the_install_runs_the_native_forward(install, elsewhere, target_dir):
    from spectrt.runtime.decoding.pipeline import Pipeline

    out = _run(install, elsewhere, str(install / "bin" / "spectrt"), "generate", "--prompt", "Name three colors.",
               "--max-new-tokens", "12", "--no-spec", "--json", "--max-seq-len", "256")
    cli = json.loads(out.stdout.splitlines()[-1])
    assert cli["token_ids"] and cli["finish_reason"] in ("stop", "length")
    # $SPECTRT_ARTIFACTS (the other documented way to find the models), from the bare user directory
    bare = elsewhere / "bare"
    bare.mkdir(exist_ok=True)
    installed = _python(install, bare, GENERATE, SPECTRT_ARTIFACTS=str(Path(target_dir).resolve().parent))
    here = Pipeline(target_dir, None, max_seq_len=256)
    assert installed["native"] and here.decoder.target.native is not None  # CI machines have AVX-512 (test_kernels)
    expected = here.generate("Name three colors.", 12, None).token_ids
    assert installed["tokens"] == expected == cli["token_ids"]
