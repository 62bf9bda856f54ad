"""The load policy: which checkpoint a run resumes from (the memory tier or storage, --ckpt-step,
--pretrained-checkpoint) and what of it it takes (--finetune, --no-load-optim, --no-load-rng), with the checks that refuse, before anything is read, a
checkpoint this run cannot take. How a format's bytes are read is its CheckpointFormat's."""
from __future__ import annotations

import logging
import os
import time

from datastates import CheckpointError, LocalTier, find_latest, paths, read_index

from ..optimizer_state import chain_length, load_optimizer_state
from ..virtual_pipeline import chunks_sharded_state_dict, load_chunks
from . import optimizer_kinds
from .formats import DatastatesFormat, CheckpointFormat, detect
from .state import (build_state, current_layout, describe_layout, describe_model_layout, layout_of, model_layout,
                    rng_sharded_object, set_rng_state, sharded_metadata)

log = logging.getLogger(__name__)


class LoadPolicy:
    """Loads the latest checkpoint under --load into the model (and optimizer, scheduler, RNG)."""

    def __init__(self, args, model, optimizer, scheduler, ckpt_format: CheckpointFormat, tier: LocalTier | None):
        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.checkpoint_format, self.tier = ckpt_format, tier

    def load(self) -> tuple[int, int]:
        """(iteration, consumed samples) of what was loaded; (0, 0) when there is nothing to load.

        As upstream: --pretrained-checkpoint is fine-tuned from (weights only, iteration 0) when --load holds no
        checkpoint, and --ckpt-step loads that iteration instead of the tracker's, from storage (both checked at
        start, `argument_checks`). A restart of a fine-tuning job resumes from the memory tier like any other."""
        args = self.args
        finetune_from = args.pretrained_checkpoint if not getattr(args, "load_exists", False) else None
        root = finetune_from or args.load
        if root is None:
            return 0, 0
        latest = find_latest(root if args.ckpt_step is None else paths.checkpoint_dir(root, args.ckpt_step))
        in_storage = latest.iteration if isinstance(latest.iteration, int) and not finetune_from else None
        if self.tier is not None and args.ckpt_step is None:
            local = self.tier.choose(in_storage)
            if local is not None:
                ckpt_format = DatastatesFormat(args, self.model, self.optimizer, self.scheduler,
                                               engine=self.tier.engine)
                return _told(self.load_sharded(ckpt_format, local, "the memory tier"), "the memory tier", local,
                             in_storage, saved_in=self._layout_before(", saved in {}"))
        if latest.iteration is None:
            if args.exit_on_missing_checkpoint:
                raise CheckpointError(f"--load {args.load!r}: no checkpoint found")
            log.warning("could not find a checkpoint at %s; training from scratch", args.load)
            return 0, 0
        if finetune_from:
            args.finetune = True  # upstream's choice too: the weights only, from iteration 0
            log.info(f"--load {args.load!r} holds no checkpoint: fine-tuning from --pretrained-checkpoint "
                     f"{latest.path}")
        cls = detect(latest.path)
        # this run's format reads it where it is of that format and on --save's storage; else a reader of its own
        ckpt_format = self.checkpoint_format if type(self.checkpoint_format) is cls and \
            self.checkpoint_format.reads(latest.path) else cls.for_loading(args, self.model, self.optimizer,
                                                                             self.scheduler, root)
        try:
            return _told(ckpt_format.load(self, latest.path, root), "storage", latest.path, in_storage,
                         memory=self._memory_unused())
        finally:
            if ckpt_format is not self.checkpoint_format:
                ckpt_format.close()

    def _memory_unused(self) -> str:
        """Why a resume from storage did not come from the memory tier, for its line."""
        if self.tier is None:
            return "no memory tier"
        return "the memory tier had nothing newer" + self._layout_before(" in this layout or in {}")

    def _layout_before(self, say: str) -> str:
        """`say` filled with the layout the memory tier held before a change of layout; "" when it did not change."""
        old = self.tier.replaced
        return "" if old is None else say.format(f"{describe_layout(old['layout'])} of world size "
                                                 f"{old['world_size']}")

    def load_sharded(self, ckpt_format: CheckpointFormat, ckpt_dir: str, source: str) -> tuple[int, int]:
        """Load a sharded checkpoint directory (datastates, torch_dist) read by `ckpt_format`; (iteration, consumed)."""
        args = self.args
        load_optim = not (args.no_load_optim or args.finetune)
        t0 = time.perf_counter()
        if args.finetune:  # the weights only: a model-only checkpoint (e.g. from upstream) has nothing else
            chunks = chunks_sharded_state_dict(self.model, sharded_metadata(args))
            load_chunks(self.model, ckpt_format.read(chunks, ckpt_dir))
            log.info(f"successfully loaded the model weights of {ckpt_dir} ({ckpt_format.name}) for fine-tuning from "
                     f"iteration 0 in {(time.perf_counter() - t0) * 1e3:.1f} ms")
            return 0, 0
        saved = ckpt_format.saved_common(ckpt_dir)
        _require_training_state(ckpt_dir, set(saved), load_optim)
        metadata = saved.get("content_metadata") or sharded_metadata(args)
        if load_optim:
            _require_loadable_optimizer(ckpt_dir, args, saved.get("args"), metadata)
        crossing = load_optim and optimizer_kinds.crosses(saved.get("args"), args)
        if crossing:  # the distributed optimizer reads the other kind's state in its fully_reshardable layout
            metadata = {**metadata, "distrib_optim_sharding_type": "fully_reshardable"}
        template_args = _LoadArgs(args, no_save_optim=not load_optim, no_save_rng=True)
        # The RNG states are rank-local (one per (pp, tp, dp) coordinate): they are read in a second step, only
        # when the checkpoint's layout is this run's (see _restore_rng). Everything else reshards.
        state = build_state(template_args, self.model, self.optimizer, self.scheduler, 0, 0,
                            wrap_common=ckpt_format.wraps_common, is_loading=True, metadata=metadata,
                            saved_chain=chain_length(saved.get("optimizer") or ()))
        if crossing:
            state["optimizer"] = optimizer_kinds.template_as_saved(
                state["optimizer"], ckpt_format.saved_optimizer(ckpt_dir), not args.use_distributed_optimizer,
                args.bf16)
        loaded = ckpt_format.read(state, ckpt_dir)
        load_chunks(self.model, loaded)
        if load_optim:
            load_optimizer_state(self.optimizer, loaded["optimizer"])
            self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        it = int(loaded["iteration"])
        saved_layout = layout_of(loaded.get("args"))
        if not (args.no_load_rng or args.finetune):
            self._restore_rng(lambda template: ckpt_format.read(template, ckpt_dir), saved_layout, it)
        if saved_layout is not None and saved_layout != current_layout():
            log.info(f"resharded checkpoint {ckpt_dir} from {describe_layout(saved_layout)} to "
                     f"{describe_layout(current_layout())}")
        consumed = int(loaded["train_state"]["consumed_train_samples"])
        stats = ckpt_format.read_stats(ckpt_dir)
        log.info(f"successfully loaded checkpoint from {source} ({ckpt_format.name}) at iteration {it} "
                 f"in {(time.perf_counter() - t0) * 1e3:.1f} ms" + ("" if stats is None else f"; {stats.describe()}"))
        return it, consumed

    def load_whole(self, state: dict, source: str) -> tuple[int, int]:
        """Load a legacy whole-state checkpoint of this (tp, pp) rank (`torch`); (iteration, consumed)."""
        args = self.args
        load_chunks(self.model, state)
        if not (args.no_load_optim or args.finetune):
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["opt_param_scheduler"])
        if not (args.no_load_rng or args.finetune):
            from megatron.core import parallel_state as ps
            rngs = state["rng_state"]
            set_rng_state(rngs[ps.get_data_parallel_rank() % len(rngs)])
        it = 0 if args.finetune else int(state["iteration"])
        consumed = 0 if args.finetune else int(state["train_state"]["consumed_train_samples"])
        log.info(f"successfully loaded checkpoint from {source} (torch) at iteration {it}")
        return it, consumed

    def _restore_rng(self, read, saved_layout, iteration: int) -> None:
        """Restore this rank's RNG states when the checkpoint has this run's (tp, pp, dp) layout.

        RNG states are per rank: under another layout there is no saved state that belongs to this rank (and
        another world size may have none at all), so, as Megatron-LM does on a TP/PP change, they are not loaded;
        every rank re-seeds deterministically from --seed and the loaded iteration instead (the same numbers on
        every rerun of the same layout). A checkpoint whose args name no layout is treated as this run's."""
        from ..initialize import set_seed
        now = current_layout()
        if saved_layout is None or saved_layout == now:
            rng = read({"rng_state": rng_sharded_object()})["rng_state"]
            set_rng_state(rng[0] if isinstance(rng, list) else rng)
            return
        seed = self.args.seed + iteration
        log.info(f"NOTICE: the checkpoint was saved with {describe_layout(saved_layout)}, this run is "
                 f"{describe_layout(now)}: its per-rank RNG states are not loaded; RNGs re-seeded from "
                 f"--seed + iteration = {seed}")
        set_seed(seed)


