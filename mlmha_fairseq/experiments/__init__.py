"""The experiment runner as a library: systems (:mod:`.systems`), a grid's runs (:mod:`.grid`),
its configuration file (:mod:`.config`), its corpus (:mod:`.corpora`) and the runner that ties
them together (:mod:`.runner`; command line: ``python -m mlmha_fairseq.cli.experiment``)."""
