"""Shared fixtures: the real embedded target (converted once into artifacts/) and drafts sliced from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from spectrt.build.checkpoint import resolve_target
from spectrt.build.slice import slice_target
from spectrt.runtime.model import Transformer

torch.manual_seed(0)


@pytest.fixture(scope="session")
def target_dir() -> Path:
    return resolve_target()


@pytest.fixture(scope="session")
def target(target_dir) -> Transformer:
    return Transformer.load(target_dir)


@pytest.fixture(scope="session")
def draft_dir(target_dir, tmp_path_factory) -> Path:
    """An untrained 4-layer slice: a weak draft (few acceptances), the hard case for correctness."""
    return slice_target(target_dir, 4, tmp_path_factory.mktemp("slice4"))


@pytest.fixture(scope="session")
def draft(draft_dir) -> Transformer:
    return Transformer.load(draft_dir)


ARCHS = ["sm80", "sm86"]  # TensorRT-RTX plans built in tests (ahead of time, on the CPU)


@pytest.fixture(scope="session")
def engines(target_dir, draft_dir, tmp_path_factory):
    """FP16 engines for the embedded target + the 4-layer draft (test_engines, test_quant's plan sizes)."""
    from spectrt.build.engines import make_engines

    out = tmp_path_factory.mktemp("engines") / "smollm2"
    yield make_engines(target_dir, draft_dir, out, precision="fp16", archs=ARCHS)
    shutil.rmtree(out, ignore_errors=True)  # ~1.7 GB of graphs and plans