def _told(loaded: tuple[int, int], level: str, ckpt_dir: str, in_storage: int | None,
          memory: str = "the memory tier had nothing newer", saved_in: str = ""):
    """Say, in one line, which level the run resumed from, at which iteration, how old that state is and which
    torchrun attempt this is (the first question after a restart); `loaded` passes through."""
    iteration = loaded[0]
    if iteration == 0:  # --finetune: not a resume
        return loaded
    try:
        created = read_index(ckpt_dir).created_unix
    except CheckpointError:  # torch_dist and torch checkpoints have no index: their age is not recorded
        created = None
    age = "" if created is None else f", saved {max(0.0, time.time() - created):.1f} s ago"
    others = memory if level == "storage" else \
        ("storage has nothing yet" if in_storage is None else f"storage's newest: {in_storage}") + saved_in
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    attempt = (f"; torchrun restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} of {restarts}"
               if restarts != "0" else "")
    log.info(f"RESUMED from {level} at iteration {iteration}{age} ({others}){attempt}: {ckpt_dir}")
    return loaded


def _require_training_state(ckpt_dir: str, names: set[str], load_optim: bool) -> None:
    """A resume needs the iteration and the data position (and the scheduler with the optimizer): a checkpoint
    without them, e.g. the weights megatron-core's `dist_checkpointing.save` wrote from a model, gets a message
    naming the flag that loads it, before anything is read."""
    missing = [n for n in ("iteration", "train_state") if n not in names]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt_dir!r} has no {' and no '.join(missing)}: it holds no training "
                              "state to resume (a model-only checkpoint?); pass --finetune to train from its "
                              "weights starting at iteration 0")
    if load_optim and "opt_param_scheduler" not in names:
        raise CheckpointError(f"checkpoint {ckpt_dir!r} has no optimizer state (no opt_param_scheduler); pass "
                              "--no-load-optim to resume with a fresh optimizer, or --finetune")


