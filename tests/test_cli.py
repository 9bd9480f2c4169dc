"""The `spectrt` command as a user runs it: JSON output, the AR baseline, and clear errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from spectrt.runtime.engines.checkpoint import CheckpointError, resolve_models, resolve_target
from spectrt.runtime.engines.engine import resolve_dtype

REPO = Path(__file__).resolve().parent.parent


def spectrt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spectrt", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def test_generate_json_equals_autoregressive(draft_dir):
    prompt = ["generate", "--prompt", "Name three colors.", "--max-new-tokens", "24", "--json"]
    spec = spectrt(*prompt, "--draft", str(draft_dir), "--tree", "2,1")
    ar = spectrt(*prompt, "--no-spec")
    assert spec.returncode == 0, spec.stderr
    assert ar.returncode == 0, ar.stderr
    spec_out, ar_out = json.loads(spec.stdout), json.loads(ar.stdout)
    assert spec_out["token_ids"] == ar_out["token_ids"] and spec_out["text"] == ar_out["text"]
    assert spec_out["text"].strip() and spec_out["finish_reason"] in {"stop", "length"}
    assert ar_out["stats"]["draft_passes"] == 0 and ar_out["stats"]["tau"] == 1.0
    assert spec_out["stats"]["draft_passes"] > 0
    assert spec_out["stats"]["new_tokens"] == len(spec_out["token_ids"])
    assert "torch reference path" not in spec.stderr + ar.stderr  # the native forward ran


def test_torch_fallback_is_said_once_and_bf16_speculation_refused(draft_dir):
    """With the native forward off, generate says so once on stderr (why, and that the slow torch path runs), still
    speculates in fp32 (auto), and refuses bf16 speculation naming the fix instead of being silently lossy."""
    off = {"SPECTRT_NATIVE": "0"}
    prompt = ["generate", "--prompt", "Name three colors.", "--max-new-tokens", "6", "--draft", str(draft_dir)]
    fp32 = spectrt(*prompt, "--tree", "2,1", "--json", env=off)
    assert fp32.returncode == 0, fp32.stderr
    notice = "the native CPU forward is unavailable (disabled by SPECTRT_NATIVE=0): the torch reference path runs"
    assert fp32.stderr.count(notice) == 1, fp32.stderr
    assert json.loads(fp32.stdout)["stats"]["draft_passes"] > 0
    bf16 = spectrt(*prompt, "--dtype", "bf16", env=off)
    assert bf16.returncode == 2 and "Traceback" not in bf16.stderr
    assert bf16.stderr.count(notice) == 1 and "would be lossy on this engine" in bf16.stderr
    assert "use --dtype fp32, or the native forward (unavailable here: disabled by SPECTRT_NATIVE=0)" in bf16.stderr


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--tree", "3,,2"], "tree '3,,2' is malformed"),
    (["--prompt", "hi", "--tree", "2,0"], "every depth needs at least 1 child"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "must be a positive integer"),
    (["--prompt", "  "], "the prompt is empty"),
    (["--prompt", "hi", "--target", "/nonexistent/model"], "does not exist"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
])
def test_bad_input_is_a_clear_error(args, message):
    result = spectrt("generate", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_draft_data_share_outside_the_budget_is_refused(value):
    result = spectrt("draft", "--data-share", value)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{value} is not a share of the budget: pass a number between 0 and 1" in result.stderr


def test_draft_with_a_missing_prompt_file_is_a_clear_error(tmp_path):
    result = spectrt("draft", "--train", "--greedy-answers", "--out", str(tmp_path / "draft"),
                     "--prompts", str(tmp_path / "none.txt"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"prompt corpus {tmp_path / 'none.txt'} does not exist" in result.stderr
    assert not (tmp_path / "draft" / "config.json").exists()


def test_help_and_bad_input_answer_without_loading_transformers():
    """The parser and generate's input checks import no transformers (or the decode pipeline): building the parser
    used to import quant/quantize.py for two defaults, which cost every `spectrt` call ~2 s before argparse."""
    code = ("import sys\nfrom spectrt.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print(e.code, 'transformers' in sys.modules, 'spectrt.runtime.decoding.pipeline' in sys.modules)")
    for args in (["--help"], ["generate", "--prompt", " "], ["generate", "--prompt", "hi", "--temperature", "-1"]):
        result = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                                timeout=120)
        assert result.stdout.split()[-3:] == ["0" if args == ["--help"] else "2", "False", "False"], result


@pytest.mark.unit
def test_every_subcommand_prints_its_help():
    """`spectrt <command> --help` renders for every subcommand (argparse formats help lazily: a bare % in one
    option's text only fails when someone asks for that command's help)."""
    import argparse

    from spectrt.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"generate", "draft", "serve"} <= set(sub.choices)
    for name, parser in sub.choices.items():
        assert parser.format_help().startswith(f"usage: spectrt {name}"), name


def test_prompt_longer_than_context(draft_dir):
    result = spectrt("generate", "--prompt", "word " * 100, "--max-seq-len", "32", "--draft", str(draft_dir))
    assert result.returncode == 2 and "shorten the prompt or raise max_seq_len (--max-seq-len)" in result.stderr


def test_mismatched_draft_is_refused(draft_dir, tmp_path):
    bad = tmp_path / "bad-draft"
    shutil.copytree(draft_dir, bad)
    tokenizer = json.loads((bad / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["spectrt-not-a-token"] = vocab.pop(next(iter(vocab)))  # same size, different vocabulary
    (bad / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = spectrt("generate", "--prompt", "hi", "--draft", str(bad))
    assert result.returncode == 2 and "does not share the target's tokenizer" in result.stderr


def test_one_resolver_reads_target_and_draft(target_dir, tmp_path):
    """--target/--draft mean the same in every command: "none" is no draft model, no --draft the target's default
    draft in the artifacts folder, and a draft that is not there is refused naming the command that makes it."""
    target = resolve_target(target_dir)
    assert resolve_models(target_dir, "None", tmp_path) == (target, None)
    with pytest.raises(CheckpointError, match=f"does not exist: build one with `spectrt draft --target {target}`"):
        resolve_models(target_dir, None, tmp_path)  # an empty artifacts folder holds no default draft
    (tmp_path / "smollm2-135m-instruct-draft").mkdir()
    (tmp_path / "smollm2-135m-instruct-draft" / "config.json").write_text("{}")
    assert resolve_models(target_dir, None, tmp_path) == (target, tmp_path / "smollm2-135m-instruct-draft")
    with pytest.raises(CheckpointError, match="--draft none for no draft model"):
        resolve_models(target_dir, tmp_path / "elsewhere", tmp_path)


def test_two_gguf_files_of_one_name_convert_apart(tmp_path):
    """A GGUF's conversion records its source: another file of the same name (llama.cpp's default `ggml-model-f16`)
    gets its own directory instead of the first one's conversion (and draft), and a changed file converts again."""
    from spectrt.runtime.engines.checkpoint import GGUF_SOURCE, _gguf_source, convert_gguf, gguf_checkpoint_dir

    a, b = tmp_path / "a" / "ggml-model-f16.gguf", tmp_path / "b" / "ggml-model-f16.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(b"GGUF")
    artifacts = tmp_path / "artifacts"
    first = gguf_checkpoint_dir(a, artifacts)
    assert first == artifacts / "ggml-model-f16"
    first.mkdir(parents=True)  # a's conversion, as convert_gguf leaves it
    (first / "config.json").write_text("{}")
    (first / "model.safetensors").write_bytes(b"")
    (first / GGUF_SOURCE).write_text(json.dumps(_gguf_source(a)))
    assert gguf_checkpoint_dir(a, artifacts) == first and convert_gguf(a, first) == first  # cached: no conversion
    other = gguf_checkpoint_dir(b, artifacts)
    assert other.parent == artifacts and other.name.startswith("ggml-model-f16-") and other != first
    os.utime(a, ns=(1, 1))  # the file changed since its conversion: converted again (this fake one is refused)
    with pytest.raises(Exception):  # noqa: B017 - any failure of the conversion itself: it was attempted
        convert_gguf(a, first)


