"""Saving and loading a training run's state: :class:`Checkpointer` is built once by ``pretrain`` (on every
rank, after the model, optimizer and scheduler) and called at three points: :meth:`Checkpointer.load` before the
first iteration, :meth:`Checkpointer.save` whenever the training loop decides (``--save-interval``, the exit
conditions of :mod:`megatronish.training.exit`), :meth:`Checkpointer.finish` after the loop. When to save and
when to stop is the training loop's business; this module only saves and loads.

Asynchronous saves (``--async-save``): the rank's pieces are copied into host staging buffers allocated at
set-up (or by the first save) and reused by every later one (page-locked on CUDA; :class:`~.state.StagingBuffers`)
and a background thread writes them through DCP on the parallel context's gloo ``io`` group. The save call
itself copies only the small pieces and returns; the model and optimizer tensors are copied by the background
thread while the next forward and backward run (they change only in the next update, and the training loop calls
:meth:`Checkpointer.wait_for_snapshot` before it). Rank 0 replaces the tracker once DCP reports every rank's
files complete. Each iteration the ranks agree (one small all-reduce) whether the save finished or failed, so an
error surfaces at the same iteration everywhere; the next save or the exit waits for the previous one (the staging
buffers are not touched while a write reads them).
"""
from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from .. import device
from ..parallel import comm_log as comm
from ..parallel.context import ParallelContext
from ..parallel.random import RNGStatesTracker, tracker_or_current
from . import dcp_io, layout, megatron_format
from .common import COMMON, FORMAT, FP8, MODEL, OPTIMIZER, check_model_config, common_state, jsonable, rng_key
from .dcp_io import CheckpointError, Obj, Sharded
from .state import (
    StagingBuffers,
    capture_rng,
    model_entries,
    named_params,
    optimizer_entries,
    optimizer_state,
    restore_rng,
)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _log(msg: str) -> None:
    if _rank() == 0:
        print(msg, flush=True)


def _layout(cfg) -> dict:
    d = cfg.parallel
    layout = {"world_size": d.world_size, "tp": d.tp, "pp": d.pp, "vp": d.vp, "cp": d.cp, "ep": d.ep, "dp": d.dp}
    if d.v_shape:  # zbv's chunks hold other layers than interleaving's at the same degrees
        layout["chunks"] = "v"
    if d.uneven:  # so do an uneven split's ranks
        layout["first_last_layers"] = [d.decoder_first_pipeline_num_layers, d.decoder_last_pipeline_num_layers]
    if d.pipeline_model_parallel_layout is not None or d.account_for:  # and a layout string's / account-for's
        layout["stage_layers"] = list(d.stage_layer_counts(cfg.model.num_layers))
    return layout


class _Fp8States:
    """The FP8 managers of this rank's model chunks as one ``state_dict`` / ``load_state_dict``."""

    def __init__(self, managers):
        self.managers = list(managers) if isinstance(managers, (list, tuple)) else [managers]

    def state_dict(self) -> dict:
        out = {}
        for m in self.managers:
            out.update(m.state_dict())
        return out

    def load_state_dict(self, state: dict) -> None:
        for m in self.managers:
            m.load_state_dict(state)


