# Two commands do all the set-up on a fresh machine:
#   make test   create .venv if needed, install everything, run the test suite
#   make demo   same set-up, then the main job (train, decode, score)
#   make mutation  mutation testing of the mechanism code (hours on 2 cores; not in CI;
#                  docs/testing.md), e.g. make mutation MUTANTS='mlmha_fairseq.modules.dual_contextual*'
#   make experiment   a grid of systems x seeds from a TOML file (EXPERIMENT=...)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mlmha-installed
PYTEST_ARGS ?=
# pytest-xdist workers, whole test files to each (module fixtures built once): the suite is
# mostly single-threaded fairseq processes, so two workers on two cores halve its time
PYTEST_WORKERS ?= 2
DEMO_ARGS ?=
MUTANTS ?=
EXPERIMENT ?= examples/experiment/demo.toml
EXPERIMENT_ARGS ?=

.PHONY: venv test demo experiment mutation clean-venv

venv: $(STAMP)

$(STAMP): scripts/setup_venv.sh requirements.txt pyproject.toml setup.py
	bash scripts/setup_venv.sh $(VENV)
	@touch $@

test: $(STAMP)
	$(PY) -m pytest tests -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m mlmha_fairseq.cli.demo $(DEMO_ARGS)

# mutmut (requirements-dev.txt) over the files and tests named in setup.cfg [mutmut]; MUTANTS
# restricts the run to mutant names matching these globs; the survivors are listed at the end.
mutation: $(STAMP)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-dev.txt
	OMP_NUM_THREADS=1 $(PY) -m mutmut run --max-children 2 $(MUTANTS)
	$(PY) -m mutmut results

# a grid of systems x seeds (default: the quick demo with 3 seeds); resumes when rerun
experiment: $(STAMP)
	$(PY) -m mlmha_fairseq.cli.experiment $(EXPERIMENT) $(EXPERIMENT_ARGS)

clean-venv:
	rm -rf $(VENV)
