"""tpud profile's engine side (engine.profiling): a trace a viewer opens, phases that account
for the measured step, and advice where a known waste shows."""

import json

import pytest

from engine import profiling
from engine.profiling import Report


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    from engine.spec.loader import load_spec
    from tests.conftest import TINY_JOB

    spec = load_spec(TINY_JOB, ["data.corpus_bytes=400000", "model.n_layers=2", "data.micro_batch_size=4",
                                "data.seq_len=64", "loss.name=cce", "checkpoint.interval_steps=1"])
    out = tmp_path_factory.mktemp("profile")
    # Ten steps of ~30 ms: over three, one scheduler hiccup on a busy 2-core machine moved the
    # step time by more than the 10 % the phases are held to.
    return profiling.run(spec, steps=10, warmup=2, out=out, tensorboard=str(out.parent / "board")), out


@pytest.mark.slow
def test_the_trace_opens_and_the_phases_account_for_the_step(profiled):
    report, out = profiled
    trace = json.loads((out / "trace.json").read_text())  # Chrome trace format: Perfetto opens it
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {f"tpud.{phase}" for phase in profiling.PHASES} <= names and "aten::mm" in names
    # The phases are disjoint scopes inside the step: never more than it, and the rest is reported
    # as host gaps. They hold most of it: a phase left unmarked (backward is ~40 % here, forward
    # ~25 %) falls below the floor. A quiet run leaves ~5 % in gaps; CI's busy 2 cores left 10.5 %
    # (a preemption between scopes lands in a gap), which failed the 10 % this was once held to.
    measured = sum(report.phases.values())
    assert 0.7 * report.step_s <= measured <= 1.02 * report.step_s, (measured, report.step_s)
    assert report.host_gaps_s == pytest.approx(max(0.0, report.step_s - measured)), report
    assert all(seconds > 0 for seconds in report.phases.values()), report.phases
    assert report.top and report.top[0]["seconds"] >= report.top[-1]["seconds"]
    assert json.loads((out / "report.json").read_text())["steps"] == 10
    # The job's saves are not profiled (checkpoint.interval_steps=1 above): nothing is written beside it.
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "trace.json"]
    # ... and the job's TensorBoard run holds the trace too, as TensorBoard's profiler plugin names it.
    (copy,) = (out.parent / "board" / spec_name(out)).glob("*.pt.trace.json.gz")
    assert report.tensorboard_trace == str(copy) and f"TensorBoard: {copy}" in report.table()


def spec_name(out):
    return json.loads((out / "report.json").read_text())["job"]


def test_the_trace_goes_to_a_tensorboard_directory_local_or_gs(tmp_path, gcs_server):
    import gzip

    import torch
    from torch.profiler import profile

    with profile() as profiler:
        torch.ones(8, 8) @ torch.ones(8, 8)
    profiler.export_chrome_trace(str(trace := tmp_path / "trace.json"))
    local = profiling.tensorboard_trace(trace, str(tmp_path / "board"), "job", tmp_path / "out")
    assert local.startswith(str(tmp_path / "board" / "job")) and local.endswith(".pt.trace.json.gz")
    names = {e.get("name") for e in json.loads(gzip.decompress(open(local, "rb").read()))["traceEvents"]}
    assert "aten::mm" in names  # Chrome trace format, gzipped: TensorBoard's plugin and Perfetto open it
    remote = profiling.tensorboard_trace(trace, "gs://tpud-test/boards", "job", tmp_path / "out")
    (blob,) = gcs_server.client().list_blobs("tpud-test", prefix="boards/job/")
    assert remote == f"gs://tpud-test/{blob.name}" and "traceEvents" in json.loads(gzip.decompress(blob.download_as_bytes()))


