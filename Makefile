# The two commands of a newcomer: `make train` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test test-gpu train clean

setup: $(STAMP)

# torch==2.13.0 is the CPU build on this machine's disk (an unpinned torch pulls a CUDA build of
# several GB); triton 3.6's interpreter needs numpy < 2.3.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.3" "pytest>=8" \
		"megatron-core==0.16.1" "sentencepiece==0.2.3" "tensorboard>=2.16" "pyyaml>=6" \
		"safetensors==0.8.0" "tokenizers==0.23.3" "transformers==5.23.0" "accelerate==1.15.0" \
		"peft==0.21.2" "pytest-xdist==3.8.0"
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# the whole CPU suite, serially (distributed tests start their own gloo ranks)
test: $(STAMP)
	$(PY) -m pytest -q tests

# on a GPU machine: the compiled kernel against the references
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

# the main job: prepare the default corpus once (cached under data/), then pretrain.py
train: $(STAMP)
	$(PY) tools/prepare_default_data.py --data-dir data
	$(PY) pretrain.py --config configs/tiny.yaml

clean:
	rm -rf $(VENV) .pytest_cache data checkpoints runs
