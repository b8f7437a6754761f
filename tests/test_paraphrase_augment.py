"""Paraphrase augmentation in training (``--paraphrase-augment``): samples train on grammar-made
rewrites of their instruction, never on a suite's held-out wording, and the rewrites never become
the checkpoint's vocabulary (what eval, serve and the resolver treat as trained)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import tabletop_demos
from envs.errors import InvalidOptionError
from envs.wordings import held_out_wordings
from policies.instructions import _split, training_wordings
from policies.model import RESOLVER_KEY
from train.bc import _draw_batch, train
from train.data import ChunkData
from train.recipes import recipe_args

PUSH = ("push the red cube to the left goal", "push the blue cube to the right goal")
ENV = "maniskill/TabletopSuite-v1"


def test_rewrites_are_neither_trained_instructions_nor_held_out_wordings():
    from envs.maniskill.tasks.tabletop import TABLETOP_SUITE
    trained = [t.instruction for t in TABLETOP_SUITE.tasks]
    held_out = held_out_wordings(ENV)
    assert held_out, "the tabletop suite has held-out paraphrases"
    table = training_wordings(trained, per_instruction=48, seed=0, exclude=held_out)
    words = lambda t: " ".join(w for w in _split(t) if w != ",")  # noqa: E731
    banned = {words(t) for t in trained + held_out}
    assert all(len(ws) >= 40 for ws in table.values())
    assert not {words(w) for ws in table.values() for w in ws} & banned
    # an excluded wording the grammar makes is kept out, whatever its case or punctuation
    made = table[trained[0]][0]
    again = training_wordings(trained, per_instruction=48, seed=0, exclude=[*held_out, made.upper() + " ."])
    assert made not in again[trained[0]] and len(again[trained[0]]) == 48
    assert training_wordings(trained, per_instruction=48, seed=0, exclude=held_out) == table
    assert training_wordings(trained, per_instruction=48, seed=1, exclude=held_out) != table


@pytest.fixture(scope="module")
def pushes(tmp_path_factory):
    return tabletop_demos(tmp_path_factory.mktemp("pushes"), PUSH, episodes=6)


def test_a_batch_trains_on_rewrites_of_its_own_instruction(pushes):
    data = ChunkData(pushes, horizon=1)
    args = recipe_args("multitask", data=(pushes,), batch_size=256, paraphrase_augment=0.5)
    table = training_wordings(list(PUSH), per_instruction=8, seed=0)
    plain = _draw_batch(data, dataclasses.replace(args, paraphrase_augment=0.0), torch.Generator().manual_seed(0),
                        0, 1, 0.0)
    aug = _draw_batch(data, args, torch.Generator().manual_seed(0), 0, 1, 0.0, wordings=table)
    assert (plain["index"] == aug["index"]).all()  # the draws before the paraphrases are the same
    replaced = [(a, p) for a, p in zip(aug["instruction"], plain["instruction"]) if a != p]
    assert 0.35 < len(replaced) / len(plain["instruction"]) < 0.65
    assert all(a in table[p] for a, p in replaced)


def test_rewrites_train_but_never_enter_the_checkpoint(pushes, tmp_path):
    out = tmp_path / "run"
    summary = train(recipe_args("multitask", data=(pushes,), steps=6, batch_size=32, out=out, wandb="disabled",
                                progress=False, save_every=10**9, paraphrase_augment=0.5,
                                paraphrases_per_instruction=4))
    assert summary["ckpt"]
    meta = json.loads((out / "ckpt" / "config.json").read_text())
    assert sorted(meta["instructions"]) == sorted(PUSH)
    assert sorted(meta["extra"][RESOLVER_KEY]["instructions"]) == sorted(PUSH)


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_a_bad_augmentation_probability_is_named(pushes, tmp_path, bad):
    with pytest.raises(InvalidOptionError, match="--paraphrase-augment"):
        train(recipe_args("multitask", data=(pushes,), steps=2, out=tmp_path / "bad", wandb="disabled",
                          progress=False, paraphrase_augment=bad))
