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
exist), and copies every tensor into the mapping: the only part the training loop waits for,
and it writes the shared memory itself, into pages allocated once. The checksums, tree.json and
the manifest follow on this tier's own thread, and a rename gives the directory its step's
name. At most one save is in flight: a step whose save would wait for one is not saved.

A disk checkpoint of a step the memory tier holds is written from the slot's tensors (views,
no second copy); the slot is held until that write ends, and a save meanwhile uses the other.
Restore (engine.checkpoint.checkpointer) verifies every byte against the manifest first.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from engine.checkpoint import manifest as mf

log = structlog.get_logger()

STATE, TREE = "state.bin", "tree.json"
_ALIGN = 64
Key = tuple[int, int]  # (step, micro_step)


@dataclass(frozen=True)
class Held:
    """A slot's state as tensors over its mapping, readable until `release()`."""

    state: dict
    release: Callable[[], None]


# (directory, step, micro_step, reason, files) -> its manifest
Describe = Callable[[Path, int, int, str, tuple[mf.FileEntry, ...]], mf.Manifest]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class _Slot:
    """One state's place: a directory and its state.bin, mapped while this process lives."""

    path: Path
    key: Key | None = None  # the committed state it holds; None while being written or empty
    size: int = 0
    mapping: mmap.mmap | None = None
    buffer: torch.Tensor | None = None  # uint8 over the mapping
    staged: Key | None = None  # the state its bytes hold, committed or being committed
    readers: int = 0  # holders of its tensors: a commit in flight, disk writes
    tree: dict = field(default_factory=dict)  # tree.json's content, for the state it holds

    def release(self) -> None:
        self.buffer = None
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a view still exported (a caller's tensor): the mapping ends with it
                pass
            self.mapping = None
        self.size = 0


class MemoryTier:
    def __init__(self, job_dir: Path, describe: Describe, emit_failure: Callable[[Key, str], None]):
        self.job_dir = Path(job_dir)
        self._describe, self._emit_failure = describe, emit_failure
        self.job_dir.mkdir(parents=True, exist_ok=True)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-checkpoint")
        self._pending: Future | None = None
        self._lock = threading.Lock()  # slot choice and holders: the training, commit and disk threads
        self.slots = self._adopt()

    def _adopt(self) -> list[_Slot]:
        """The two newest committed states a previous worker left become the slots; the rest goes."""
        committed = mf.parts(self.job_dir)
        keep = committed[-2:]
        for child in self.job_dir.iterdir():
            if child not in [path for _, path, _ in keep]:
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        slots: list[_Slot | None] = [_Slot(path, (step, m.micro_step), (step, m.micro_step))
                                     for step, path, m in keep]
        slots = [None] * (2 - len(slots)) + slots
        return [slot or _Slot(self.job_dir / f".slot-{i}") for i, slot in enumerate(slots)]

    @property
    def newest(self) -> Key | None:
        """The newest committed state."""
        keys = [s.key for s in self.slots if s.key is not None]
        return max(keys) if keys else None

    def busy(self) -> bool:
        """A save's checksums and manifest are still being written."""
        return self._pending is not None and not self._pending.done()

    def save(self, state: dict, key: Key, reason: str, on_commit: Callable[[Key, Path, mf.Manifest, float], None],
             started: float) -> Held | None:
        """Copy `state` into a free slot (the caller waits for this part) and commit it in the
        background; the slot is held for the caller (release it). None when the newest slot
        already holds `key`, or no slot is free now (a save still in flight, or a disk write
        reading the other)."""
        with self._lock:
            newest = max((s.staged for s in self.slots if s.staged is not None), default=None)
            free = [s for s in self.slots if s.readers == 0 and (newest is None or s.staged != newest)]
            if self.busy() or key == newest or not free:
                return None
            slot = free[0]
            slot.readers += 1  # for the caller; the commit below holds it too
        leaves, spec = tree_flatten(state)
        try:
            self._withdraw(slot)
            views = self._place(slot, leaves, spec)
            for view, leaf in zip(views, leaves):
                if view is not None:
                    view.copy_(leaf.detach())
        except OSError as e:  # a full tmpfs: fallocate says so before any page is touched
            self._release(slot)
            self._failed(slot, key, e)
            return None
        with self._lock:
            slot.staged = key
            slot.readers += 1
        self._pending = self._thread.submit(self._commit, slot, key, reason, on_commit, started)
        return self._held(slot)

    def hold(self, key: Key) -> Held | None:
        """The slot holding `key` (committed, or being committed by this process), held for a disk
        write until released; None when no slot this process wrote holds it."""
        with self._lock:
            slot = next((s for s in self.slots if s.staged == key and s.buffer is not None), None)
            if slot is None:
                return None
            slot.readers += 1
        return self._held(slot)

    def _held(self, slot: _Slot) -> Held:
        tree = slot.tree
        leaves = [entry["value"] if "value" in entry else
                  _view(slot.buffer, entry["offset"], entry["nbytes"], _dtype(entry["dtype"]), tuple(entry["shape"]))
                  for entry in tree["leaves"]]
        return Held(tree_unflatten(leaves, treespec_loads(tree["treespec"])), lambda: self._release(slot))

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
            slot.path.rename(hidden)
            slot.path = hidden

    def _place(self, slot: _Slot, leaves: list, spec) -> list[torch.Tensor | None]:
        """Lay the tensors out in the slot's state.bin (resized when the layout changed): one view per tensor."""
        tensors, values, offset = [], [], 0
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                nbytes = leaf.numel() * leaf.element_size()
                tensors.append((offset, nbytes, leaf.dtype, tuple(leaf.shape)))
                values.append(None)
                offset += -(-nbytes // _ALIGN) * _ALIGN
            else:
                tensors.append(None)
                values.append(leaf)
        slot.path.mkdir(parents=True, exist_ok=True)
        if slot.mapping is None or slot.size != offset:
            slot.release()
            self._map(slot, max(offset, 1))
        slot.tree = {"treespec": treespec_dumps(spec), "leaves": [
            {"value": v} if t is None else {"offset": t[0], "nbytes": t[1], "dtype": str(t[2]), "shape": list(t[3])}
            for t, v in zip(tensors, values)]}
        return [None if t is None else _view(slot.buffer, *t) for t in tensors]

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

    def _commit(self, slot: _Slot, key: Key, reason: str, on_commit, started: float) -> None:
        try:
            tree = json.dumps(slot.tree).encode()
            (slot.path / TREE).write_bytes(tree)
            # Checksummed from the mapping itself: what the loop wrote, without reading a file back.
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
            on_commit(key, final, manifest, started)
        finally:
            self._release(slot)

    def _failed(self, slot: _Slot, key: Key, error: BaseException) -> None:
        from engine.checkpoint.checkpointer import describe_error

        slot.key = slot.staged = None
        if slot.readers == 0:
            slot.release()
        shutil.rmtree(slot.path, ignore_errors=True)
        self._emit_failure(key, describe_error(error))

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        self._thread.shutdown()
        for slot in self.slots:
            slot.release()

    def discard(self, path: Path, why: list[str]) -> None:
        """A state that failed verification: never trusted, and its memory given back."""
        log.warning("memory checkpoint failed verification, discarded", path=str(path), problems=why)
        for slot in self.slots:
            if slot.path == path:
                slot.key = slot.staged = None
        shutil.rmtree(path, ignore_errors=True)


def _view(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    return buffer[offset:offset + nbytes].view(dtype).view(shape)


def load(path: Path, template: dict) -> dict:
    """The state saved in `path`, its tensors copied into `template`'s (same structure, shapes and
    dtypes, else ValueError); the caller has verified the files against the manifest."""
    tree = json.loads(mf.read_small(path / TREE))
    spec = treespec_loads(tree["treespec"])
    targets, target_spec = tree_flatten(template)
    if spec != target_spec:
        raise ValueError("the saved state's structure differs from this model and optimizer")
    if len(tree["leaves"]) != len(targets):
        raise ValueError("tree.json does not match its structure")
    with open(path / STATE, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        # Private and copy-on-write: nothing here writes, and the saved bytes cannot change under it.
        buffer = torch.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    leaves = []
    for entry, target in zip(tree["leaves"], targets):
        if "value" in entry:
            leaves.append(entry["value"])
            continue
        dtype, shape = _dtype(entry["dtype"]), tuple(entry["shape"])
        if not isinstance(target, torch.Tensor) or target.dtype != dtype or tuple(target.shape) != shape:
            raise ValueError(f"a tensor of {list(shape)} {dtype} does not fit its place in this model")
        nbytes = target.numel() * target.element_size()
        if not 0 <= entry["offset"] <= size - nbytes:
            raise ValueError("a tensor lies beyond the end of state.bin")
        target.copy_(_view(buffer, entry["offset"], nbytes, dtype, shape))
        leaves.append(target)
    return tree_unflatten(leaves, spec)
