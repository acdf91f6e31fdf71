"""The memory tier: the newest training states in host shared memory, written every step or few.

    <memory>/<job>/step_000000123/   state.bin   every tensor's bytes, each at its offset
                                     tree.json   the state's structure, each tensor's place,
                                                 and the values that are not tensors
                                     manifest.json, last: the disk tier's, CRC32C included

`<memory>` is a tmpfs directory the supervisor owns (TPUD_MEMORY_DIR), so a state survives
the worker's death but not the host's. It holds the same state as a disk checkpoint (model,
optimizer, progress, RNG, loader, partial gradients) and commits the same way: a directory
without a valid manifest does not exist.

Two slots, each a directory whose state.bin stays mapped in this process. A save takes the
slot that does not hold the newest state, withdraws its manifest (from then on it does not
exist), and copies every tensor into the mapping, which writes the shared memory itself, into
pages allocated once. The checksums, tree.json and the manifest follow, and a rename gives the
directory its step's name. With `background`, that second part runs on this tier's thread and
a step whose save would wait for it is not saved; without, the caller does it too: a thread
working beside CPU training slows its OpenMP threads by far more than the work itself takes.

A disk checkpoint of a step the memory tier holds is written from the slot's tensors (views,
no second copy); the slot is held until that write ends, and a save meanwhile uses the other.
Restore (engine.checkpoint.restore) verifies every byte against the manifest first.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from engine.checkpoint import manifest as mf
from engine.checkpoint.leaves import dtype_named, flatten, local, sharded_like, spec, unflatten, view_of
from engine.checkpoint.errors import describe_error
from engine.side_threads import side_thread

log = structlog.get_logger()

STATE, TREE = "state.bin", "tree.json"
_ALIGN = 64
Key = tuple[int, int]  # (step, micro_step)
# (directory, step, micro_step, reason, files) -> its manifest
Describe = Callable[[Path, int, int, str, tuple[mf.FileEntry, ...]], mf.Manifest]
Committed = Callable[[Key, Path, mf.Manifest, float], None]


@dataclass(frozen=True)
class Held:
    """A slot's state as tensors over its mapping, readable until `release()`."""

    slot: _Slot
    release: Callable[[], None]

    @property
    def state(self) -> dict:
        slot = self.slot
        return unflatten([value if view is None else sharded_like(view, layout)
                          for view, value, layout in zip(slot.views, slot.values, slot.specs)], slot.structure)