def test_advice_names_the_waste_it_sees():
    class Trainer:
        loss_name = "cce"

        class backend:
            name, compiling = "cuda", False

    report = Report("j", "cuda", 4, 1.0, {"data": 0.2, "forward": 0.1, "loss": 0.4, "backward": 0.1,
                                          "optimizer": 0.05}, 0.15, syncs_per_step=3)
    advice = "\n".join(profiling._advice(report, Trainer))
    assert "host syncs per step: 3" in advice and "the loss takes 40% of the step: try loss.name=ce" in advice
    assert "data takes 20%" in advice and "device.compile is off" in advice
    Trainer.loss_name, Trainer.backend.compiling = "ce", True
    calm = Report("j", "cuda", 4, 1.0, {"data": 0.01, "forward": 0.3, "loss": 0.1, "backward": 0.5,
                                        "optimizer": 0.05}, 0.04, syncs_per_step=0)
    assert profiling._advice(calm, Trainer) == []


def _cli(*args, **env):
    import subprocess

    from tests.conftest import PYTHON, REPO, python_env

    return subprocess.run([PYTHON, "-m", "tpud", "profile", *args], cwd=REPO, env=python_env(**env),
                          capture_output=True, text=True, timeout=600)


def test_the_command_line_refuses_bad_arguments_and_jobs(tmp_path):
    from tests.conftest import TINY_JOB

    done = _cli(str(TINY_JOB), "--steps", "0")
    assert done.returncode == 2 and "'0': a whole number of steps, at least 1" in done.stderr
    (tmp_path / "bad.yaml").write_text("name: bad\nmodel: {dim: -1}\n")
    done = _cli(str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "out"))
    assert done.returncode == 78 and "bad.yaml" in done.stderr and "model.dim" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.xla
@pytest.mark.slow
def test_profile_under_xla_counts_compiles_and_transfers(tmp_path):
    from tests.conftest import TINY_JOB

    done = _cli(str(TINY_JOB), "device.backend=xla", "train.mixed_precision=fp32", "attention.kernel=eager",
                "model.n_layers=2", "data.micro_batch_size=4", "data.seq_len=64", "data.corpus_bytes=400000",
                "--steps", "3", "--warmup", "2", "--out", str(tmp_path), PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps on xla" in done.stdout and "tpud.optimizer" in (tmp_path / "trace.json").read_text()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["xla"]["compiles"] == 0, report  # one graph, compiled during the warm-up
    assert report["xla"]["transfers_to_host"] < report["steps"], report


def test_on_cuda_backward_is_the_busy_time_no_loop_scope_holds():
    """As the H100 profile of the 125m step showed: autograd's device thread launches backward's
    kernels outside tpud.backward (0.02 of 81 ms credited to it), which made backward look like
    host gaps. The device's busy time, less the other phases, is backward's; the rest is idle."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(device, start_us, end_us, annotation=False):
        return SimpleNamespace(device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start_us, end=end_us))

    # Two streams' kernels overlap by 5 ms; the loop's scope mirrored onto the GPU (an annotation)
    # and the host's own events are not device work. (The H100 run before this counted both
    # and put backward at 92 % of a step, beside forward's 24 %.)
    trace = [event(DeviceType.CUDA, 0, 30_000), event(DeviceType.CPU, 0, 80_000),
             event(DeviceType.CUDA, 25_000, 45_000), event(DeviceType.CUDA, 0, 80_000, annotation=True),
             event(DeviceType.CUDA, 50_000, 75_000)]
    assert profiling.device_busy_s(trace) == pytest.approx(0.07)
    phases = {"data": 0.0002, "forward": 0.018, "loss": 0.015, "backward": 0.00002, "optimizer": 0.0009}
    fixed, idle = profiling._device_phases(phases, 0.07, 0.0814)
    assert fixed["backward"] == pytest.approx(0.07 - 0.0341) and idle == pytest.approx(0.0114)
    assert {k: v for k, v in fixed.items() if k != "backward"} == {k: v for k, v in phases.items() if k != "backward"}
