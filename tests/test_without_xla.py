"""The engine where torch_xla is not installed: a GPU box with a newer torch, say."""

import subprocess

import pytest

from tests.conftest import PYTHON, TINY_JOB, python_env

pytestmark = pytest.mark.slow

# A torch_xla that fails on import stands in for its absence: any import of it, however
# indirect, breaks the run.
SHIM = "raise ImportError('torch_xla is not installed here')\n"


def train(tmp_path, *overrides):
    (tmp_path / "shim").mkdir(exist_ok=True)
    (tmp_path / "shim" / "torch_xla.py").write_text(SHIM)
    env = python_env()
    env["PYTHONPATH"] = f"{tmp_path / 'shim'}:{env['PYTHONPATH']}"
    return subprocess.run(
        [PYTHON, "-m", "engine.train", str(TINY_JOB), "train.max_steps=2", "scheduler.warmup_steps=1",
         "data.corpus_bytes=400000", "data.seq_len=64", *overrides, "--state-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )


def test_cpu_training_never_imports_torch_xla(tmp_path):
    out = train(tmp_path, "device.backend=auto")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert '"backend": "cpu"' in out.stdout


def test_asking_for_xla_without_torch_xla_is_a_config_error(tmp_path):
    out = train(tmp_path, "device.backend=xla")
    assert out.returncode == 78
    assert "device.backend" in out.stdout and "torch_xla" in out.stdout
