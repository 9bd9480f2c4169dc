"""Shared fixtures and helpers: the real embedded target (converted once into artifacts/), drafts sliced from it,
its tokenizer and chat prompts, the families' tiny random checkpoints (test_families, test_reference), and the
serving tests' prompts and helpers (launching `spectrt serve`, scraping its metrics)."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from spectrt.build.slice import TOKENIZER_FILES, slice_target
from spectrt.runtime.engines.checkpoint import resolve_target
from spectrt.runtime.engines.model import Transformer

torch.manual_seed(0)

# `make test` runs the suite in worker processes (pytest-xdist, one file at a time per worker): each takes its share
# of the cores, and so does every process it starts (OMP_NUM_THREADS), else the workers' OpenMP threads outnumber
# the cores and spin against each other (on 2 cores a forward collapses several-fold)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)

PROMPTS = [  # chat prompts of the decoding tests
    "Write a Python function that checks whether a number is prime.",
    "List five animals that live in the ocean.",
    "What is 12 times 15? Explain briefly.",
    "Explain what photosynthesis is to a child.",
    "Write a short poem about the moon.",
    "Give three tips for learning a new language.",
    "What is the capital of France and what is it famous for?",
    "Write a SQL query that counts rows in a table named users.",
]
EOS = {2}  # the embedded target's end of sequence (<|im_end|>)
SERVING_PROMPTS = [  # prompts of the serving tests
    "Write a short poem about the sea.",
    "List five animals that live in the ocean.",
    "What is 12 times 15? Explain briefly.",
    "Give three tips for learning a new language.",
    "What is the capital of France?",
    "Write a SQL query that counts rows in a table named users.",
    "Explain what photosynthesis is to a child.",
    "Name three colors.",
]
SERVE_READY_TIMEOUT = 300.0


def launch_serve(target: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict, str]:
    """Start `spectrt serve` (`target` alone, small limits, free ports, `extra` flags last; `env` added to this
    environment) and return it once ready, with the endpoints JSON it printed and everything it printed.
    Lifecycle tests pass `stub_target` (a tiny random checkpoint): what they test is processes, signals and
    cleanup, and a 135M model's load would be most of their time."""
    cmd = [sys.executable, "-m", "spectrt", "serve", "--target", str(target), "--draft", "none", "--instances", "1",
           "--threads", "1",
           "--max-seq-len", "128", "--max-tokens-limit", "8", "--http-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--ready-timeout", str(SERVE_READY_TIMEOUT), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    out = ""
    deadline = time.monotonic() + SERVE_READY_TIMEOUT + 60
    while "ready:" not in out:  # raw reads: select() cannot see what a buffered readline() already holds
        if not select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
            proc.kill()
            pytest.fail(f"spectrt serve printed no 'ready:' line:\n{out}")
        data = os.read(proc.stdout.fileno(), 65536)
        if not data:
            pytest.fail(f"spectrt serve exited ({proc.wait()}):\n{out}\n{proc.stderr.read()}")
        out += data.decode()
    return proc, json.loads(out[out.index("{"):out.rindex("}") + 1]), out


def scrape_metrics(server) -> dict[str, float]:
    """spectrt's Prometheus values, summed over labels (histogram buckets left out)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(spectrt_[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and "_bucket" not in m.group(1):
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


def chat_ids(tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of a user prompt (or a list of messages) with the chat template and the generation prompt."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


@pytest.fixture(scope="session")
def target_dir() -> Path:
    return resolve_target()


@pytest.fixture(scope="session")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


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


FORWARD_PATHS = ["native", "torch"]  # what `engine_pair` parametrizes: the native CPU forward, the torch reference


@pytest.fixture(scope="session")
def torch_target(target_dir) -> Transformer:
    """The target on the torch reference path (fp32: what runs where the native forward cannot)."""
    return Transformer.load(target_dir, native=False)


@pytest.fixture(scope="session")
def torch_draft(draft_dir) -> Transformer:
    return Transformer.load(draft_dir, native=False)


def engine_pair(request, path: str) -> tuple[Transformer, Transformer]:
    """(target, weak draft) on one forward path of FORWARD_PATHS, loaded once per session."""
    names = {"native": ("target", "draft"), "torch": ("torch_target", "torch_draft")}[path]
    target, draft = (request.getfixturevalue(n) for n in names)
    assert (target.native is None) == (path == "torch"), "the native forward must build here (make setup)"
    return target, draft


ARCHS = ["sm80", "sm86"]  # TensorRT-RTX plans built in tests (ahead of time, on the CPU)


@pytest.fixture(scope="session")
def engines(target_dir, draft_dir, tmp_path_factory):
    """FP16 engines for the embedded target + the 4-layer draft (test_engines, test_quant's plan sizes)."""
    from spectrt.build.engines import make_engines

    out = tmp_path_factory.mktemp("engines") / "smollm2"
    yield make_engines(target_dir, draft_dir, out, precision="fp16", archs=ARCHS)
    shutil.rmtree(out, ignore_errors=True)  # ~1.7 GB of graphs and plans


@pytest.fixture(scope="session")
def head_dir(target_dir) -> Path:
    """The shipped EAGLE-3 head: the embedded target's default draft."""
    import fcntl

    from spectrt.build.draft import install_shipped
    from spectrt.runtime.engines.checkpoint import default_draft
    from spectrt.runtime.engines.eagle3 import is_eagle3

    head = default_draft(target_dir)
    head.parent.mkdir(parents=True, exist_ok=True)
    with open(head.parent / ".install-draft.lock", "w") as lock:  # one worker installs, the others wait for it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (head / "config.json").is_file():  # a clean clone: install it the way `make draft` does (seconds)
            assert install_shipped(target_dir, head) is not None, "no shipped draft for the embedded target"
    assert is_eagle3(head), f"the embedded target's default draft {head} should be the shipped EAGLE-3 head"
    return head


@pytest.fixture(scope="session")
def head_engines(head_dir, tmp_path_factory):
    """Graphs for the embedded target + its default draft (the shipped head), built the way a user builds them:
    `spectrt engines --no-plans` with no --target/--draft, in this process, with every training entry point made to
    fail (`spectrt engines` must train nothing). Yields (engines dir, what the command printed)."""
    import contextlib
    import io

    from spectrt.build import distill, draft, eagle3
    from spectrt.cli import main

    def no_training(*args, **kwargs):
        raise AssertionError("spectrt engines started a training run")

    out = tmp_path_factory.mktemp("head-engines") / "smollm2-head"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as ended:
        for module, name in ((distill, "train_draft"), (draft, "train_draft"), (eagle3, "train_head")):
            mp.setattr(module, name, no_training)
        main(["engines", "--no-plans", "--out", str(out)])
    assert ended.value.code in (0, None), printed.getvalue()
    yield out, printed.getvalue()
    shutil.rmtree(out, ignore_errors=True)


# ---- the families' tiny random checkpoints (2 layers, hidden 64, the embedded tokenizer's vocabulary and files)

VOCAB = 49152  # the embedded tokenizer's
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.1, bos_token_id=1,
              eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = ["llama3", "mistral", "qwen2", "qwen3"]


def hf_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama3":
        return LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=None, head_dim=16)
    if family == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=True)
    if family == "qwen3":  # head_dim 24 != 64 / 4
        return Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False)
    # RoPE scalings and biases beyond the four families' defaults (engine parity only)
    if family == "llama-linear":
        return LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    if family == "llama-yarn-bias":
        return LlamaConfig(**COMMON, attention_bias=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024})
    if family == "qwen3-bias":
        return Qwen3Config(**COMMON, head_dim=24, attention_bias=True)
    raise KeyError(family)


