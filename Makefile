# specgen: `make quickstart` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN ?= logs/quickstart

.PHONY: setup quickstart test test-slow benchmark figures figures-quick retrain-tokenizer retrain-backbone retrain-gpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt setup.py setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

quickstart: setup
	WANDB_SILENT=true $(BIN)/python -m specgen.eval experiment=eval/quickstart hydra.run.dir=$(RUN)

test: setup
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/python -m pytest -m "not slow" -q

test-slow: setup
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/python -m pytest -m slow -q

benchmark: setup
	$(BIN)/python -m specgen.eval experiment=eval/discrete_speed hydra.run.dir=logs/discrete_speed

# every table and figure of both papers on the embedded world (resumable: finished entries are skipped)
figures: setup
	$(BIN)/python -m specgen.analysis.catalogue --out logs/figures

figures-quick: setup
	$(BIN)/python -m specgen.analysis.catalogue --quick --out logs/figures_quick

retrain-gpu: setup
	PY=$(BIN)/python bash experiments/gpu_retrain/run.sh

retrain-tokenizer: setup
	$(BIN)/python -m specgen.train experiment=train/vq_shapes hydra.run.dir=logs/vq_shapes/run0

retrain-backbone: setup
	$(BIN)/python -m specgen.train experiment=train/ar_shapes hydra.run.dir=logs/ar_shapes_train/run0

clean:
	rm -rf logs outputs .pytest_cache