def test_a_gguf_ends_generation_at_its_end_of_turn_tokens_as_llama_cpp(tmp_path, target_dir):
    """A GGUF whose turns end with a token other than its EOS (Llama 3's <|eot_id|>) ended no chat turn: the
    conversion adds llama.cpp's end-of-generation ids (its eot/eom keys, control tokens of those texts) to
    generation_config.json, which every EOS set reads; a conversion made before gets them at its next use."""
    from gguf import GGUFWriter
    from spectrt.runtime.engines.checkpoint import eos_ids, gguf_eog_ids, write_eog
    from transformers import AutoTokenizer

    path = tmp_path / "turns.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_token_list(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "hi", "<|im_end|>"])
    writer.add_token_types([3, 3, 3, 1, 1])  # the last: an ordinary token that only looks like one
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_eog_ids(path) == [1, 2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))
    write_eog(tmp_path, gguf_eog_ids(path))
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": [1, 2], "bos_token_id": 0}
    # the embedded SmolLM2: <|im_end|> (its EOS) and <|endoftext|>, as llama.cpp stops on them
    assert eos_ids(target_dir, AutoTokenizer.from_pretrained(target_dir)) == {0, 2}


def test_unusable_model_paths(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_target(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="'gpt2' model"):
        resolve_target(tmp_path)
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(CheckpointError, match="not a .gguf"):
        resolve_target(tmp_path / "weights.bin")


def test_tune_saves_a_policy_that_generate_uses(target_dir, tmp_path):
    """Draft-less: `tune` writes the policy for (target, nodraft, the default precision); `generate` picks it up."""
    model = ["--target", str(target_dir), "--draft", "none", "--artifacts", str(tmp_path)]
    tuned = spectrt("tune", *model, "--limit", "1", "--max-new-tokens", "12")
    assert tuned.returncode == 0, tuned.stderr
    saved = json.loads((tmp_path / f"policy-{target_dir.name}-nodraft-{resolve_dtype('auto')}.json").read_text())
    assert saved["policy"]["draft"] is False and saved["cost_source"].startswith("measured")
    assert [f["measured_tokens_per_second"] for f in saved["finalists"]] == [None]  # one candidate: nothing timed
    assert [t for t, _ in saved["policy"]["verify_ms"]] == [1, 2, 4, 8, 16, 32, 64]
    prompt = ["generate", "--prompt", "Repeat exactly: red, green, blue, red, green, blue.", "--max-new-tokens", "24"]
    spec = spectrt(*prompt, *model)
    ar = spectrt(*prompt, *model, "--no-spec", "--json")
    assert spec.returncode == 0 and ar.returncode == 0, spec.stderr + ar.stderr
    assert f"budget {saved['policy']['budget']} depth 0" in spec.stderr  # the tuned policy ran
    assert spec.stdout.strip() == json.loads(ar.stdout)["text"].strip()


@pytest.mark.unit
@pytest.mark.parametrize(("flags", "hosts"), [
    ([], ("127.0.0.1", "127.0.0.1")),
    (["--host", "0.0.0.0"], ("0.0.0.0", "0.0.0.0")),
    (["--host", "0.0.0.0", "--api-key", "K", "--openai-port", "9000"], ("127.0.0.1", "0.0.0.0")),  # Triton stays in
    (["--host", "0.0.0.0", "--api-key", "K", "--openai-port", "9000", "--triton-host", "10.0.0.5"],
     ("10.0.0.5", "0.0.0.0")),  # unless asked
    (["--host", "0.0.0.0", "--api-key", "K"], ("0.0.0.0", "0.0.0.0")),  # no OpenAI endpoint: nothing to guard
    (["--openai-host", "0.0.0.0", "--api-key", "K", "--openai-port", "9000"], ("127.0.0.1", "0.0.0.0")),
])
def test_an_api_key_keeps_tritons_unauthenticated_ports_on_loopback(flags, hosts):
    from spectrt.cli import build_parser
    from spectrt.cli.serving import bind_hosts

    assert bind_hosts(build_parser().parse_args(["serve", *flags])) == hosts
