"""The job spec's fingerprint (engine/spec/fingerprint.py): what a gang's hosts compare as the gang
forms, and what a multi-host job's restore compares with the checkpoint's record."""

import json

import pytest

from engine.checkpoint import manifest as mf
from engine.errors import ConfigError
from engine.spec.fingerprint import canonical, check_hosts, check_resume, differences, digest, fingerprint
from engine.spec.loader import SpecError


def test_host_only_settings_are_left_out_and_optional_sections_compare_whole(tiny_spec):
    values = fingerprint(tiny_spec("checkpoint.dir=/mnt/ckpt", "eval.batches=2", "data.dataset=/data/x"))
    assert values["optimizer.lr"] == 0.003 and values["optimizer.betas"] == [0.9, 0.95]
    assert values["checkpoint.async"] is True  # as job files spell it
    assert values["eval"] == {"interval_steps": 0, "batches": 2} and values["model.rope_scaling"] is None
    assert not [k for k in values if k.startswith(("checkpoint.dir", "restart", "logging", "debug",
                                                   "health.heartbeat", "device.compile_cache"))]
    assert "health.nonfinite" in values  # every host must act alike on a non-finite loss
    assert canonical(values) == canonical(dict(reversed(values.items())))


def test_hosts_whose_specs_differ_are_refused_naming_each_key_and_each_hosts_value(tiny_spec):
    same = fingerprint(tiny_spec("optimizer.lr=0.001"))
    other = fingerprint(tiny_spec("optimizer.lr=0.01", "train.seed=3"))
    with pytest.raises(ConfigError) as refused:
        check_hosts({0: same, 1: other})
    assert refused.value.key == "optimizer.lr, train.seed"
    assert ("the hosts of the gang run different job specs: optimizer.lr: 0.001 (host 0), 0.01 (host 1); "
            "train.seed: 0 (host 0), 3 (host 1)") in str(refused.value)
    with pytest.raises(ConfigError, match=r"optimizer.lr: 0.001 \(hosts 0-2, 4\), 0.01 \(host 3\);"):
        check_hosts(dict(enumerate([same, same, same, other, same])))
    with pytest.raises(ConfigError, match=r"optimizer.lr: 0.001 \(hosts 0, 3\), 0.01 \(host 2\);"):
        check_hosts({0: same, 2: other, 3: same})  # host 1 runs an older tpud: it published no fingerprint


def test_host_only_differences_and_keys_of_another_version_form_the_gang(tiny_spec):
    base = tiny_spec()
    mine = fingerprint(base)
    theirs = fingerprint(tiny_spec("checkpoint.dir=/elsewhere", "restart.max_restarts=1", "logging.level=debug",
                                   "health.heartbeat_timeout_seconds=5", "restart.standby=false",
                                   "debug.inject.crash_at_step=3"))
    assert mine == theirs and digest(mine) == digest(theirs)
    check_hosts({0: mine, 1: theirs})
    check_hosts({0: mine, 1: {**theirs, "optimizer.new_knob": 1}})  # a host on a newer tpud: not compared
    assert differences([mine, {**theirs, "train.seed": 1}]) != []


def test_a_resume_refuses_a_changed_spec_but_for_the_changes_a_checkpoint_survives(tiny_spec):
    saved = fingerprint(tiny_spec("optimizer.lr=0.001"))
    with pytest.raises(ConfigError) as refused:
        check_resume(saved, fingerprint(tiny_spec("optimizer.lr=0.01")), [], 6)
    assert refused.value.key == "optimizer.lr"
    assert ("the checkpoint at step 6 was made with another job spec: optimizer.lr: 0.001 (the checkpoint), "
            "0.01 (now)") in str(refused.value)
    # Training longer, saving otherwise, another attention kernel: a reload's changes resume as before.
    check_resume(saved, fingerprint(tiny_spec("optimizer.lr=0.001", "train.max_steps=900",
                                              "checkpoint.interval_steps=7", "attention.kernel=sdpa",
                                              "device.deterministic=true")), [], 6)
    # The job allows more, by key or by section.
    for allowed in (["optimizer.lr"], ["optimizer"]):
        check_resume(saved, fingerprint(tiny_spec("optimizer.lr=0.01")), allowed, 6)
    check_resume(None, fingerprint(tiny_spec()), [], 6)  # a checkpoint older than fingerprints


def test_allowed_spec_changes_must_name_keys_of_a_job_spec(tiny_spec):
    assert tiny_spec("checkpoint.allow_spec_changes=[optimizer.lr, scheduler, checkpoint.async]")
    with pytest.raises(SpecError, match=r"checkpoint.allow_spec_changes.1: is not a key or section of a job spec"):
        tiny_spec("checkpoint.allow_spec_changes=[optimizer.lr, optimiser.lr]")


def test_the_manifest_records_the_fingerprint_and_reads_without_one(tiny_spec):
    values = fingerprint(tiny_spec())
    manifest = mf.Manifest(job="j", step=1, micro_step=0, world_size=1, spec_hash=digest(values), version="v",
                           reason="interval", files=(), fingerprint=values, hosts=2)
    assert mf.Manifest.from_json(manifest.to_json()) == manifest
    older = json.loads(manifest.to_json())
    del older["fingerprint"]
    assert mf.Manifest.from_json(json.dumps(older)).fingerprint is None
    with pytest.raises(ValueError):
        mf.Manifest.from_json(json.dumps({**older, "fingerprint": "abc"}))
