from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_opt.callbacks import AsyncCheckpoint
from tests.callbacks.conftest import TinyModule, make_batches, make_trainer


def _fit(tmp_path, module, cb, **kw):
    t = make_trainer(tmp_path, [cb], **kw)
    t.fit(module, **({"ckpt_path": kw.pop("ckpt_path")} if "ckpt_path" in kw else {}))
    return t


def test_keep_last_k_last_link_and_loadable(tmp_path):
    cb = AsyncCheckpoint(
        dirpath=str(tmp_path / "ck"), every_n_steps=2, keep_last_k=2, save_on_train_end=False
    )
    t = make_trainer(tmp_path, [cb], max_epochs=1)
    t.fit(TinyModule(batches=make_batches(8)))
    names = sorted(n for n in os.listdir(tmp_path / "ck") if not n.startswith("."))
    assert names == ["last.ckpt", "step=000000006.ckpt", "step=000000006.ckpt.sha256",
                     "step=000000008.ckpt", "step=000000008.ckpt.sha256"]  # each with its checksum
    assert os.readlink(tmp_path / "ck" / "last.ckpt") == "step=000000008.ckpt"
    ck = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
    assert ck["global_step"] == 8
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"} <= ck.keys()
    assert cb.saves == 4


def test_file_no_larger_than_sync_save_with_tied_weights(tmp_path):
    class Tied(TinyModule):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.head = torch.nn.Linear(32, 16, bias=False)
            self.head.weight = self.net[0].weight  # tied: one storage, seen twice

    cb = AsyncCheckpoint(dirpath=str(tmp_path / "ck"), every_n_steps=3, save_on_train_end=False)
    t = make_trainer(tmp_path, [cb], max_steps=3)
    m = Tied(batches=make_batches(4))
    t.fit(m)
    sync = tmp_path / "sync.ckpt"
    t.save_checkpoint(sync)
    ours = tmp_path / "ck" / "step=000000003.ckpt"
    assert ours.stat().st_size <= sync.stat().st_size
    loaded = torch.load(ours, weights_only=False)["state_dict"]
    assert (
        loaded["head.weight"].untyped_storage().data_ptr()
        == loaded["net.0.weight"].untyped_storage().data_ptr()
    )


