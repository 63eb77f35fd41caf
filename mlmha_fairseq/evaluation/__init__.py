"""Evaluation and analysis toolkit (scoring protocols, significance, analyses).

One module per mechanism:

- ``text_io``: reading aligned text files with clear errors.
- ``generate_output``: parsing ``fairseq-generate`` output (S-/T-/H-/D- lines).
- ``scoring``: the documents' BLEU/chrF protocols on top of sacreBLEU.
- ``significance``: paired bootstrap (sacreBLEU, compare-mt, thesis protocol) and
  paired approximate randomization.
- ``replicates``: optimizer replicates reported as MultEval does (mean ± sd over seeds,
  s_sel, approximate randomization over the replicates) as Markdown/LaTeX/JSON/PNG.
- ``meteor``: METEOR through nltk with WordNet 3.0 from an installed package.
- ``length_buckets``: BLEU by source-length bucket.
- ``attention_statistics``: encoder self-attention mean distance and entropy.
- ``model_loading``: loading a fairseq checkpoint and encoding sentences.
- ``probing``: probing classifiers on frozen encoder features.
- ``checkpoint_averaging``: averaging fairseq checkpoints.
- ``training_curves``: train/valid statistics against updates or epochs from fairseq's JSON logs.
- ``plotting``: the PNG figures written by every analysis.
"""
