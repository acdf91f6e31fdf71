"""Hooks that tests and probe scripts use to drive and watch a training run."""

from engine import events
from engine.hooks import Boundary, Hooks


class Recorder(Hooks):
    """Records every event; answers polls from `requests`.

    requests: {(step, micro_step) or Boundary: a Request, or a callable returning one}, each
    used once. on: {event type: callable(event)}, called as each event arrives. `boundaries`
    lists every boundary polled.
    """

    def __init__(self, requests=None, on=None):
        self.requests = {(k.step, k.micro_step) if isinstance(k, Boundary) else k: v
                         for k, v in (requests or {}).items()}
        self.on, self.events, self.boundaries = dict(on or {}), [], []

    def poll(self, at):
        self.boundaries.append(at)
        request = self.requests.pop((at.step, at.micro_step), None)
        return request() if callable(request) else request

    def emit(self, event):
        self.events.append(event)
        if type(event) in self.on:
            self.on[type(event)](event)

    def of(self, kind: type[events.Event]) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    @property
    def losses(self) -> dict[int, float]:
        return {e.step: e.loss for e in self.of(events.Step)}

    @property
    def dropped(self) -> list[float | None]:
        """Each step's dropped fraction, in step order (a mixture of experts with a capacity; else None)."""
        return [e.dropped_fraction for e in self.of(events.Step)]

    @property
    def nonfinite(self) -> events.NonFinite | None:
        found = self.of(events.NonFinite)
        return found[-1] if found else None


class StepLosses(Recorder):
    """The losses as a list in step order (what a probe prints as JSON)."""

    @property
    def losses(self) -> list[float]:
        return [e.loss for e in self.of(events.Step)]


def array_loader(tokens, seq_len, micro_batch_size, accum=1, seed=0, position=None, skips=()):
    """A PackedLoader over tokens held in memory, shuffled like the built-in corpus."""
    from engine.backends.base import DataPosition
    from engine.data.dataset import Shuffled, Windows
    from engine.data.loader import PackedLoader
    from engine.data.shards import ArrayStream

    samples = Shuffled(Windows(ArrayStream(tokens), seq_len + 1, "test"), seed)
    return PackedLoader(samples, micro_batch_size, accum, seed, position or DataPosition(), skips)


class XlaCounters(Recorder):
    """torch_xla's running counts at each step boundary (runs under PJRT_DEVICE): `at_step[N]` holds
    the compilations, device-to-host and host-to-device transfers, item() calls and graph
    launches (syncs) so far when step N + 1 is about to begin; `counts()` reads them now.

    Set `flush` to the backend's: it is called before each reading, so values that the backend's
    reader thread copies to the host count at the step whose report asked for them.
    """

    def __init__(self, requests=None, on=None):
        import torch_xla.debug.metrics as met

        super().__init__(requests, on)
        self.met, self.at_step, self.flush = met, {}, lambda: None

    def counts(self) -> dict[str, int]:
        def metric(name: str) -> int:
            data = self.met.metric_data(name)
            return data[0] if data else 0

        return {"compiles": metric("CompileTime"), "to_host": metric("TransferFromDeviceTime"),
                "to_device": metric("TransferToDeviceTime"),
                "item_calls": self.met.counter_value("xla::_local_scalar_dense") or 0,
                "syncs": self.met.counter_value("MarkStep") or 0}

    def poll(self, at):
        if at.micro_step == 0 and at.step not in self.at_step:  # the final save's retries poll again
            self.flush()
            self.at_step[at.step] = self.counts()
        return super().poll(at)