def test_resume_is_bit_exact(tmp_path):
    batches = make_batches(6)

    def module():
        return TinyModule(batches=batches, dropout=0.3)

    full = module()
    _fit(tmp_path / "a", full, AsyncCheckpoint(every_n_steps=100, save_on_train_end=False), max_epochs=2)

    first = module()
    cb = AsyncCheckpoint(dirpath=str(tmp_path / "ck"), every_n_steps=8, save_on_train_end=False)
    _fit(tmp_path / "b", first, cb, max_epochs=2, max_steps=9)  # saves mid-epoch 2, then "crashes"
    torch.manual_seed(1234)  # the resumed run must not depend on the RNG state it starts with
    second = module()
    t = make_trainer(
        tmp_path / "c", [AsyncCheckpoint(every_n_steps=100, save_on_train_end=False)], max_epochs=2
    )
    t.fit(second, ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert len(full.losses) == 12
    assert first.losses[:8] + second.losses == full.losses
    for a, b in zip(full.parameters(), second.parameters()):
        assert torch.equal(a, b)


def test_write_error_surfaces_at_next_save(tmp_path):
    class Unpicklable(TinyModule):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["bad"] = lambda: None  # torch.save cannot pickle a lambda

    cb = AsyncCheckpoint(dirpath=str(tmp_path / "ck"), every_n_steps=1, save_on_train_end=False)
    with pytest.raises(RuntimeError, match="AsyncCheckpoint: writing .*step=000000001.ckpt failed"):
        make_trainer(tmp_path, [cb], max_steps=3).fit(Unpicklable(batches=make_batches(4)))
    assert not any(n.endswith(".ckpt") and n.startswith("step") for n in os.listdir(tmp_path / "ck"))


def test_config_is_validated():
    with pytest.raises(ValueError, match="every_n_steps"):
        AsyncCheckpoint(every_n_steps=0)
    with pytest.raises(ValueError, match="keep_last_k"):
        AsyncCheckpoint(keep_last_k=0)


def _child(mode: str, ck: str, marker_fd: int) -> None:
    """A training run in a forked child (torch and Lightning already imported); progress markers go to
    ``marker_fd``. ``kill``: the second save stops between writing and renaming; ``sigterm``: slow steps, and only
    the exception save writes. One intra-op thread: a forked child that enters its parent's OpenMP thread pool
    hangs."""
    import lightning_opt.callbacks.async_checkpoint as ac

    torch.set_num_threads(1)
    markers = os.fdopen(marker_fd, "w", buffering=1)
    if mode == "kill":
        real_save = torch.save
        calls = []

        def slow_save(obj, f, *a, **k):
            calls.append(f)
            real_save(obj, f, *a, **k)
            if len(calls) == 2:  # second checkpoint: stop between write and rename
                markers.write("MIDWRITE\n")
                time.sleep(60)

        ac.torch.save = slow_save

    class Slow(TinyModule):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                markers.write("STARTED\n")
            if mode == "sigterm" and batch_idx >= 3:
                time.sleep(0.05)
            return super().training_step(batch, batch_idx)

    every = 2 if mode == "kill" else 10_000  # sigterm: only the exception save writes
    cb = ac.AsyncCheckpoint(dirpath=ck, every_n_steps=every, save_on_train_end=False)
    make_trainer(ck, [cb], max_epochs=1000).fit(Slow(batches=make_batches(8)))


class _Forked:
    """A forked child process with ``subprocess.Popen``'s handles: ``pid``, ``stdout`` (its markers), ``poll``,
    ``wait``, ``kill``, ``send_signal``."""

    def __init__(self, mode: str, ck: str) -> None:
        read, write = os.pipe()
        self._proc = multiprocessing.get_context("fork").Process(target=_child, args=(mode, ck, write))
        self._proc.start()
        os.close(write)
        self.pid = self._proc.pid
        self.stdout = os.fdopen(read)

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"child {self.pid}", timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def _spawn(tmp_path, mode):
    ck = tmp_path / "ck"
    return _Forked(mode, str(ck)), ck


def _wait_for(proc, marker, timeout=180):  # generous: the sharded ranks start their interpreters meanwhile
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if marker in line:
            return
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"child never printed {marker}")