def _require_loadable_optimizer(ckpt_dir: str, args, saved_args, metadata: dict) -> None:
    """Refuse, before reading, an optimizer state this run cannot take: another optimizer kind, or the
    distributed optimizer's dp_reshardable layout (flat bucket shards of one TP x PP domain) into another TP/PP."""
    if saved_args is None:
        return
    saved_dist = bool(getattr(saved_args, "use_distributed_optimizer", False))
    why = optimizer_kinds.refusal(saved_args, args, metadata) if optimizer_kinds.crosses(saved_args, args) else None
    if why:
        raise CheckpointError(
            f"checkpoint {ckpt_dir!r} was saved {'with' if saved_dist else 'without'} --use-distributed-optimizer "
            f"and this run is {'with' if args.use_distributed_optimizer else 'without'} it, and {why}; match the "
            "flag, or pass --no-load-optim to start a fresh optimizer")
    saved_layout, now = layout_of(saved_args), current_layout()
    if saved_dist and metadata.get("distrib_optim_sharding_type") == "dp_reshardable" and \
            saved_layout is not None and saved_layout[:2] != now[:2]:
        raise CheckpointError(
            f"checkpoint {ckpt_dir!r} holds the distributed optimizer in megatron-core's dp_reshardable layout, "
            f"saved with {describe_layout(saved_layout)}; it reshards across DP sizes only, and this run is "
            f"{describe_layout(now)}. Save with --dist-ckpt-optim-fully-reshardable to change TP/PP, or pass "
            "--no-load-optim")
    saved_model, now_model = model_layout(saved_args), model_layout(args)
    fully_reshardable = saved_dist and metadata.get("distrib_optim_sharding_type") == "fully_reshardable"
    chain_changes = (saved_model[0] > 1) != (now_model[0] > 1)  # experts get their own optimizer with EP > 1
    if saved_model != now_model and not fully_reshardable and (saved_dist or chain_changes):
        raise CheckpointError(
            f"checkpoint {ckpt_dir!r} was saved with {describe_model_layout(saved_model)} and this run is "
            f"{describe_model_layout(now_model)}: its optimizer state moves to another expert or virtual pipeline "
            "layout only in the distributed optimizer's fully_reshardable layout (save with "
            "--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable), or pass --no-load-optim")


class _LoadArgs:
    """args seen through the load flags (what the template must ask for)."""

    def __init__(self, args, **overrides):
        self._args, self._over = args, overrides

    def __getattr__(self, name):
        if name in self.__dict__.get("_over", {}):
            return self._over[name]
        return getattr(self._args, name)
