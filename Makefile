# Two commands do all the set-up on a fresh machine:
#   make test   create .venv if needed, install everything, run the test suite
#   make demo   same set-up, then the main job (train, decode, score)
#   make experiment   a grid of systems x seeds from a TOML file (EXPERIMENT=...)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mlmha-installed
PYTEST_ARGS ?=
DEMO_ARGS ?=
EXPERIMENT ?= examples/experiment/demo.toml
EXPERIMENT_ARGS ?=

.PHONY: venv test demo experiment clean-venv

venv: $(STAMP)

$(STAMP): scripts/setup_venv.sh requirements.txt setup.py
	bash scripts/setup_venv.sh $(VENV)
	@touch $@

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m mlmha_fairseq.cli.demo $(DEMO_ARGS)

# a grid of systems x seeds (default: the quick demo with 3 seeds); resumes when rerun
experiment: $(STAMP)
	$(PY) -m mlmha_fairseq.cli.experiment $(EXPERIMENT) $(EXPERIMENT_ARGS)

clean-venv:
	rm -rf $(VENV)
