"""The training loop: set-up, restore, steps, logging, checkpoints, evaluation. Reads top to bottom.
(Its stop on non-finite losses: fasttrain/nonfinite.py; torch's seeding: fasttrain/rng.py.)

python -m fasttrain [--recipe ...]                       one process (CPU or one GPU)
torchrun --nproc_per_node=N -m fasttrain [--recipe ...]   one process per device
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from fasttrain import checkpoint as ckpt
from fasttrain.config import Config
from fasttrain.curves import Curves
from fasttrain.data import build_loader, resolve_backend
from fasttrain.data.loader import batch_stream
from fasttrain.data.sharding import open_split
from fasttrain.data_dir import prepare_data_dir
from fasttrain.distributed import (
    DistInfo,
    check_graph_capture_env,
    cleanup,
    from_rank0,
    init_distributed,
    rank0_error,
    total_over_ranks,
)
from fasttrain.errors import FasttrainError, SettingError
from fasttrain.eval_pass import EvaluationInterrupted, describe, eval_scalars, evaluate_raw_and_ema
from fasttrain.input_stall import InputStall
from fasttrain.lock import RunLock, claim_run_dir, ensure_run_id
from fasttrain.monitor import MetricsLog, StopRequest, log_step, progress_bar, run_summary
from fasttrain.nonfinite import check_finite
from fasttrain.precision import resolve_precision
from fasttrain.resume import restore_run, save_config, save_run
from fasttrain.resume_source import has_checkpoint
from fasttrain.rng import get_rng_state, seed_torch, set_rng_state
from fasttrain.run import build_run
from fasttrain.run_config import processes_per_node, resolve_node_batch
from fasttrain.schedule import LRSchedule
from fasttrain.step import LOSS_AVERAGE_WEIGHT
from fasttrain.threads import available_cores, choose_input, local_ranks


def train(cfg: Config) -> dict:
    started = time.perf_counter()
    cfg = resolve_node_batch(cfg, processes_per_node(cfg.node_batch_size))  # a node's over its processes
    info = init_distributed(cfg.device)
    # Every way out from here, errors at start-up included (a refused resume, a config.json that
    # cannot be written), undoes what was made: the lock, the process group, the graph.
    lock = stop = curves = run = None
    try:
        log = print if info.is_main else (lambda *a, **k: None)
        precision = resolve_precision(cfg, info.device)
        if cfg.profile_comm and precision.cuda_graph:
            raise SettingError(
                "profile_comm times each all-reduce from Python hooks, which a CUDA graph "
                "replay skips: add cuda_graph=false",
                settings=("profile_comm", "cuda_graph"),
            )
        check_graph_capture_env(info, precision.cuda_graph)
        seed_torch(cfg, info.device)

        # --- data ------------------------------------------------------------------------------
        data_dir = prepare_data_dir(cfg, info, log)
        # The backend "auto" resolves to on this device: what config.json and the start-up line name.
        backend = resolve_backend(cfg, info.device)
        cfg = dataclasses.replace(cfg, data_dir=str(data_dir or ""), data_backend=backend)
        # --num_workers and --loader auto: what they chose is on the start-up line, and why where it matters.
        choice = choose_input(cfg, info.device.type == "cuda", backend)
        auto = ""
        if backend != "synthetic" and cfg.num_workers is None:
            ranks = local_ranks()
            auto = f"; auto for {available_cores()} cores, {ranks} rank{'s' * (ranks > 1)}"
        auto += f"; {choice.why}" if choice.why else ""
        cfg = choice.apply(cfg)
        train_loader = build_loader(
            cfg,
            cfg.subset,
            training=True,
            rank=info.rank,
            world_size=info.world_size,
            device=info.device,
            precision=precision,
            reuse_buffers=True,  # the zero-copy ring: batch_stream holds a step's micro-batches only
        )
        if (cfg.eval_at_end or cfg.eval_every_epochs) and cfg.data_dir:  # a missing validation shard: now
            open_split(cfg, "validation", False, info.rank, info.world_size)
        if len(train_loader) < cfg.grad_accum_steps:
            # A step's micro-batches come from one epoch (batch_stream): none could ever fill one, and the
            # loop went from epoch to epoch without a step, deaf to stop signals (checked between steps).
            raise SettingError(
                f"an epoch holds {len(train_loader)} batches per rank, fewer than grad_accum_steps "
                f"{cfg.grad_accum_steps}: no step can be made; lower grad_accum_steps or batch_size",
                settings=("grad_accum_steps", "batch_size"),
            )
        global_batch = cfg.batch_size * info.world_size * cfg.grad_accum_steps
        epoch_size = cfg.epoch_size or train_loader.num_records
        steps_per_epoch = max(1, epoch_size // global_batch)
        eval_every = max(1, round(cfg.eval_every_epochs * steps_per_epoch)) if cfg.eval_every_epochs else 0

        # --- run directory ----------------------------------------------------------------------
        run_dir = Path(cfg.train_dir or Path("runs") / (cfg.recipe or "base"))  # recipe None: the base Config
        lock = claim_on_rank0(run_dir, info, log)
        metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=info.is_main)

        # --- model, optimizer, step; then resume ----------------------------------------------------
        schedule = LRSchedule(cfg, epoch_size / global_batch, global_batch, info.device)  # the seeds' float
        fresh = not has_checkpoint(cfg, run_dir, info)  # rank 0's answer on every rank
        run = build_run(cfg, info, precision, schedule, train_loader, pretrained=fresh, log=log)
        resume_lines: list[str] = []  # printed after the header, and not "resuming" when nothing is left
        try:
            step = restore_run(cfg, run, run_dir=run_dir, log=resume_lines.append, epoch_size=epoch_size)
        except FasttrainError:
            for line in resume_lines:  # the reasons its message refers to
                log(line)
            raise
        # Another global batch than the checkpoint's: what is set in epochs goes on in epochs of data.
        clock_offset, max_steps, note = run.epoch_clock.apply(cfg, step, schedule, epoch_size, global_batch)
        resume_lines += [note] if note else []
        finished = step >= max_steps  # a finished run, evaluated again: its config.json stays as it was
        problem = ""
        if info.is_main:
            try:
                if not finished:  # only now: a refused resume leaves the run's config.json as it was
                    save_config(cfg, run_dir)
                ensure_run_id(run_dir, cfg.checkpoint_dir, log=log)  # run.json: the run's identity (lock.py)
            except OSError as exc:  # a full disk, a directory where the file should be: one line
                problem = (
                    f"cannot write {exc.filename or run_dir} ({exc.strerror}); free space in {run_dir} or "
                    "pass another train_dir"
                )
        # Every rank stops with rank 0's line, not the others later in their first all-reduce.
        if problem := rank0_error(problem, info):
            raise FasttrainError(
                problem if info.is_main else "stopping with rank 0, which cannot write train_dir",
                settings=("train_dir",),
            )
        if dropped := metrics.resume_at(step):  # rank 0's file: each step once, as the curves' purge_step
            resume_lines.append(dropped)
        # The input as the loader built it ("torch, 4 loader threads").
        data = f"{data_dir} ({train_loader.description}{auto})" if data_dir else "synthetic"
        log(
            f"fasttrain: {cfg.recipe} | {cfg.model_name} | {info.world_size} x {info.device.type} | "
            f"{precision.name}{' channels_last' if precision.channels_last else ''}"
            f"{' cuda-graph' if precision.cuda_graph else ''}"
            f"{' compiled' if run.step.compiled is not None and run.step.compiled.active else ''}"
            f"{' stem4' if precision.stem_channels == 4 else ''}"
            f"{' triton-bn' if cfg.bn_kernels == 'triton' else ''}"
            f" | global batch {global_batch} | "
            f"{steps_per_epoch} steps/epoch | data {data} | run dir {run_dir}"
        )
        if finished:
            log(
                f"{run_dir} already holds a finished run at step {step} (max_steps {max_steps}): "
                f"{'evaluating it' if cfg.eval_at_end else 'nothing to do (--eval_at_end=false)'}, not "
                f"training; for a new run pass a new --train_dir (e.g. --train_dir={run_dir}-2), to "
                f"train this one further a --max_steps above {step}"
            )
            resume_lines = [line for line in resume_lines if not line.startswith("resuming from")]
        for line in resume_lines:
            log(line)
        for line in getattr(train_loader, "notes", ()):  # e.g. the torch loader's hint on row checkpoints
            log(line)

        curves = Curves(run_dir, cfg.tensorboard and info.is_main, start_step=step)
        step_fn = run.step

        # --- the loop ------------------------------------------------------------------------------
        # With several ranks the stop check all-reduces a flag and reads it back, at the log steps only
        # (the loss read has drained the GPU): a signal is acted on within log_every steps.
        stop = StopRequest(check_every=cfg.log_every)
        progress = progress_bar(max_steps, step, enabled=info.is_main)
        last_saved, tick, tick_step = step, time.perf_counter(), step
        skipped_before = int(step_fn.scaler.skipped_steps.item())  # note: host read, once (a resume's count)
        batches = batch_stream(train_loader, cfg.grad_accum_steps)
        stall = InputStall(train_loader, info.device.type == "cuda", log, cfg.num_workers)
        step_fn.timeline = stall if stall.cuda else None  # its timing events around each step
        # The loss and top-1 means since the last log line: the step's device-side sums (rank 0's, as the
        # seed logs one tower's), read and zeroed at log steps. The seed's smoothed curve: loss_average.
        eval_loader = None  # built at the first evaluation
        last_eval: dict = {}  # the newest evaluation's result and step, for the summary at the end
        first_step, loop_start, eval_seconds = step, time.perf_counter(), 0.0

        def evaluate_now() -> dict:
            # The RNG states are put back (a DataLoader seeds from torch's generator), the training loader
            # and step untouched: a run with evaluations trains the same.
            nonlocal eval_loader
            rng = get_rng_state()
            if eval_loader is None:
                eval_loader = build_loader(
                    dataclasses.replace(cfg, batch_size=cfg.eval_batch_per_process),
                    "validation",
                    training=False,
                    rank=info.rank,
                    world_size=info.world_size,
                    device=info.device,
                    precision=precision,
                    reuse_buffers=True,  # evaluate() is done with a batch before it asks for the next
                )
            result = evaluate_raw_and_ema(
                run.model,
                eval_loader,
                optimizer=run.optimizer,
                bn_ema=run.bn_ema,
                precision=precision,
                device=info.device,
                cfg=cfg,
                world_size=info.world_size,
                progress=log,
                interrupted=lambda: stop.flag,  # a stop signal ends it at the next batch (the grace period)
            )
            set_rng_state(rng)
            # A finished run evaluated again by the same command: its step's evaluation is written once.
            if not (finished and metrics.has_row(step, split="validation")):
                metrics.write(step=step, split="validation", **result)
                curves.scalars(step, eval_scalars(result))
            last_eval.update(result, step=step)
            return result

        def log_row() -> None:
            """The seeds' log line and a metrics row for the steps since the last one (their mean loss)."""
            nonlocal tick, tick_step, skipped_before
            # note: CPU-GPU sync point, once per log_every steps
            cross_entropy, streak = step_fn.last_loss.item(), int(step_fn.nonfinite_streak.item())
            # The seeds' logged loss holds the L2 term (fasttrain's update adds its gradient instead): of the
            # weights after this step's update, theirs before it, one update apart.
            l2 = run.optimizer.l2_term().item()
            loss = cross_entropy + l2
            skipped = int(step_fn.scaler.skipped_steps.item())
            loss_avg = step_fn.loss_sum.item() / (step - tick_step) + l2
            train_top1 = step_fn.top1_sum.item() / (step - tick_step)
            step_fn.loss_sum.zero_()
            step_fn.top1_sum.zero_()
            elapsed, tick = time.perf_counter() - tick, time.perf_counter()
            sec_per_batch = elapsed / (step - tick_step)
            first, tick_step = tick_step + 1, step
            log_step(log, progress, step, loss, global_batch / sec_per_batch, sec_per_batch, train_top1)
            input_fields = stall.read(first, step, elapsed)  # after the seeds' line: its note follows
            record = dict(
                loss=loss,
                loss_avg=loss_avg,
                # The seed averages the total loss, its shadow from 0: after n steps the L2 term's share
                # of it is l2 * (1 - 0.9^n) (n: the steps so far; fewer where a non-finite loss was left out).
                loss_ema=step_fn.loss_average.item() + l2 * (1 - (1 - LOSS_AVERAGE_WEIGHT) ** step),
                cross_entropy=cross_entropy,  # with the aux head's share (Inception): the loss without L2
                l2_loss=l2,
                train_top1=train_top1,
                lr=schedule.at(step - 1),
                examples_per_sec=global_batch / sec_per_batch,
                sec_per_batch=sec_per_batch,
                loss_scale=step_fn.scaler.scale.item(),
                skipped_steps=skipped,
                **input_fields,  # input_stall, and the thread loader's loader_busy, loader_off_cpu
            )
            metrics.write(
                step=step,
                **record,
                epoch=train_loader.epoch,
                skipped_records=total_over_ranks(train_loader.skipped, info),  # every rank's skips
            )
            curves.scalars(step, {f"train/{k}": v for k, v in record.items()})
            if cfg.histogram_every and step % cfg.histogram_every == 0:
                # note: a host read, at histogram steps only (log steps, where the loss read has synced)
                curves.histograms(step, run.model, step_fn.last_grad_scale.item())
            skipped_here, skipped_before = skipped - skipped_before, skipped
            check_finite(streak, skipped_here, first, step, cfg, precision, last_saved, run_dir, info.is_main)
            if step_fn.buckets is not None and (comm := step_fn.buckets.comm_stats()) is not None:
                log(
                    f"all-reduce: {comm['comm_ms']:.1f} ms/step in {len(comm['buckets'])} buckets, "
                    f"{comm['hidden_fraction']:.0%} hidden behind backward, "
                    f"{comm['exposed_ms']:.1f} ms exposed"
                )
                metrics.write(
                    step=step,
                    comm_ms=comm["comm_ms"],
                    comm_hidden_fraction=comm["hidden_fraction"],
                    comm_exposed_ms=comm["exposed_ms"],
                )

        def summary(loop_end: float) -> str:
            trained = step - first_step
            seconds = loop_end - loop_start - eval_seconds
            return run_summary(trained, trained * global_batch, seconds, time.perf_counter() - started)

        def periodic_evaluation() -> None:
            nonlocal tick, eval_seconds
            eval_started = time.perf_counter()
            try:
                log(f"step {step}: {describe(evaluate_now())}")
            except EvaluationInterrupted:  # a stop signal: not worth a grace period's seconds
                log(f"step {step}: evaluation cut short by {stop.signal_name or 'a stop signal'}")
            took = time.perf_counter() - eval_started
            tick += took  # not counted in the next line's images/s, nor in the summary's
            eval_seconds += took
            stall.skip()

        def periodic_step(at: int) -> bool:
            due = bool(eval_every) and (at + clock_offset) % eval_every == 0  # clock: epoch_clock.py
            return due and not (at == max_steps and cfg.eval_at_end)

        # A resume at a step whose evaluation has no row (cut short by a stop signal, or killed) evaluates
        # it first: the loop evaluates only after the steps it makes. Rank 0's file decides for all.
        if step > 0 and not finished and periodic_step(step):
            if from_rank0(not metrics.has_row(step, split="validation"), info):
                log(f"step {step}: its evaluation did not finish before the run stopped; evaluating it now")
                periodic_evaluation()

        while step < max_steps:
            step_fn(stall.next_batch(batches))
            step += 1
            progress.update(1)
            if step % cfg.log_every == 0 or step == max_steps:
                log_row()
            if step % cfg.checkpoint_every == 0 or step == max_steps:
                save_run(run_dir, step, run, cfg=cfg, total_steps=max_steps, epoch_size=epoch_size)
                last_saved = step
                stall.skip()  # the gap the save makes is not the input's
            evaluated = periodic_step(step)
            if evaluated:
                periodic_evaluation()
            # After an evaluation (every rank makes one at the same steps) the ranks agree at once: a
            # signal that cut it short is acted on now, not up to log_every steps later.
            if stop.requested(info, step, now=bool(evaluated)):
                if last_saved != step:  # a checkpoint step has just saved it
                    save_run(run_dir, step, run, cfg=cfg, total_steps=max_steps, epoch_size=epoch_size)
                    last_saved = step  # a skipped step changes nothing it holds: a good checkpoint
                if tick_step != step:  # the steps since the last row: a resume goes on after them
                    log_row()  # after the save: its non-finite check may stop the run here
                progress.close()
                log(
                    f"stopped by {stop.signal_name} at step {step}; checkpoint "
                    f"{ckpt.checkpoint_path(run_dir, step)} written; run the same command to resume; "
                    f"{summary(time.perf_counter())}"
                )
                return {"step": step, "stopped": True}
        progress.close()
        loop_end = time.perf_counter()  # the final evaluation is not in the training loop's time
        # The training input pipeline is suspended mid-epoch inside `batches`: close it, so that
        # evaluation does not hold two (DALI's pipeline and decoder buffers, the DataLoader's workers).
        batches.close()
        step_fn.release_graph()  # its memory goes back for evaluation

        # --- evaluation ------------------------------------------------------------------------
        # The last line of every run that ends here: its time, images/s and final top-1.
        result = {"step": step}
        if cfg.eval_at_end:
            try:
                result.update(evaluate_now())
            except EvaluationInterrupted:  # the last checkpoint is written: only the evaluation is left
                log(
                    f"stopped by {stop.signal_name or 'a stop signal'} during the final evaluation; the "
                    f"run's last checkpoint {ckpt.checkpoint_path(run_dir, step)} is written, and the same "
                    f"command evaluates it; {summary(loop_end)}"
                )
                return {"step": step, "stopped": True}
            chance = 1.0 / cfg.num_classes
            verdict = "above" if result["top1"] > 2 * chance else "NOT clearly above"
            final = f"{describe(result)}; chance is {chance:.3f}, so top-1 is {verdict} chance"
        elif last_eval:
            final = f"last evaluated at step {last_eval['step']}: {describe(last_eval)}"
        else:
            final = "not evaluated (--eval_at_end=false)"
        log(f"done: step {step}, {summary(loop_end)}; {final}")
        return result
    finally:
        # Every way out, errors included: the graph goes before the process group, whose NCCL communicator
        # otherwise waits at exit for the graph that captured its collectives (pytorch/pytorch#115388).
        if stop is not None:
            stop.restore()
        if curves is not None:
            curves.close()
        if run is not None:
            run.step.release_graph()
        cleanup()
        if lock is not None:
            lock.release()


# --- named pieces of the loop -----------------------------------------------------------------


def claim_on_rank0(run_dir: Path, info: DistInfo, log: Callable[[str], None]) -> RunLock | None:
    """Rank 0 locks run_dir (only rank 0 writes there, see fasttrain/lock.py); every rank stops
    together with rank 0's SettingError when it cannot."""
    lock, problem = None, ""
    if info.is_main:
        try:
            lock = claim_run_dir(run_dir, log)
        except SettingError as exc:
            problem = str(exc)
    if problem := rank0_error(problem, info):
        raise SettingError(
            problem if info.is_main else "stopping with rank 0, which cannot use train_dir",
            settings=("train_dir",),
        )
    return lock