def make_checkpoint(family: str, out: Path, tokenizer_dir: Path) -> Path:
    """A random checkpoint saved with transformers; norms and biases randomized (transformers initialises them to 1
    and 0, which would hide a missing bias or norm)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def isa_engines(target_dir):
    """(isa, dtype) -> the embedded target on that ISA's build, loaded once per module (dtype "bf16dot": bf16
    weights summed in k pairs with bf16 GEMM inputs, on the pair-FMA path every build shares, not AMX's)."""
    loaded: dict[tuple[str, torch.dtype | str], Transformer] = {}

    def get(isa: str, dtype: torch.dtype | str = torch.float32) -> Transformer:
        if (isa, dtype) not in loaded:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("SPECTRT_ISA", isa)
                patch.setenv("SPECTRT_AMX", "0")
                loaded[isa, dtype] = (Transformer.load(target_dir, torch.bfloat16, pair_dots=True)
                                      if dtype == "bf16dot" else Transformer.load(target_dir, dtype))
            assert loaded[isa, dtype].native.isa == isa
        return loaded[isa, dtype]

    return get


@pytest.fixture(scope="session")
def stub_target(target_dir, tmp_path_factory) -> Path:
    """A tiny random llama checkpoint with the embedded tokenizer: a model that loads in a second, for tests of
    processes and protocols rather than of what the model says."""
    return make_checkpoint("llama3", tmp_path_factory.mktemp("stub") / "stub", Path(target_dir))