@dataclass
class _Slot:
    """One state's place: a directory and its state.bin, mapped while this process lives."""

    path: Path
    key: Key | None = None  # the committed state it holds; None while being written or empty
    staged: Key | None = None  # the state its bytes hold, committed or being committed
    readers: int = 0  # holders of its tensors: a commit in flight, disk writes
    size: int = 0
    mapping: mmap.mmap | None = None
    buffer: torch.Tensor | None = None  # uint8 over the mapping
    # The layout, kept while the state's structure and tensor shapes stay the same (every step):
    structure: object = None
    shapes: list = field(default_factory=list)  # (shape, dtype) per tensor leaf, None per other value
    places: list = field(default_factory=list)  # (offset, nbytes) per tensor leaf, None per other value
    views: list = field(default_factory=list)  # a tensor over the mapping per tensor leaf, None per other value
    tree_head: str = ""  # tree.json but for the values
    values: list = field(default_factory=list)  # the other values of the state it holds
    # Per tensor leaf, how a sharded one (a DTensor: one of a host's processes) lies over its mesh,
    # so a disk write from the slot is the sharded state again; None for a plain one.
    specs: list = field(default_factory=list)

    def release(self) -> None:
        self.buffer, self.structure, self.views = None, None, []
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a view still exported (a caller's tensor): the mapping ends with it
                pass
            self.mapping = None
        self.size = 0


class MemoryTier:
    def __init__(self, job_dir: Path, describe: Describe, on_commit: Committed,
                 on_failure: Callable[[Key, str], None], *, background: bool):
        self.job_dir = Path(job_dir)
        self._describe, self._on_commit, self._on_failure = describe, on_commit, on_failure
        self.job_dir.mkdir(parents=True, exist_ok=True)
        self._thread = side_thread("memory-checkpoint") if background else None
        self._pending: Future | None = None
        self._lock = threading.Lock()  # slot choice and holders: the training, commit and disk threads
        self.slots = self._adopt()

    def _adopt(self) -> list[_Slot]:
        """The two newest committed states a previous worker left become the slots; the rest goes."""
        keep = mf.parts(self.job_dir)[-2:]
        kept = [path for _, path, _ in keep]
        for child in self.job_dir.iterdir():
            if child not in kept:
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        slots: list[_Slot | None] = [None] * (2 - len(keep)) + [
            _Slot(path, (step, m.micro_step), (step, m.micro_step)) for step, path, m in keep]
        return [slot or _Slot(self.job_dir / f".slot-{i}") for i, slot in enumerate(slots)]

    @property
    def newest(self) -> Key | None:
        """The newest committed state."""
        keys = [s.key for s in self.slots if s.key is not None]
        return max(keys) if keys else None

    def busy(self) -> bool:
        """A save's checksums and manifest are still being written."""
        return self._pending is not None and not self._pending.done()

    def save(self, state: dict, key: Key, reason: str, started: float) -> Held | None:
        """Copy `state` into a free slot and commit it (module docstring); the slot is held for the
        caller (release it). None when the newest slot already holds `key`, or no slot is free now
        (a commit still in flight, or a disk write reading the other)."""
        with self._lock:
            newest = max((s.staged for s in self.slots if s.staged is not None), default=None)
            free = [s for s in self.slots if s.readers == 0 and (newest is None or s.staged != newest)]
            if self.busy() or key == newest or not free:
                return None
            slot = free[0]
            slot.readers += 2  # the caller's hold, and the commit's
        leaves, structure = flatten(state)
        slot.specs = [spec(leaf) for leaf in leaves]
        leaves = [local(leaf) for leaf in leaves]  # what this process holds of each
        try:
            self._withdraw(slot)
            self._place(slot, leaves, structure)
        except OSError as e:  # a full tmpfs: fallocate says so before any page is touched
            with self._lock:
                slot.readers -= 2
            self._failed(slot, key, e)
            return None
        pairs = [(view, leaf.detach()) for view, leaf in zip(slot.views, leaves) if view is not None]
        torch._foreach_copy_([view for view, _ in pairs], [leaf for _, leaf in pairs])  # one call, not hundreds
        slot.values = [leaf if view is None else None for view, leaf in zip(slot.views, leaves)]
        slot.staged = key
        if self._thread is None:
            self._commit(slot, key, reason, started)
        else:
            self._pending = self._thread.submit(self._commit, slot, key, reason, started)
        return Held(slot, lambda: self._release(slot))

    def hold(self, key: Key) -> Held | None:
        """The slot holding `key` (committed, or being committed by this process), held for a disk
        write until released; None when no slot this process wrote holds it."""
        with self._lock:
            slot = next((s for s in self.slots if s.staged == key and s.buffer is not None), None)
            if slot is None:
                return None
            slot.readers += 1
        return Held(slot, lambda: self._release(slot))

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            slot.readers -= 1

    def _withdraw(self, slot: _Slot) -> None:
        """The slot no longer holds a committed state: its manifest goes before any byte changes."""
        (slot.path / mf.MANIFEST).unlink(missing_ok=True)
        slot.key = slot.staged = None
        hidden = self.job_dir / f".slot-{self.slots.index(slot)}"
        if slot.path != hidden:
            shutil.rmtree(hidden, ignore_errors=True)
            if slot.path.is_dir():
                slot.path.rename(hidden)
            else:  # discarded (a rollback undid it) or a failed save removed: its state.bin is mapped anew
                slot.release()
            slot.path = hidden

    def _place(self, slot: _Slot, leaves: list, structure: object) -> None:
        """Lay the tensors out in the slot's state.bin (resized when the layout changed), with a view
        per tensor; kept from the slot's previous save while the layout is the same."""
        shapes = [(leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        slot.path.mkdir(parents=True, exist_ok=True)
        if slot.buffer is not None and shapes == slot.shapes and structure == slot.structure:
            return
        places, offset = [], 0
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                nbytes = leaf.numel() * leaf.element_size()
                places.append((offset, nbytes))
                offset += -(-nbytes // _ALIGN) * _ALIGN
            else:
                places.append(None)
        if slot.mapping is None or slot.size != offset:
            slot.release()
            self._map(slot, max(offset, 1))
        slot.structure, slot.shapes, slot.places = structure, shapes, places
        slot.views = [None if place is None else view_of(slot.buffer, place[0], place[1], shape[1], tuple(shape[0]))
                      for place, shape in zip(places, shapes)]
        slot.tree_head = json.dumps({"structure": structure, "tensors": [
            None if place is None else {"offset": place[0], "nbytes": place[1], "dtype": str(shape[1]),
                                        "shape": list(shape[0])} for place, shape in zip(places, shapes)]})

    def _map(self, slot: _Slot, size: int) -> None:
        fd = os.open(slot.path / STATE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            # Pages of a tmpfs file are allocated on first touch, and a full tmpfs then kills the
            # writer with SIGBUS; allocated now, a full one is an ENOSPC here instead.
            os.posix_fallocate(fd, 0, size)
            slot.mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        slot.size = size
        slot.buffer = torch.frombuffer(slot.mapping, dtype=torch.uint8)

    def _commit(self, slot: _Slot, key: Key, reason: str, started: float) -> None:
        try:
            tree = (slot.tree_head[:-1] + ', "values": ' + json.dumps(slot.values) + "}").encode()
            (slot.path / TREE).write_bytes(tree)
            # Checksummed from the mapping itself: what was copied, without reading a file back.
            files = (mf.FileEntry(STATE, slot.size, mf.crc32c(slot.mapping)),
                     mf.FileEntry(TREE, len(tree), mf.crc32c(tree)))
            manifest = self._describe(slot.path, key[0], key[1], reason, files)
            mf.write_manifest(slot.path, manifest)
            final = self.job_dir / mf.step_dir_name(*key)
            for other in self.slots:
                if other.path == final:  # an older life's state of this step (restore passed it over)
                    other.key = other.staged = None
            shutil.rmtree(final, ignore_errors=True)
            slot.path.rename(final)
            slot.path, slot.key = final, key
        except Exception as e:  # noqa: BLE001  (a failed memory save never ends the run)
            self._failed(slot, key, e)
        else:
            self._on_commit(key, final, manifest, started)
        finally:
            self._release(slot)

    def _failed(self, slot: _Slot, key: Key, error: BaseException) -> None:
        slot.key = slot.staged = None
        if slot.readers == 0:
            slot.release()
        shutil.rmtree(slot.path, ignore_errors=True)
        self._on_failure(key, describe_error(error))

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._thread is not None:
            self._thread.shutdown()
        for slot in self.slots:
            slot.release()

    def transfer(self, key: Key, source: int, receivers: list[int], me: int, group) -> bool:
        """Send the committed state `key` from host `source` to each of `receivers` (ranks of
        `group`, one per host; every host calls this): whether this host now holds it, verified."""
        import torch.distributed as dist

        path = self.job_dir / mf.step_dir_name(*key)
        meta: list = [None]
        if me == source:
            manifest = mf.read_manifest(path)
            meta = [(mf.read_small(path / TREE), manifest.to_json() if manifest else None, (path / STATE).stat().st_size)]
        dist.broadcast_object_list(meta, src=dist.get_global_rank(group, source), group=group)
        tree, manifest_json, size = meta[0]
        if me == source:
            with open(path / STATE, "rb") as f:
                data = torch.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
            for receiver in receivers:
                dist.send(data, dst=dist.get_global_rank(group, receiver), group=group)
            return True
        if me not in receivers:
            return True
        data = torch.empty(size, dtype=torch.uint8)
        dist.recv(data, src=dist.get_global_rank(group, source), group=group)
        try:
            return self._receive(key, data, tree, mf.Manifest.from_json(manifest_json), me)
        except (OSError, ValueError, TypeError) as e:
            log.warning("could not keep a peer's memory state", step=key[0], error=str(e))
            return False

    def _receive(self, key: Key, data: torch.Tensor, tree: str, manifest: mf.Manifest, me: int) -> bool:
        slot = self.slots[0]
        self._withdraw(slot)
        slot.release()
        slot.path.mkdir(parents=True, exist_ok=True)
        with open(slot.path / STATE, "wb") as f:
            f.write(memoryview(data.numpy()))
        (slot.path / TREE).write_text(tree)
        mine = dataclasses.replace(manifest, host=me)
        if mf.problems(slot.path, mine, checksums=True):
            shutil.rmtree(slot.path, ignore_errors=True)
            return False
        mf.write_manifest(slot.path, mine)
        final = self.job_dir / mf.step_dir_name(*key)
        for other in self.slots:
            if other.path == final:  # a damaged copy of this step, which restore passed over
                other.key = other.staged = None
        shutil.rmtree(final, ignore_errors=True)
        slot.path.rename(final)
        slot.path, slot.key, slot.staged = final, key, key
        return True

    def discard(self, path: Path, why: list[str],
                what: str = "memory checkpoint failed verification, discarded") -> None:
        """A state that failed verification (or a rollback undid): never trusted, and its memory given back."""
        log.warning(what, path=str(path), problems=why)
        for slot in self.slots:
            if slot.path == path:
                slot.key = slot.staged = None
        shutil.rmtree(path, ignore_errors=True)


def load(path: Path, template: dict) -> dict:
    """The state saved in `path`, its tensors copied into `template`'s (same structure, shapes and
    dtypes, else ValueError); the caller has verified the files against the manifest."""
    tree = json.loads(mf.read_small(path / TREE))
    targets, structure = flatten(template)
    if tree["structure"] != structure:
        raise ValueError("the saved state's structure differs from this model and optimizer")
    entries, values = tree["tensors"], tree["values"]
    if not len(entries) == len(values) == len(targets):
        raise ValueError("tree.json does not match its structure")
    with open(path / STATE, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        # Private and copy-on-write: nothing here writes, and the saved bytes cannot change under it.
        buffer = torch.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    leaves = []
    for entry, value, target in zip(entries, values, targets):
        if entry is None:
            leaves.append(value)
            continue
        dtype, shape, mine = dtype_named(entry["dtype"]), tuple(entry["shape"]), local(target)
        if not isinstance(target, torch.Tensor) or mine.dtype != dtype or tuple(mine.shape) != shape:
            raise ValueError(f"a tensor of {list(shape)} {dtype} does not fit its place in this model")
        nbytes = mine.numel() * mine.element_size()
        if not 0 <= entry["offset"] <= size - nbytes:
            raise ValueError("a tensor lies beyond the end of state.bin")
        mine.copy_(view_of(buffer, entry["offset"], nbytes, dtype, shape))
        leaves.append(target)
    return unflatten(leaves, structure)
