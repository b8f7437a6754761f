"""config.json carries a digest of its own content (#46: a bit flip changed a checkpoint's
instruction to 'open"the door' and it loaded): a changed character is refused naming the file,
an untouched checkpoint loads, and one saved before the digest loads as before."""

import json

import numpy as np
import pytest
import torch

import policies
from envs.errors import CheckpointError
from groundflow.cli import main
from policies import PolicyConfig
from policies.model import CONFIG_DIGEST, config_digest

INSTR = "open the door"


def _policy(seed: int = 0):
    torch.manual_seed(seed)
    p = policies.make_policy(PolicyConfig(kind="flow", state_dim=6, action_dim=3, horizon=4, n_exec=2))
    rng = np.random.default_rng(seed)
    p.fit_normalizer(rng.normal(size=(50, 6)), rng.uniform(-2, 2, size=(50, 3)))
    p.lang.cache[INSTR] = torch.randn(1, 384, generator=torch.Generator().manual_seed(seed))
    return p


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def ckpt(tmp_path):
    p = _policy()
    p.save(tmp_path / "ckpt", extra={"env_id": "maniskill/PushCube-v1", "step": 7})
    return p, tmp_path / "ckpt"


def test_untouched_checkpoint_loads_and_verifies(ckpt):
    p, d = ckpt
    meta = json.loads((d / "config.json").read_text())
    assert meta["version"] == 2 and meta[CONFIG_DIGEST] == config_digest(meta)
    q = policies.load(d)
    assert _same(q, p) and torch.equal(q.lang.cache[INSTR], p.lang.cache[INSTR])
    assert policies.read_checkpoint_meta(d)["extra"]["step"] == 7


def test_flipped_instruction_character_is_refused_naming_config_json(ckpt, capsys):
    """Before the digest: the policy loaded with its features filed under 'open"the door'."""
    _, d = ckpt
    cfg = d / "config.json"
    text = cfg.read_text()
    assert text.count('"open the door"') == 1
    flipped = text.replace('"open the door"', '"open\\"the door"')  # ' ' (0x20) -> '"' (0x22): still valid JSON
    assert json.loads(flipped)["instructions"] == ['open"the door']
    cfg.write_text(flipped)
    with pytest.raises(CheckpointError) as e:
        policies.load(d)
    msg = str(e.value)
    assert str(cfg) in msg and "digest" in msg and "\n" not in msg, msg
    with pytest.raises(CheckpointError, match="digest"):
        policies.read_checkpoint_meta(d)  # what eval / serve read without the weights is checked too
    assert main(["eval", "--ckpt", str(d), "--episodes", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and str(cfg) in err, err


@pytest.mark.parametrize("edit", ["extra", "dim", "entry_name", "weights_digest", "reindent"])
def test_other_changes_to_config_json(ckpt, edit):
    _, d = ckpt
    cfg = d / "config.json"
    meta = json.loads(cfg.read_text())
    if edit == "extra":
        meta["extra"]["env_id"] = "maniskill/PushCube-v2"
    elif edit == "dim":
        meta["config"]["horizon"] = 5
    elif edit == "entry_name":  # a flip in the digest's own name: a version-2 config without it is refused
        meta["config_sha257"] = meta.pop(CONFIG_DIGEST)
    elif edit == "weights_digest":
        meta["sha256"]["model.safetensors"] = "0" * 64
    if edit == "reindent":  # key order and whitespace are not content
        cfg.write_text(json.dumps(dict(reversed(list(meta.items()))), indent=4))
        policies.load(d)
        return
    cfg.write_text(json.dumps(meta, indent=2))
    with pytest.raises(CheckpointError) as e:
        policies.load(d)
    assert str(cfg) in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_checkpoint_saved_before_the_digest_loads_as_before(ckpt):
    p, d = ckpt
    cfg = d / "config.json"
    meta = json.loads(cfg.read_text())
    del meta[CONFIG_DIGEST]
    meta["version"] = 1  # what save() wrote before the digest
    cfg.write_text(json.dumps(meta, indent=2))
    q = policies.load(d)
    assert _same(q, p) and torch.equal(q.lang.cache[INSTR], p.lang.cache[INSTR])
    assert policies.read_checkpoint_meta(d)["extra"]["env_id"] == "maniskill/PushCube-v1"
    del meta["sha256"]  # and one from before the weights' digests
    cfg.write_text(json.dumps(meta))
    assert _same(policies.load(d), p)