@pytest.fixture(scope="session")
def family_checkpoints(target_dir, tmp_path_factory):
    """family -> its tiny checkpoint directory, made on first use."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_checkpoint(family, tmp_path_factory.mktemp(family) / family, Path(target_dir))
        return made[family]

    return get


# --------------------------------------------------------------------------- test tiers
# The unit tier (`make test-fast`, `pytest -m unit`): tests that load no model and start no process, on fakes,
# small tensors and at most the target's tokenizer. They say so themselves (`@pytest.mark.unit`, or a module's
# `pytestmark`); the guard below keeps them honest: a unit test that asks for a model fixture fails at collection.
MODEL_FIXTURES = {"target", "draft", "draft_dir", "torch_target", "torch_draft", "engines", "isa_engines",
                  "head_engines",
                  "family_checkpoints", "stub_target",
                  "models", "server", "session", "client", "pipe", "tiny_pair", "bf16_target", "hf_target"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        heavy = MODEL_FIXTURES & set(item.fixturenames)
        if item.get_closest_marker("unit") is not None and heavy:
            raise pytest.UsageError(f"{item.nodeid} is marked unit but uses {sorted(heavy)}: drop the mark")


# --------------------------------------------------------------------------- the tensorrt backend on the CPU


class StandInTRT:
    """Just enough of the TensorRT Python API to drive TensorRTEngine over any of its graphs on the CPU
    (tests/test_engines.py, tests/test_trt_head.py): `execute_async_v3` runs `graph` with ONNX Runtime on the CPU
    tensors at the bound addresses, with the input shapes the engine set (the output shapes follow: their dynamic
    dimension is N, the rows of `input_ids`)."""

    def __init__(self, graph: Path, min_plan_bytes: int = 0):
        import numpy as np
        import onnxruntime as ort

        stand_in = self
        self.contexts: list = []
        types = {"tensor(int32)": np.int32, "tensor(float16)": np.float16, "tensor(float)": np.float32}

        class Logger:
            WARNING = 2

            def __init__(self, level):
                pass

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, plan: bytes):
                assert len(plan) >= min_plan_bytes  # the real plan file was read
                return Engine()

        class Engine:
            def __init__(self):
                options = ort.SessionOptions()
                options.intra_op_num_threads = torch.get_num_threads()
                self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
                self.inputs = [(i.name, i.type, i.shape) for i in self.session.get_inputs()]
                self.outputs = [(o.name, o.type, o.shape) for o in self.session.get_outputs()]
                self.num_io_tensors = len(self.inputs) + len(self.outputs)

            def get_tensor_name(self, i):
                return (self.inputs + self.outputs)[i][0]

            def create_execution_context(self):
                ctx = Context(self)
                stand_in.contexts.append(ctx)
                return ctx

        class Context:
            def __init__(self, engine):
                self.engine, self.shapes, self.addresses, self.runs = engine, {}, {}, 0

            def set_input_shape(self, name, shape):
                self.shapes[name] = tuple(shape)
                return True

            def set_tensor_address(self, name, address):
                self.addresses[name] = address
                return True

            def execute_async_v3(self, stream):
                assert stream == 0
                n = self.shapes["input_ids"][0]
                binding = self.engine.session.io_binding()
                for name, typ, _ in self.engine.inputs:  # every input needs its shape and address set
                    binding.bind_input(name, "cpu", 0, types[typ], self.shapes[name], self.addresses[name])
                for name, typ, shape in self.engine.outputs:
                    dims = tuple(d if isinstance(d, int) else n for d in shape)
                    binding.bind_output(name, "cpu", 0, types[typ], dims, self.addresses[name])
                self.engine.session.run_with_iobinding(binding)
                self.runs += 1
                return True

        self.Logger, self.Runtime = Logger, Runtime