class Checkpointer:
    """Save/load for one training run (see the module docstring)."""

    def __init__(self, cfg, models, optimizer, scheduler, *, parallel: ParallelContext, fp8=None,
                 rng_tracker: RNGStatesTracker | None = None, on_save=None):
        """``rng_tracker``: the run's RNG streams, saved and restored with the other generators (None: the
        current tracker, :func:`megatronish.parallel.random.get_rng_tracker`). ``on_save(iteration)``: called
        (on every rank) after each save that wrote a new iteration, e.g. the ``--save-hf`` export."""
        self.on_save = on_save
        self.cfg = cfg
        self.ck = cfg.checkpoint
        self.models = models
        self.opt = optimizer_state(optimizer)
        # --overlap-param-gather: the parameters are complete only after this (None without such an optimizer)
        self._finish_param_sync = getattr(optimizer, "finish_param_sync", None)
        self.scheduler = scheduler
        self.fp8 = _Fp8States(fp8) if fp8 else None  # one FP8 manager, or one per model chunk
        self.named = named_params(models)
        self.names = {id(p): (name, p.desc) for name, p in self.named}
        self.parallel = parallel
        self.rng_tracker = tracker_or_current(rng_tracker)
        # DCP's collectives get their own (gloo) group: async saves run them from a background thread
        self._group = parallel.io_group if dist.is_initialized() else None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        self._on_disk: str | None = None  # the iteration directory this run last loaded or saved
        self._staging = StagingBuffers()  # --async-save: the snapshot's host buffers, reused by every save
        self._snapshot: threading.Event | None = None  # set once a pending async save's deferred copies are done

    # ------------------------------------------------------------------------------------------------ load
    def load(self, state) -> bool:
        """Restore from ``--load`` into the model, optimizer, scheduler, RNG and ``state`` (iteration, consumed
        samples). Returns whether a checkpoint was loaded. Collective."""
        with dcp_io.gc_paused():
            return self._load(state)

    def _load(self, state) -> bool:
        ck = self.ck
        if not ck.load or ck.load_hf:  # a Hugging Face directory: the run's HF loader reads it (a fresh start)
            return False
        found = ck.load_resolved or layout.resolve(ck.load)  # resolved by --use-checkpoint-args, or here
        self._warn_incomplete(ck.load, found)
        if found is None:
            if ck.exit_on_missing_checkpoint:
                raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint under --load {ck.load} (no "
                                      f"{layout.TRACKER} there); fix the path or drop the flag to start fresh")
            _log(f"WARNING: no checkpoint under --load {ck.load} (no {layout.TRACKER}); starting from scratch")
            return False
        iter_dir, iteration = found
        kind = megatron_format.detect(iter_dir)
        if kind is not None:  # a Megatron-LM checkpoint (torch_dist or legacy)
            from .megatron_load import load_megatron

            return load_megatron(self, state, iter_dir, kind)
        md = dcp_io.read_index(iter_dir)
        dcp_io.check_files(iter_dir, md)
        common = dcp_io.read_bytes_entry(iter_dir, md, COMMON)
        if common.get("format") != FORMAT:
            raise CheckpointError(f"{iter_dir} is a torch.distributed.checkpoint directory but not in this "
                                  f"program's format ({common.get('format')!r})")
        check_model_config(common.get("config"), self.cfg.model, iter_dir)
        release = iteration is None or bool(common.get("release"))
        fresh = ck.finetune or release
        load_optim = not fresh and not ck.no_load_optim and self.opt is not None
        if load_optim and not common.get("optimizer"):
            raise CheckpointError(f"checkpoint {iter_dir} has no optimizer state (saved with --no-save-optim, or "
                                  "converted); pass --no-load-optim or --finetune")
        if common.get("layout") == _layout(self.cfg):  # this rank reads back what it wrote: the disk starts now
            kinds = (MODEL,) + ((OPTIMIZER,) if load_optim else ()) + ((FP8,) if self.fp8 is not None else ())
            dcp_io.read_ahead_own_shard(iter_dir, md, _rank() if self._group is None else
                                        dist.get_rank(self._group), lambda name: name.startswith(kinds))

        entries = model_entries(self.named, self.parallel)
        param_state = None
        if load_optim:
            param_state = self.opt.sharded_param_state()
            self._check_optimizer_keys(param_state, common["optimizer"], md, iter_dir)
            opt_entries = optimizer_entries(param_state, self.names, self.parallel)
            for key, entry in opt_entries.items():
                if key not in md.state_dict_metadata and key.endswith(".main_param"):
                    # an fp32-trained checkpoint: the master copy starts from the stored model weights
                    entries.add(MODEL + key[len(OPTIMIZER):-len(".main_param")], entry)
                else:
                    entries.add(key, entry)
        fp8_targets = self._fp8_targets(common, md, iter_dir)
        for key, t in (fp8_targets or {}).items():
            entries.add(FP8 + key, Sharded.whole(t))

        dcp_io.load(entries, iter_dir, process_group=self._group, index=md, verify=not ck.no_verify_checkpoint)

        if param_state is not None:
            loaded = {id(p): states for p, states in param_state}
            self.opt.load_sharded_param_state(lambda p: loaded[id(p)])
            self.opt.load_scalar_state_dict(common["optimizer"].get("scalars") or {})
            if self.scheduler is not None and common.get("scheduler") is not None:
                self.scheduler.load_state_dict(common["scheduler"])
        if fp8_targets is not None:
            self.fp8.load_state_dict({"recipe": common["fp8"].get("recipe"), **fp8_targets})
        self._load_rng(common, md, iter_dir, fresh)

        if not fresh:
            state.iteration = int(common.get("iteration", iteration or 0))
            state.consumed_samples = int(common.get("consumed_train_samples", 0))
            state.valid_consumed_samples = int(common.get("consumed_valid_samples", 0))
        self._on_disk = os.path.abspath(iter_dir)
        _log(f"loaded checkpoint {iter_dir} (iteration {common.get('iteration')}"
             + (", model only" if fresh else "") + ")")
        return True

    @staticmethod
    def _warn_incomplete(root: str, found) -> None:
        if layout.is_iteration_dir(root):
            return
        left = layout.incomplete_dirs(root, False if found is None else found[1])
        if left:
            tracked = "no tracker" if found is None else f"the tracker names {found[0]}"
            _log(f"WARNING: ignoring {len(left)} incomplete checkpoint director{'y' if len(left) == 1 else 'ies'} "
                 f"under --load {root} ({tracked}); a save that did not finish left: {', '.join(left)}")

    def _save_failed(self, iteration: int, detail: str) -> CheckpointError:
        root = self.ck.save
        try:
            prev = layout.read_tracker(root)
        except CheckpointError:
            prev = False
        kept = f"no complete checkpoint in {root} yet" if prev is False else \
            f"{layout.TRACKER} still names iteration {'release' if prev is None else prev}"
        return CheckpointError(f"--save {root}: saving iteration {iteration} failed: {detail}; {kept} (free space "
                               f"or fix the directory, then resume with --load {root})")

    def _check_optimizer_keys(self, param_state, saved: dict, md, iter_dir: str) -> None:
        have = {k for k in md.state_dict_metadata if k.startswith(OPTIMIZER)}
        for p, states in param_state:
            name = self.names[id(p)][0]
            for key in states:
                full = f"{OPTIMIZER}{name}.{key}"
                if full in have or (key == "main_param" and MODEL + name in md.state_dict_metadata):
                    continue
                raise CheckpointError(
                    f"--optimizer: checkpoint {iter_dir} has no optimizer state {key!r} for {name} (it holds "
                    f"{sorted(saved.get('param_state_keys') or [])}, saved by {saved.get('class')}); pass "
                    "--no-load-optim to start the optimizer fresh")

    def _fp8_targets(self, common, md, iter_dir):
        if self.fp8 is None:
            return None
        if not common.get("fp8"):
            _log(f"WARNING: checkpoint {iter_dir} has no FP8 scaling state; FP8 amax histories start fresh")
            return None
        current = self.fp8.state_dict()
        targets = {k: torch.empty_like(v) for k, v in current.items() if isinstance(v, torch.Tensor)}
        missing = [k for k in targets if FP8 + k not in md.state_dict_metadata]
        if missing:
            raise CheckpointError(f"checkpoint {iter_dir} has no FP8 state {missing[0]!r}; it was saved with another "
                                  "FP8 configuration (pass --finetune to start FP8 scaling fresh)")
        return targets

    def _load_rng(self, common, md, iter_dir: str, fresh: bool) -> None:
        if fresh or self.ck.no_load_rng:
            return
        if not common.get("has_rng"):
            _log(f"WARNING: checkpoint {iter_dir} has no RNG states (saved with --no-save-rng); they are "
                 "re-derived from --seed")
            return
        saved, now = common.get("layout") or {}, _layout(self.cfg)
        if saved != now:
            diff = ", ".join(f"{k} {saved.get(k)}->{now[k]}" for k in now if saved.get(k) != now[k])
            _log(f"WARNING: the RNG states in {iter_dir} do not map one-to-one to this layout ({diff}); "
                 "re-deriving them from --seed")
            return
        restore_rng(dcp_io.read_bytes_entry(iter_dir, md, rng_key(_rank())), self.rng_tracker)

    # ------------------------------------------------------------------------------------------------ save
    def save(self, state) -> None:
        """Save ``state.iteration`` to ``--save`` (collective); asynchronous with ``--async-save``."""
        before = self._on_disk
        with dcp_io.gc_paused():
            self._save(state)
        if self.on_save is not None and self._on_disk is not None and self._on_disk != before:
            self.on_save(state.iteration)

    def _save(self, state) -> None:
        ck = self.ck
        self.wait()
        iter_dir = os.path.abspath(layout.checkpoint_dir(ck.save, state.iteration))
        if iter_dir == self._on_disk:
            return  # this exact state is already on disk
        stage = bool(ck.async_save)
        if self._finish_param_sync is not None:
            self._finish_param_sync()  # the entries below read the parameters
        entries = model_entries(self.named, self.parallel)
        opt_common = None
        if not ck.no_save_optim and self.opt is not None:
            param_state = self.opt.sharded_param_state()  # collective for the distributed optimizer
            optimizer_entries(param_state, self.names, self.parallel, entries=entries)
            keys = sorted({k for _, states in param_state for k in states})
            opt_common = {"class": type(getattr(self.opt, "optimizer", self.opt)).__name__,
                          "param_state_keys": keys, "scalars": self.opt.scalar_state_dict()}
        fp8_common = None
        if self.fp8 is not None:
            sd = self.fp8.state_dict()
            for key, t in sd.items():
                if isinstance(t, torch.Tensor):
                    entries.add(FP8 + key, Sharded.whole(t.detach()))
            fp8_common = {"recipe": sd.get("recipe")}
        if not ck.no_save_rng:
            entries[rng_key(_rank())] = Obj(capture_rng(self.rng_tracker))
        if _rank() == 0:
            entries[COMMON] = Obj(common_state(
                state.iteration, jsonable(self.cfg), consumed_train_samples=state.consumed_samples,
                consumed_valid_samples=getattr(state, "valid_consumed_samples", 0), layout=_layout(self.cfg),
                scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
                optimizer=opt_common, has_rng=not ck.no_save_rng, fp8=fp8_common))
            stale = os.path.join(iter_dir, dcp_io.METADATA_FILE)
            if os.path.exists(stale):  # an earlier, unfinished attempt at this iteration
                os.remove(stale)
        try:
            os.makedirs(iter_dir, exist_ok=True)  # here, not in the writer thread: a failure stops every rank now
        except OSError as e:
            raise self._save_failed(state.iteration, str(e)) from None
        self._on_disk = iter_dir
        if stage:  # the training step may change the tensors once this returns: write from a snapshot
            # the model and optimizer tensors change only in the next update (the loop waits for the copies
            # before it: wait_for_snapshot), so they are copied on the writer thread during the next forward and
            # backward; everything else (FP8 histories change in the forward) is copied now
            copies = self._staging.stage(entries, defer=lambda key: key.startswith((MODEL, OPTIMIZER)))
        else:
            t0 = time.perf_counter()
            try:
                self._write(entries, iter_dir, state.iteration)
            except (CheckpointError, OSError) as e:
                self._on_disk = None
                raise self._save_failed(state.iteration, str(e)) from None
            _log(f"saved checkpoint {iter_dir} in {time.perf_counter() - t0:.2f} s")
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._snapshot = threading.Event()
        self._pending = (state.iteration, self._executor.submit(self._snapshot_and_write, copies, self._snapshot,
                                                                entries, iter_dir, state.iteration))
        _log(f"saving checkpoint {iter_dir} in the background")

    def _snapshot_and_write(self, copies, taken: threading.Event, entries, iter_dir: str, iteration: int) -> None:
        try:
            copies.run()
        finally:
            taken.set()  # a failed copy fails the write below, reported by poll(); the loop must not hang
        self._write(entries, iter_dir, iteration)

    def wait_for_snapshot(self) -> None:
        """Block until the pending asynchronous save's copies of the model and optimizer tensors are taken. The
        training loop calls this before anything changes them (each iteration, after the forward and backward);
        without a pending save it returns at once."""
        taken, self._snapshot = self._snapshot, None
        if taken is not None:
            taken.wait()

    def reserve_staging(self) -> None:
        """``--async-save``: allocate the snapshot's staging buffers now (at set-up) rather than in the first save.
        Collective for the distributed optimizer (its state is gathered to learn the shapes)."""
        entries = model_entries(self.named, self.parallel)
        if not self.ck.no_save_optim and self.opt is not None:
            optimizer_entries(self.opt.sharded_param_state(), self.names, self.parallel, entries=entries)
        self._staging.reserve(entries)

    def _write(self, entries, iter_dir: str, iteration: int) -> None:
        dcp_io.save(entries, iter_dir, process_group=self._group)
        if _rank() == 0:  # DCP's index is written only after every rank reported its files complete
            layout.write_tracker(self.ck.save, iteration)

    def poll(self, block: bool = False) -> None:
        """Finish a pending asynchronous save once every rank's part is done (collective when one is pending:
        all ranks agree in the same iteration); raise if it failed on any rank."""
        if self._pending is None:
            return
        iteration, fut = self._pending
        if block:
            concurrent.futures.wait([fut])
        mine_failed = fut.done() and fut.exception() is not None
        flags = torch.tensor([0 if fut.done() else 1, 1 if mine_failed else 0], dtype=torch.int64,
                             device=device.current_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            comm.all_reduce(flags)
        if flags[0].item() > 0:
            return
        self._pending = None
        if flags[1].item() > 0:
            self._on_disk = None
            err = fut.exception()
            detail = str(err) if err is not None else "it failed on another rank"
            raise self._save_failed(iteration, f"asynchronous save: {detail}")
        _log(f"checkpoint of iteration {iteration} complete")

    def wait(self) -> None:
        """Block until a pending asynchronous save is complete (collective)."""
        self.poll(block=True)

    def finish(self, state) -> None:
        """After the loop: save the final state (unless just saved) and wait for background writes."""
        try:
            if self.ck.save and state.iteration > 0:
                self.save(state)
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            sys.stdout.flush()


def setup_checkpointing(cfg, models, optimizer, scheduler, state, *, parallel: ParallelContext,
                        fp8=None, rng_tracker: RNGStatesTracker | None = None, on_save=None) -> Checkpointer:
    """Build the run's :class:`Checkpointer` and resume from ``--load`` into ``state`` (collective)."""
    ckpt = Checkpointer(cfg, models, optimizer, scheduler, parallel=parallel, fp8=fp8, rng_tracker=rng_tracker,
                        on_save=on_save)
    ckpt.load(state)
    if cfg.checkpoint.async_save and cfg.checkpoint.save:
        ckpt.reserve_staging()
    return ckpt