def _spawn_sharded(root: Path) -> list[subprocess.Popen]:
    """Two ranks of tests/callbacks/_sharded_child.py, torchelastic-style (Lightning then launches nothing)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).parent / "_sharded_child.py"
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            TORCHELASTIC_RUN_ID="test",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE="2",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            LOCAL_WORLD_SIZE="2",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(root)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """The sharded ranks (new processes: each spends seconds importing torch and Lightning) start first; the kill
    and sigterm runs are forked from this process and start training at once."""
    sharded = _spawn_sharded(tmp_path_factory.mktemp("sharded"))
    procs = {mode: _spawn(tmp_path_factory.mktemp(mode), mode) for mode in ("kill", "sigterm")}
    procs["sharded"] = (sharded, None)
    yield procs
    for proc, _ in procs.values():
        for p in proc if isinstance(proc, list) else [proc]:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()


def test_kill_9_mid_write_leaves_previous_checkpoint_loadable(children):
    proc, ck = children["kill"]
    _wait_for(proc, "MIDWRITE")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    final = sorted(n for n in os.listdir(ck) if n.startswith("step=") and n.endswith(".ckpt"))
    assert final == ["step=000000002.ckpt"]  # the half-done save never got its final name
    assert list(ck.glob(".writing/*/archive.tmp"))  # the half-written temporary is all that's left
    loaded = torch.load(ck / "last.ckpt", weights_only=False)
    assert loaded["global_step"] == 2


def test_sigterm_writes_a_checkpoint(children):
    proc, ck = children["sigterm"]
    _wait_for(proc, "STARTED")
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    exc = [n for n in os.listdir(ck) if n.endswith("-exception.ckpt")]
    assert len(exc) == 1, os.listdir(ck)
    loaded = torch.load(ck / exc[0], weights_only=False)
    assert loaded["global_step"] >= 4


def test_every_minutes(tmp_path):
    class Slow(TinyModule):
        def training_step(self, batch, batch_idx):
            time.sleep(0.03)
            return super().training_step(batch, batch_idx)

    cb = AsyncCheckpoint(
        dirpath=str(tmp_path / "ck"),
        every_minutes=0.1 / 60,
        decide_every_n_steps=1,
        keep_last_k=None,
        save_on_train_end=False,
    )
    make_trainer(tmp_path, [cb]).fit(Slow(batches=make_batches(12)))  # ~0.4 s: a save every ~0.1 s
    assert 2 <= cb.saves <= 6, cb.saves


def test_resume_with_nan_skip_decision_pending_at_save(tmp_path):
    """Device-mode NaNSkip defers each scheduler step until the step's flag is read; a save right
    after a good step must store the scheduler with that step applied, so the resumed run
    matches the uninterrupted one (batch 2 is skipped, batch 3's decision is pending at the save)."""
    from lightning_opt.callbacks import NaNSkip

    batches = make_batches(8)
    full = TinyModule(batches=batches, nan_at=(2,))
    make_trainer(tmp_path / "a", [NaNSkip()]).fit(full)

    first = TinyModule(batches=batches, nan_at=(2,))
    cb = AsyncCheckpoint(dirpath=str(tmp_path / "ck"), every_n_steps=4, save_on_train_end=False)
    make_trainer(tmp_path / "b", [NaNSkip(), cb], max_steps=5).fit(first)  # saves after batch 3
    second = TinyModule(batches=batches, nan_at=(2,))
    t = make_trainer(tmp_path / "c", [NaNSkip(), AsyncCheckpoint(every_n_steps=100, save_on_train_end=False)])
    t.fit(second, ckpt_path=str(tmp_path / "ck" / "step=000000004.ckpt"))
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 7  # 8 batches, 1 skipped
    for a, b in zip(full.parameters(), second.parameters()):
        assert torch.equal(a, b)


class _Capture(Callback):
    """Clones the parameters at the end of one step (before AsyncCheckpoint, which runs last)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.params: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.params = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_save_holds_the_state_of_its_step(tmp_path, overlap):
    """The non-blocking copies (same stream, or a side stream joined at the next optimizer step)
    must capture exactly the state at the save, although training continues right away."""
    dim = 1024  # 8 MB weights + 16 MB of Adam state: the copy is in flight while later steps are queued
    cap = _Capture(step=3)
    cb = AsyncCheckpoint(
        dirpath=str(tmp_path / "ck"), every_n_steps=3, save_on_train_end=False, overlap_copy=overlap
    )
    module = TinyModule(batches=make_batches(8, dim=dim), dim=dim, hidden=2048, fused=True)
    trainer = make_trainer(tmp_path, [cap, cb], accelerator="gpu")
    trainer.fit(module)
    saved = torch.load(tmp_path / "ck" / "step=000000003.ckpt", weights_only=True)["state_dict"]
    assert saved.keys() == cap.params.keys()
    for k in saved:
        assert torch.equal(saved[k], cap.params[k]), k
    assert not torch.equal(saved["net.0.weight"], module.net[0].weight.detach().cpu())  # training went on


def test_sharded_fsdp2_saves_through_dcp_and_resumes_exactly(children):
    """ModelParallelStrategy (FSDP2) on 2 gloo ranks: dcp.async_save into .writing/, rank 0 adds
    meta.pt and renames the directory; trainer.fit(ckpt_path=last) resumes bit-exactly."""
    procs, _ = children["sharded"]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        outputs.append(out)
    results = [line for out in outputs for line in out.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2, "\n".join(o[-3000:] for o in outputs)
    for line in results:
        assert "losses_equal=True params_equal=True" in line, line
        assert "names=['last.ckpt', 'step=000000004.ckpt']" in line, line  # keep_last_k=1
