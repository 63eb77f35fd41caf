"""mlmha_fairseq: a fairseq plugin for multi-layer and multi-source NMT mechanisms.

fairseq itself is not listed in ``install_requires``: the installable fork
``fairseq-fixed`` declares torchaudio, which would pull a CUDA build of torch
over a CPU one. ``scripts/setup_venv.sh`` (run by ``make test`` / ``make demo``)
installs it with ``--no-deps`` after its real runtime dependencies.
"""
from setuptools import find_packages, setup

setup(
    name="mlmha_fairseq",
    version="0.1.0",
    description="fairseq plugin: MLMHA, layer aggregation, MLRF, MMA, multi-source "
    "and multi-level supervision for Transformer NMT",
    packages=find_packages(include=["mlmha_fairseq", "mlmha_fairseq.*"]),
    python_requires=">=3.11",  # the version tested (with torch 2.13)
    install_requires=["sacrebleu>=2.0", "sacremoses", "subword-nmt", "numpy"],
    extras_require={"analysis": ["compare-mt", "six", "matplotlib", "scikit-learn"]},
)
