"""Checkpoints written by fairseq-train with an earlier version of the package (one tiny
model per mechanism, ``tests/fixtures/compat``) load strictly and decode to the hypotheses
that version produced: the parameter names, option defaults and numbers of every
mechanism survive changes of the code around them."""
import json

import pytest
import torch

from fixtures.make_compat_checkpoints import COMPAT, SYSTEMS, decode, load

EXPECTED = json.loads((COMPAT / "expected.json").read_text())


def test_every_system_has_expected_hypotheses():
    assert sorted(EXPECTED) == sorted(SYSTEMS)


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_checkpoint_loads_strictly_and_decodes_as_before(name):
    hypotheses = decode(name)  # load_model_ensemble_and_task(..., strict=True) inside
    assert [h["hypothesis"] for h in hypotheses] == [h["hypothesis"] for h in EXPECTED[name]]
    torch.testing.assert_close([h["score"] for h in hypotheses],
                               [h["score"] for h in EXPECTED[name]], atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_state_dict_keys_are_unchanged(name):
    model, _task = load(name)
    stored = torch.load(COMPAT / f"{name}.pt", map_location="cpu", weights_only=False)["model"]
    assert sorted(model.state_dict()) == sorted(stored)
